"""The FP8 KV cache end to end on the CPU: the engine with ``kv_cache_dtype="fp8"`` against the
same model with an fp32 cache, the checkpoint's k/v scales loaded and used, and the cache's
size (one byte per element: twice the blocks of a bf16 cache in the same memory)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.attention.backends.base import FP8_KV_DTYPE, UNIT_KV_SCALES, KVScales
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
from pagedserve.model.kv_scales import kv_scale_target
from pagedserve.outputs import CompletionOutput
from pagedserve.worker import kv_cache
from pagedserve.worker.model_runner import ModelRunner
from tests.worker.agreement import assert_agree_where_they_part

PROMPTS = [[(7 * i + 13 * j) % 90 + 3 for j in range(5 + 4 * i)] for i in range(4)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
# Layer 0 stores its scales as vLLM's fp8 checkpoints do, layer 1 as older compressed-tensors.
# Powers of two: FP8 rounds x / scale as it rounds x, so the cache bytes compare exactly.
CHECKPOINT_SCALES = {
    "model.layers.0.self_attn.k_scale": 1 / 64,
    "model.layers.0.self_attn.v_scale": 1 / 32,
    "model.layers.1.self_attn.k_proj.output_scale": 1 / 16,
    "model.layers.1.self_attn.v_proj.output_scale": 1 / 8,
}


def _generate(model_dir: Path, **kwargs: object) -> tuple[list[CompletionOutput], LLM]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", skip_tokenizer_init=True,
              block_size=4, max_num_seqs=4, kv_cache_memory=2**22, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [out.outputs[0] for out in outputs], llm


def _cache(llm: LLM, layer: str) -> torch.Tensor:
    """[2, num_blocks, block_size, Hkv, D] of one layer of the engine's runner."""
    return llm.engine_core.model_runner.kv_caches[f"model.layers.{layer}.self_attn.attn"]


def test_fp8_cache_engine_agrees_with_an_fp32_cache(tiny_llama_dir: Path) -> None:
    """Also against itself once its prompts' FP8 blocks are prefix-cache hits."""
    reference, _ = _generate(tiny_llama_dir)
    fp8, llm = _generate(tiny_llama_dir, kv_cache_dtype="fp8")
    assert _cache(llm, "0").dtype == FP8_KV_DTYPE
    assert all(len(out.token_ids) == PARAMS.max_tokens for out in fp8)
    assert_agree_where_they_part(reference, fp8)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in again] == [out.token_ids for out in fp8]
    assert llm.engine_core.scheduler.kv_cache_manager.prefix_cache_hits > 0


def _with_kv_scales(model_dir: Path, folder: Path) -> Path:
    """A copy of the checkpoint in ``model_dir`` with CHECKPOINT_SCALES added."""
    folder.mkdir()
    for file in model_dir.iterdir():
        if file.suffix == ".json":
            shutil.copy(file, folder / file.name)
    tensors = load_file(model_dir / "model.safetensors")
    tensors.update({name: torch.tensor(value) for name, value in CHECKPOINT_SCALES.items()})
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_checkpoint_kv_scales_are_loaded_and_used(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The scales reach the layers; the cache holds value / scale (the bytes of the unscaled
    cache, times 1 / scale); and decoding over it agrees with the fp32 cache."""
    scaled_dir = _with_kv_scales(tiny_llama_dir, tmp_path / "scaled")
    reference, _ = _generate(tiny_llama_dir)
    unscaled, plain = _generate(tiny_llama_dir, kv_cache_dtype="fp8")
    scaled, llm = _generate(scaled_dir, kv_cache_dtype="fp8")
    layers = llm.engine_core.model_runner.attn_layers
    assert layers["model.layers.0.self_attn.attn"].kv_scales == KVScales(1 / 64, 1 / 32)
    assert layers["model.layers.1.self_attn.attn"].kv_scales == KVScales(1 / 16, 1 / 8)
    assert plain.engine_core.model_runner.attn_layers[
        "model.layers.0.self_attn.attn"].kv_scales is UNIT_KV_SCALES
    for layer in ("0", "1"):
        got, base = _cache(llm, layer).float(), _cache(plain, layer).float()
        assert base.abs().max() > 0
        scales = layers[f"model.layers.{layer}.self_attn.attn"].kv_scales
        for part, scale in ((0, scales.k), (1, scales.v)):
            # Equal but where e4m3's subnormals (below 2**-6) round x and x / scale apart, and
            # where that changed a later input a little. An ignored scale misses everywhere.
            close = torch.isclose(got[part] * scale, base[part], rtol=0.07, atol=2**-9)
            assert close.float().mean() > 0.99
    assert_agree_where_they_part(reference, scaled)
    assert_agree_where_they_part(unscaled, scaled)


def test_kv_scale_names_of_each_checkpoint_format() -> None:
    attn = "model.layers.3.self_attn.attn"
    for suffix, which in ((".k_scale", "k"), (".v_scale", "v"), (".attn.k_scale", "k"),
                          (".k_proj.k_scale", "k"), (".v_proj.v_scale", "v"),
                          (".k_proj.output_scale", "k"), (".v_proj.output_scale", "v"),
                          (".kv_scale", "kv")):
        assert kv_scale_target(f"model.layers.3.self_attn{suffix}") == (attn, which)
    for other in (".k_proj.weight_scale", ".k_proj.input_scale", ".q_proj.weight"):
        assert kv_scale_target(f"model.layers.3.self_attn{other}") is None


def _runner(model_dir: Path, dtype: str, kv_cache_dtype: str, budget: int) -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype),
        cache=CacheConfig(block_size=4, kv_cache_memory=budget, kv_cache_dtype=kv_cache_dtype),
        device="cpu",
    )
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    return runner


def test_an_fp8_cache_holds_twice_the_blocks_of_a_bf16_one(tiny_llama_dir: Path) -> None:
    budget = 2**20
    bf16 = _runner(tiny_llama_dir, "bfloat16", "auto", budget)
    fp8 = _runner(tiny_llama_dir, "bfloat16", "fp8", budget)
    per_block = kv_cache.kv_bytes_per_block(bf16.attn_layers, 4, bf16.kv_cache_dtype)
    assert kv_cache.kv_bytes_per_block(fp8.attn_layers, 4, fp8.kv_cache_dtype) * 2 == per_block
    assert fp8.determine_num_blocks() == 2 * bf16.determine_num_blocks() == 2 * (
        budget // per_block)
