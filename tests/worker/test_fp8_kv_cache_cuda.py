"""The FP8 KV cache on an FP8 GPU (compute capability 8.9+), the whole GPU path: the fused
rotary + FP8 KV write, the paged-attention kernels reading FP8 inside compiled pieces and CUDA
graphs, the GEMV forward of batch-1 steps, prefix-cache hits on FP8 blocks. Against the same
engine with a bf16 cache: greedy tokens equal, or where they first differ each engine's token
is in the other's top 5. Run with ``TRITON_INTERPRET=0``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.attention.backends.base import FP8_KV_DTYPE
from pagedserve.outputs import CompletionOutput
from pagedserve.platform.base import FP8_MIN_CAPABILITY
from tests.model.hf_tiny import make_hf_model
from tests.worker.agreement import assert_agree_where_they_part

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY,
    reason="needs a GPU with FP8 (compute capability 8.9+)")

PROMPTS = [[(7 * i + 13 * j) % 197 + 2 for j in range(5 + 9 * i)] for i in range(6)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5)


def _run(model_dir: Path, kv_cache_dtype: str, quantization: str | None) -> list[CompletionOutput]:
    """The batch, then the first prompt alone (a batch-1 decode: the GEMV forward), then the
    batch again (its prompts' blocks now prefix-cache hits)."""
    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization,
              gpu_memory_utilization=0.3, max_num_seqs=8)
    layer = llm.engine_core.model_runner.attn_layers["model.layers.0.self_attn.attn"]
    assert layer.kv_cache is not None
    assert (layer.kv_cache.dtype == FP8_KV_DTYPE) == (kv_cache_dtype == "fp8")
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = []
    for batch in (requests, requests[:1], requests):
        outputs += [out.outputs[0] for out in llm.generate(batch, PARAMS, use_tqdm=False)]
    llm.engine_core.shutdown()
    return outputs


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_fp8_kv_cache_agrees_with_bf16_where_they_part(
    tmp_path: Path, quantization: str | None
) -> None:
    make_hf_model("llama").save_pretrained(tmp_path)
    bf16 = _run(tmp_path, "auto", quantization)
    fp8 = _run(tmp_path, "fp8", quantization)
    assert all(len(out.token_ids) == PARAMS.max_tokens for out in fp8)
    assert_agree_where_they_part(bf16, fp8)
