"""``pagedserve trace``: the ``seed`` scenario's step, step by step, read from the runner's own
buffers.

A tiny random Llama (with a tiny BPE tokenizer) stands in for the default model: every value
checked here is set by the scenario, not by the weights.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.entrypoints import cli
from pagedserve.entrypoints.trace_run import seed_arrivals
from tests.engine.tiny_models import make_tokenizer

PAGEDSERVE = Path(sys.executable).parent / "pagedserve"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Long enough for R1's 541 tokens; the vocabulary is the tokenizer's."""
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=None)
    folder = tmp_path_factory.mktemp("trace_llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _trace(model: Path, *args: str) -> tuple[int, str]:
    """``pagedserve trace`` in this process; returns (exit code, stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["trace", "--model", str(model), "--dtype", "float32",
                         "--device", "cpu", "--kv-cache-memory", str(8 << 20), *args])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def seed(tiny_model: Path) -> dict:
    code, out = _trace(tiny_model, "--scenario", "seed", "--json")
    assert code == 0
    return json.loads(out)


def test_seed_plan_and_batch(seed: dict) -> None:
    plan, batch = seed["stops"]["plan"], seed["stops"]["batch"]
    assert seed["step"] == 2 and seed["engine"]["block_size"] == BLOCK_SIZE
    assert plan["req_id_to_index"] == {"R1": 1023, "R2": 1022, "R3": 1021}
    assert plan["num_computed_tokens"] == {"R1": 540, "R2": 129, "R3": 0}
    assert plan["prefill_len"]["R3"] == 298
    assert plan["num_blocks"]["R3"] == 19 and len(plan["block_ids"]["R3"]) == 19
    assert batch["req_ids"] == ["R1", "R2", "R3"]
    assert batch["idx_mapping"] == [1023, 1022, 1021]
    assert batch["uniform_decode_len"] is None and batch["has_prefill"] is True
    assert batch["descriptor"] == {"mode": "PIECEWISE", "num_tokens": 304, "num_reqs": None}
    assert batch["capture_sizes"][-3:] == [480, 496, 512] and 264 not in batch["capture_sizes"]


def test_seed_inputs(seed: dict) -> None:
    inputs = seed["stops"]["inputs"]
    r3_prompt = seed_arrivals(len(make_tokenizer()), seed=0)[2].prompt
    assert inputs["input_ids"]["real"][2:] == r3_prompt  # R3's prompt ids, copied on the device
    assert inputs["query_start_loc"][:4] == [0, 1, 2, 300]
    assert inputs["query_start_loc_buffer"]["tail_values"] == [300]
    positions = inputs["positions"]
    assert positions["shape"] == [304] and positions["dtype"] == "int64"
    assert positions["real"][:4] == [540, 129, 0, 1] and positions["real"][-1] == 297
    assert positions["real"] == [540, 129, *range(298)]
    assert len(inputs["input_ids"]["real"]) == 300 and len(inputs["input_ids"]["padding"]) == 4
    assert inputs["seq_lens"] == [541, 130, 298]
    assert inputs["logits_indices"] == [0, 1, 299]
    pad = inputs["is_padding"]
    assert (pad["real_rows"], pad["padding_rows"], pad["first_padding_row"]) == (300, 4, 300)


def test_seed_block_tables_and_slot_mapping(seed: dict) -> None:
    attn, plan = seed["stops"]["attn"], seed["stops"]["plan"]
    assert attn["block_tables"]["shape"][0] == 3
    assert len(attn["block_tables"]["rows"]["R3"]) == 19
    assert attn["block_tables"]["rows"] == {r: plan["block_ids"][r] for r in ("R1", "R2", "R3")}
    r1, r2, r3 = (attn["requests"][r] for r in ("R1", "R2", "R3"))
    assert (r1["last_token"]["block_index"], r1["last_token"]["offset"]) == (33, 12)
    assert (r2["last_token"]["block_index"], r2["last_token"]["offset"]) == (8, 1)
    assert r1["last_token"]["position"] == 540 and r2["last_token"]["position"] == 129
    assert r3["positions"] == [0, 297] and r3["block_indexes"] == [0, 18]
    assert r3["tokens_in_last_block"] == 10
    slot_mapping = attn["slot_mapping"]
    assert slot_mapping["dtype"] == "int64" and slot_mapping["shape"] == [304]
    assert slot_mapping["padding"] == [-1] * 4
    assert -1 not in slot_mapping["real"]


def test_seed_metadata_forward_logits_sample(seed: dict) -> None:
    stops = seed["stops"]
    fields = stops["metadata"]["fields"]
    assert (fields["num_reqs"], fields["num_actual_tokens"]) == (3, 300)
    assert (fields["max_query_len"], fields["max_seq_len"]) == (298, 541)
    assert fields["query_start_loc"] == [0, 1, 2, 300] and fields["seq_lens"] == [541, 130, 298]
    assert fields["slot_mapping"] == {"dtype": "int64", "shape": [304]}
    assert stops["metadata"]["layers"]["count"] == 2
    assert stops["forward"]["hidden_states"]["shape"] == [304, 32]
    assert stops["logits"]["logits"]["shape"][0] == 3
    assert stops["logits"]["logits_indices"] == [0, 1, 299]
    sample = stops["sample"]
    assert list(sample["sampled_token_ids"]) == ["R1", "R2", "R3"]
    assert sample["last_sampled_tokens"] == sample["sampled_token_ids"]
    assert sample["idx_mapping"] == [1023, 1022, 1021]
    assert len(set(sample["sampled_token_ids"].values())) == 3  # one noise stream per request


def test_prompt_trace_of_a_decode_step(tiny_model: Path) -> None:
    """Two prompts: step 1 prefills both; step 2 decodes both (a uniform decode, FULL graph)
    and reads its input ids from the tokens step 1 sampled."""
    prompts = ["--prompt", "Hello world", "The quick brown fox", "--temperature", "0", "--json"]
    _, out1 = _trace(tiny_model, *prompts)
    code, out2 = _trace(tiny_model, *prompts, "--step", "2")
    step1, trace = json.loads(out1)["stops"], json.loads(out2)
    stops = trace["stops"]
    lens = [r["num_prompt_tokens"] for r in trace["requests"]]
    assert code == 0 and trace["scenario"] == "prompts" and trace["step"] == 2
    assert step1["batch"]["query_lens"] == sorted(lens)
    assert stops["plan"]["num_computed_tokens"] == {"R1": lens[0], "R2": lens[1]}
    assert stops["batch"]["uniform_decode_len"] == 1
    assert stops["batch"]["descriptor"] == {"mode": "FULL", "num_tokens": 2, "num_reqs": 2}
    assert stops["inputs"]["positions"]["real"] == lens
    assert stops["inputs"]["seq_lens"] == [n + 1 for n in lens]
    sampled = step1["sample"]["sampled_token_ids"]
    assert stops["inputs"]["input_ids"]["real"] == [sampled["R1"], sampled["R2"]]
    assert set(stops["sample"]["text"]) == {"R1", "R2"}


def test_text_output_shows_every_stop(tiny_model: Path) -> None:
    code, out = _trace(tiny_model, "--scenario", "seed")
    assert code == 0
    for stop in ("1 plan", "2 batch", "3 inputs", "4 attn", "5 metadata", "6-12 forward",
                 "13 logits", "14 sample"):
        assert f"\n{stop}: " in out
    for line in (
        'req_id_to_index = {"R1": 1023, "R2": 1022, "R3": 1021}',
        "num_computed_tokens_np[[1023, 1022, 1021]] = [540, 129, 0]",
        "block table row lengths = R1: 34, R2: 9, R3: 19",
        "uniform_decode_len = None",
        "batch_desc = BatchDescriptor(mode=PIECEWISE, num_tokens=304, num_reqs=None)",
        "query_start_loc int32 [4] = [0, 1, 2, 300]",
        "positions int64 [304] = R1 [540] | R2 [129] | R3 [0, 1, 2, 3, 4, 5, ..., 295, 296, 297]"
        " | 4 padding rows",
        "4 padding rows [-1, -1, -1, -1]  # PAD_SLOT_ID",
        "block index 33, offset 12; that block now holds 13 tokens",
        "block indexes 0..18; position 297",
        "that block now holds 10 tokens",
        "m = AttentionMetadata(num_reqs=3, num_actual_tokens=300, max_query_len=298, "
        "max_seq_len=541,",
    ):
        assert line in out, line


def test_too_late_a_step_is_a_usage_error(tiny_model: Path, capsys) -> None:
    code, _ = _trace(tiny_model, "--prompt", "Hello", "--max-tokens", "1", "--step", "3")
    assert code == 2
    assert "step: every request finished after step 1" in capsys.readouterr().err


def test_command_line_runs_the_trace(tiny_model: Path) -> None:
    """The installed command, once, in its own process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [str(PAGEDSERVE), "trace", "--model", str(tiny_model), "--dtype", "float32",
         "--device", "cpu", "--prompt", "Hello", "--json"],
        capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stops"]["batch"]["req_ids"] == ["R1"]
