"""The ``seed`` scenario's step (``pagedserve trace --scenario seed``), step by step, read
through the runner's trace observer (docs/architecture.md#one-engine-step).

Block size 16, 1024 request slots, H200 capture sizes on one ladder for both modes (vLLM pads
PIECEWISE on the dense FULL ladder; pagedserve's default PIECEWISE ladder is sparser, see
tests/worker/test_cudagraph.py). R1 (540-token prompt) and R2 (129) are prefilled in a first
step, so the traced step finds them decoding at 540 and 129 computed tokens while R3 arrives
with a 298-token prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.attention.backends.base import PAD_SLOT_ID
from pagedserve.config import default_capture_sizes
from pagedserve.worker.tracer import RecordingTracer, tracing
from tests.worker.conftest import TINY_LLAMA, build_runner
from tests.worker.hand_plans import HandScheduler

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def seed_trace(tiny_llama_dir: Path) -> dict:
    runner = build_runner(tiny_llama_dir, max_num_seqs=1024, max_num_batched_tokens=1024,
                          block_size=BLOCK_SIZE, num_blocks=80,
                          piecewise_capture_sizes=tuple(default_capture_sizes(512)))
    gen = torch.Generator().manual_seed(1)
    prompts = {r: torch.randint(0, TINY_LLAMA["vocab_size"], (n,), generator=gen).tolist()
               for r, n in (("R1", 540), ("R2", 129), ("R3", 298))}
    sched = HandScheduler(BLOCK_SIZE)
    runner.execute_model(sched.step(new=[("R1", prompts["R1"], 540), ("R2", prompts["R2"], 129)]))
    first = runner.sample_tokens()
    with tracing(runner, RecordingTracer()) as tracer:
        runner.execute_model(sched.step(new=[("R3", prompts["R3"], 298)],
                                        running=[("R1", 1), ("R2", 1)]))
        output = runner.sample_tokens()
    return {"stops": tracer.stops, "first": first, "output": output, "prompts": prompts,
            "runner": runner}


def test_stop1_plan_applied_to_slots(seed_trace: dict) -> None:
    plan = seed_trace["stops"]["plan"]
    assert plan["req_id_to_index"] == {"R1": 1023, "R2": 1022, "R3": 1021}
    assert plan["num_computed_tokens"][[1023, 1022, 1021]].tolist() == [540, 129, 0]
    assert plan["prefill_len"][1021] == 298
    assert plan["num_blocks"][1021] == 19  # ceil(298 / 16)


def test_stop2_batch_order_and_descriptor(seed_trace: dict) -> None:
    batch = seed_trace["stops"]["batch"]
    assert batch["req_ids"] == ["R1", "R2", "R3"]
    assert batch["idx_mapping"].tolist() == [1023, 1022, 1021]
    assert batch["uniform_decode_len"] is None
    assert batch["descriptor"] == {"mode": "PIECEWISE", "num_tokens": 304, "num_reqs": None}
    assert batch["execution_mode"] == "NONE"  # the CPU runs eagerly, padded all the same


def test_stop3_inputs(seed_trace: dict) -> None:
    inputs = seed_trace["stops"]["inputs"]
    first, prompts = seed_trace["first"], seed_trace["prompts"]
    assert inputs["query_start_loc"].tolist() == [0, 1, 2, 300]
    assert (inputs["query_start_loc_buffer"][4:] == 300).all()  # entries 4..1024 repeat 300
    input_ids = inputs["input_ids"]
    assert input_ids.shape == (304,) and input_ids.dtype == torch.int32
    first_tokens = dict(zip(first.req_ids, first.sampled_token_ids, strict=True))
    assert input_ids[:2].tolist() == first_tokens["R1"] + first_tokens["R2"]
    assert input_ids[2:300].tolist() == prompts["R3"]
    positions = inputs["positions"]
    assert positions.shape == (304,) and positions.dtype == torch.int64
    assert positions[:300].tolist() == [540, 129] + list(range(298))
    assert inputs["seq_lens"].tolist() == [541, 130, 298]
    assert inputs["logits_indices"].tolist() == [0, 1, 299]
    assert inputs["is_padding"].tolist() == [False] * 300 + [True] * 4


def test_stop4_block_tables_and_slot_mapping(seed_trace: dict) -> None:
    attn, plan = seed_trace["stops"]["attn"], seed_trace["stops"]["plan"]
    rows = plan["block_table"]
    slot_mapping = attn["slot_mapping"]
    assert attn["block_table"].shape[0] == 3
    assert torch.equal(attn["block_table"][2, :19], torch.from_numpy(rows[1021, :19]))
    assert slot_mapping.shape == (304,) and slot_mapping.dtype == torch.int64
    assert slot_mapping[0].item() == rows[1023, 33] * BLOCK_SIZE + 12  # 540 = 33 x 16 + 12
    assert slot_mapping[1].item() == rows[1022, 8] * BLOCK_SIZE + 1  # 129 = 8 x 16 + 1
    r3_blocks = slot_mapping[2:300] // BLOCK_SIZE
    assert r3_blocks.unique_consecutive().tolist() == rows[1021, :19].tolist()
    assert (r3_blocks == rows[1021, 18]).sum().item() == 10  # the last block holds 10 tokens
    assert slot_mapping[300:].tolist() == [PAD_SLOT_ID] * 4


def test_stop5_one_metadata_for_all_layers(seed_trace: dict) -> None:
    stop = seed_trace["stops"]["metadata"]
    m = stop["metadata"]
    assert (m["num_reqs"], m["num_actual_tokens"], m["max_query_len"], m["max_seq_len"]) == (
        3, 300, 298, 541)
    assert m["query_start_loc"].tolist() == [0, 1, 2, 300]
    assert m["seq_lens"].tolist() == [541, 130, 298]
    assert m["slot_mapping"].shape == (304,) and m["causal"] is True
    assert stop["layer_names"] == [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def test_stops12_to_14_hidden_logits_sampled(seed_trace: dict) -> None:
    stops, output = seed_trace["stops"], seed_trace["output"]
    assert stops["forward"]["hidden_states"].shape == (304, TINY_LLAMA["hidden_size"])
    assert stops["logits"]["logits"].shape == (3, TINY_LLAMA["vocab_size"])
    assert stops["logits"]["logits_indices"].tolist() == [0, 1, 299]
    sampled = stops["sample"]["sampled_token_ids"].tolist()
    assert output.req_ids == ["R1", "R2", "R3"]
    assert output.sampled_token_ids == [[t] for t in sampled]
    last = stops["sample"]["last_sampled_tokens"]
    assert last[[1023, 1022, 1021]].tolist() == sampled
