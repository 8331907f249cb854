"""FP8 checkpoints under tensor parallelism: each rank's FP8 weights and scales are its slice
of the TP=1 model's (per-channel scales split with their rows; per-tensor scales of fused
shards cover their rows on every rank), and a TP=2 engine gives the TP=1 engine's outputs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve import LLM
from pagedserve.layers.linear import LinearBase, RowParallelLinear
from pagedserve.layers.quantization.fp8_ops import FP8_DTYPE, dequantize_rows
from tests.distributed.test_shard_loading import TP, _load, _reassemble
from tests.distributed.tiny_tp import ARCHS, ENGINE_ARGS, assert_same_outputs, generate
from tests.model.fp8_checkpoints import FORMATS, write_fp8_checkpoint


@pytest.fixture(scope="module")
def fp8_checkpoint(checkpoint, tmp_path_factory):
    """(arch, format) -> folder of the tiny TP checkpoint stored as FP8."""
    cache: dict = {}

    def get(arch: str, fmt: str):
        if (arch, fmt) not in cache:
            hf_model = AutoModelForCausalLM.from_pretrained(checkpoint(arch)).eval()
            folder = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            write_fp8_checkpoint(hf_model, folder, FORMATS[fmt])
            cache[arch, fmt] = folder
        return cache[arch, fmt]

    return get


def _effective_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each linear layer's dequantized weight and its scale buffer, by name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            assert module.weight.dtype == FP8_DTYPE, name
            scale = module.get_buffer("weight_scale")
            out[f"{name}.weight"] = dequantize_rows(module.weight, scale)
            out[f"{name}.weight_scale"] = scale
    return out


@pytest.mark.parametrize("fmt", ["compressed-tensors-channel", "fp8-static"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_rank_shards_reassemble_to_the_tp1_model(arch, fmt, fp8_checkpoint) -> None:
    folder = fp8_checkpoint(arch, fmt)
    whole = _effective_weights(_load(folder, "safetensors", 0, 1))
    ranks = [_load(folder, "safetensors", r, TP) for r in range(TP)]
    modules = [dict(m.named_modules()) for m in ranks]
    rank_tensors = [_effective_weights(m) for m in ranks]
    for name, expected in whole.items():
        owner = name.rsplit(".", 1)[0]
        module = modules[0][owner]
        shards = [t[name] for t in rank_tensors]
        if name.endswith("weight_scale") and not isinstance(module, RowParallelLinear):
            shards = [s.unsqueeze(-1) for s in shards]  # split by rows, like the weight
            expected = expected.unsqueeze(-1)
        rebuilt = _reassemble(module, shards, [m[owner] for m in modules])
        torch.testing.assert_close(rebuilt, expected, rtol=0, atol=0, msg=name)


def test_fp8_tp2_engine_matches_tp1(fp8_checkpoint) -> None:
    folder = str(fp8_checkpoint("llama", "compressed-tensors-channel"))
    tp1 = generate(LLM(folder, **ENGINE_ARGS))
    llm = LLM(folder, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        assert_same_outputs(generate(llm), tp1)
    finally:
        llm.engine_core.shutdown()
