"""``calculate_kv_scales`` on the CPU: a model whose keys and values far exceed e4m3's 448 is
ruined by an FP8 cache at scale 1.0 and agrees with an fp32 cache once its first step has
calibrated the scales."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.attention.backends.base import KVScales
from pagedserve.attention.kv_quant import calibrated_kv_scales
from pagedserve.config import CacheConfig
from pagedserve.layers.quantization.fp8_ops import FP8_MAX
from pagedserve.outputs import CompletionOutput
from tests.worker.agreement import assert_agree_where_they_part

PROMPTS = [[(7 * i + 13 * j) % 90 + 3 for j in range(6 + 5 * i)] for i in range(3)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
KV_GAIN = 2000.0  # k_proj / v_proj weights times this: keys and values in the thousands
LAYER0 = "model.layers.0.self_attn.attn"


def _loud_kv(model_dir: Path, folder: Path) -> Path:
    """A copy of the checkpoint with the k and v projections scaled by KV_GAIN (q_proj scaled
    down as much, so the attention scores stay those of the original model)."""
    folder.mkdir()
    for file in model_dir.iterdir():
        if file.suffix == ".json":
            shutil.copy(file, folder / file.name)
    tensors = load_file(model_dir / "model.safetensors")
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * KV_GAIN
        elif name.endswith("q_proj.weight"):
            tensors[name] = tensors[name] / KV_GAIN
        elif name.endswith("o_proj.weight"):
            tensors[name] = tensors[name] / KV_GAIN
    save_file(tensors, folder / "model.safetensors")
    return folder


def _generate(model_dir: Path, **kwargs: Any) -> tuple[list[CompletionOutput], LLM]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", skip_tokenizer_init=True,
              block_size=4, max_num_seqs=4, kv_cache_memory=2**22, **kwargs)  # fmt: skip
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [out.outputs[0] for out in outputs], llm


def _first_logprob_gap(a: list[CompletionOutput], b: list[CompletionOutput]) -> float:
    """Largest difference of the first token's top-5 logprobs (a's top 5, looked up in b)."""
    gap = 0.0
    for x, y in zip(a, b, strict=True):
        assert x.logprobs is not None and y.logprobs is not None
        for token, lp in x.logprobs[0].items():
            other = y.logprobs[0].get(token)
            gap = max(gap, float("inf") if other is None else abs(lp.logprob - other.logprob))
    return gap


def test_calibrated_scales_match_fp32_where_unit_scales_saturate(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    loud = _loud_kv(tiny_llama_dir, tmp_path / "loud")
    reference, _ = _generate(loud)
    unit, _ = _generate(loud, kv_cache_dtype="fp8")
    calibrated, llm = _generate(loud, kv_cache_dtype="fp8", calculate_kv_scales=True)
    scales = llm.engine_core.model_runner.attn_layers[LAYER0].kv_scales
    assert scales.k > 1.0 and scales.v > 1.0  # the loud values need scales above 1
    assert not llm.engine_core.model_runner.attn_layers[LAYER0].calibrate_kv_scales
    gap_unit = _first_logprob_gap(reference, unit)
    gap_calibrated = _first_logprob_gap(reference, calibrated)
    print(f"first-token logprob gap: unit scales {gap_unit:.3g}, calibrated {gap_calibrated:.3g}")
    assert gap_calibrated < 0.1 < gap_unit
    assert_agree_where_they_part(reference, calibrated)


def test_calibrated_scales_bound_the_rotated_keys() -> None:
    """The keys' scale is the largest pair norm / 448: any rotation of a pair stays within it."""
    key = torch.zeros(2, 8)  # [T, Hkv * D], one head of D = 8: pairs (j, j + 4)
    key[1, 1], key[1, 5] = 300.0, 400.0  # one pair of norm 500
    value = torch.full((2, 8), -900.0)
    got = calibrated_kv_scales(key, value, head_dim=8)
    assert got == KVScales(500.0 / FP8_MAX, 900.0 / FP8_MAX)
    zero = calibrated_kv_scales(torch.zeros(1, 8), torch.zeros(1, 8), head_dim=8)
    assert zero.k > 0 and zero.v > 0


def test_calculate_kv_scales_needs_an_fp8_cache() -> None:
    with pytest.raises(ValueError, match="calculate_kv_scales: needs kv_cache_dtype fp8"):
        CacheConfig(calculate_kv_scales=True)
    assert CacheConfig(calculate_kv_scales=True, kv_cache_dtype="fp8").calculate_kv_scales
