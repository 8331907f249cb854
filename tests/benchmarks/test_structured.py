"""benchmarks/structured.py on the CPU: its synthetic tokenizer, and the whole benchmark at
the tiny preset (the GPU run uses the same code at the Llama-3-8B shape)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks.script_loader import loaded_script


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with loaded_script("structured") as module:
        yield module


def test_synthetic_tokenizer_covers_the_vocabulary(bench: ModuleType, tmp_path: Path) -> None:
    config = {"vocab_size": 4096, "bos_token_id": 4000, "eos_token_id": 4001}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokenizer = bench.synthetic_tokenizer(tmp_path)
    assert len(tokenizer) == 4096
    assert tokenizer.eos_token_id == 4001 and tokenizer.bos_token_id == 4000
    text = '{"name": "Ada Lovelace", "age": 36, "tags": ["x\\"y"]}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and len(ids) < len(text)
    vocab = tokenizer.get_vocab()
    assert any('"' in token and len(token) > 1 for token in vocab)  # a string can end mid-token


def test_tiny_preset_runs_and_compares_like_with_like(bench: ModuleType, tmp_path: Path) -> None:
    result = bench.main(["--preset", "tiny", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "structured.json").read_text()) == result
    pair = result["throughput"]["pairs"][0]
    assert pair["valid_json"] == pair["ended_by_grammar"]
    assert 0 < pair["mean_output_tokens"] <= bench.TINY.output_len
    assert pair["ratio"] == pytest.approx(
        pair["constrained_tok_per_s"] / pair["unconstrained_tok_per_s"])
    step = result["batch1"]
    assert step["extra_ms"] == pytest.approx(
        step["constrained_step_ms"] - step["unconstrained_step_ms"])
    ttft = result["ttft"]
    assert all(ttft[f"{k}_ttft_ms"] > 0 for k in ("unconstrained", "cached_schema", "new_schema"))
