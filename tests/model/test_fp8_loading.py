"""FP8 weights end to end on the CPU: FP8 checkpoints (compressed-tensors, fp8, ModelOpt;
sharded) against transformers running the same dequantized weights, online
``quantization="fp8"`` of an unquantized checkpoint, and FP8 dummy weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from pagedserve import LLM, SamplingParams
from pagedserve.config import ModelConfig
from pagedserve.layers.linear import LinearBase
from pagedserve.layers.quantization.fp8 import Fp8LinearMethod, Fp8OnlineLinearMethod
from pagedserve.layers.quantization.fp8_ops import FP8_DTYPE, dequantize_rows
from pagedserve.model.gemv_decode import GemvDecodeForward, unsupported_reason
from pagedserve.model.loader import load_model
from pagedserve.platform.base import FP8_MIN_CAPABILITY
from tests.model.fp8_checkpoints import FORMATS, INPUT_SCALE, LINEARS, write_fp8_checkpoint
from tests.model.hf_tiny import make_hf_model
from tests.model.paged_harness import greedy_generate

CPU = torch.device("cpu")
PROMPT = [3, 17, 99, 5, 64, 2, 41, 8, 120, 77]
STEPS = 6


def tiny_hf_llama() -> PreTrainedModel:
    return make_hf_model("llama")


def load(folder: Path, **kwargs) -> torch.nn.Module:
    config = ModelConfig(model=str(folder), dtype="float32", **kwargs)
    return load_model(config, CPU, torch.float32)[0]


def ours(model: torch.nn.Module) -> tuple[torch.Tensor, list[int]]:
    """(fp32 logits [T, vocab] of the prompt and every generated position, greedy tokens)."""
    (seq,) = greedy_generate(model, [PROMPT], num_steps=STEPS)
    return torch.stack(seq.logits), seq.generated


@torch.no_grad()
def reference(hf_model: PreTrainedModel) -> tuple[torch.Tensor, list[int]]:
    """The same from transformers: greedy decoding by full forwards."""
    tokens = list(PROMPT)
    for _ in range(STEPS):
        logits = hf_model(torch.tensor([tokens])).logits[0].float()
        tokens.append(int(logits[-1].argmax()))
    return logits, tokens[len(PROMPT):]


def linear_layers(model: torch.nn.Module) -> dict[str, LinearBase]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}


CASES = [("llama", fmt) for fmt in sorted(FORMATS)] + [
    ("llama_head_dim_bias", "compressed-tensors-tensor"),  # biases; per-tensor fused shards
    ("qwen2", "compressed-tensors-channel"),  # q/k/v biases, tied embeddings
    ("qwen3", "fp8-static"),
]


@pytest.mark.parametrize(("case", "fmt"), CASES)
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(
    tmp_path: Path, case: str, fmt: str
) -> None:
    hf_model = make_hf_model(case)
    dequantized = write_fp8_checkpoint(hf_model, tmp_path, FORMATS[fmt])
    hf_model.load_state_dict(dequantized, strict=False)
    model = load(tmp_path)

    for name, layer in linear_layers(model).items():
        assert isinstance(layer.linear_method, Fp8LinearMethod), name
        assert layer.weight.dtype == FP8_DTYPE, name
        assert layer.get_buffer("weight_scale").shape == (layer.output_size_per_rank,), name
    logits, tokens = ours(model)
    ref_logits, ref_tokens = reference(hf_model)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits[: logits.shape[0]], rtol=0, atol=1e-4)


def test_static_input_scale_is_the_largest_of_fused_shards(tmp_path: Path) -> None:
    """q / k / v (and gate / up) see the same input: one scale, the largest of theirs."""
    write_fp8_checkpoint(tiny_hf_llama(), tmp_path, FORMATS["fp8-static"])
    layer = load(tmp_path).model.layers[0]
    scale = {name: INPUT_SCALE * (LINEARS.index(name) + 1) for name in LINEARS}
    expected = {"self_attn.qkv_proj": scale["v_proj"], "self_attn.o_proj": scale["o_proj"],
                "mlp.gate_up_proj": scale["up_proj"], "mlp.down_proj": scale["down_proj"]}
    for name, value in expected.items():
        buffer = layer.get_submodule(name).get_buffer("input_scale")
        torch.testing.assert_close(buffer, torch.tensor([value]), msg=name)


def test_online_fp8_stores_float8_and_stays_close_to_the_unquantized_model(
    tmp_path: Path,
) -> None:
    hf_model = tiny_hf_llama()
    hf_model.save_pretrained(tmp_path)
    unquantized, fp8 = load(tmp_path), load(tmp_path, quantization="fp8")

    layers = linear_layers(fp8)
    assert len(layers) == 4 * hf_model.config.num_hidden_layers
    for name, layer in layers.items():
        assert isinstance(layer.linear_method, Fp8OnlineLinearMethod), name
        assert layer.weight.dtype == FP8_DTYPE, name
        scale = layer.get_buffer("weight_scale")
        assert scale.dtype == torch.float32 and scale.shape == (layer.output_size_per_rank,)
        full = linear_layers(unquantized)[name].weight
        # A scale per row: each row's largest magnitude is the largest FP8 value.
        torch.testing.assert_close(scale, full.abs().amax(dim=1) / 448.0)
        deq = dequantize_rows(layer.weight, scale)
        assert ((deq - full).abs() <= full.abs() * 2**-4 + scale[:, None] * 2**-9).all(), name

    # The prompt's logits (greedy continuations may part ways): FP8's 3 mantissa bits round
    # each weight by up to 1/16 of itself (3.6% rms), and the logits move by about as much.
    logits, ref_logits = ours(fp8)[0][: len(PROMPT)], ours(unquantized)[0][: len(PROMPT)]
    error = (logits - ref_logits).norm() / ref_logits.norm()
    assert 0.005 < error < 0.1


def test_online_fp8_equals_transformers_on_its_dequantized_weights(tmp_path: Path) -> None:
    hf_model = tiny_hf_llama()
    hf_model.save_pretrained(tmp_path)
    model = load(tmp_path, quantization="fp8")
    with torch.no_grad():
        for layer_idx, layer in enumerate(model.model.layers):
            hf_layer = hf_model.model.layers[layer_idx]
            _copy_dequantized(layer.self_attn.qkv_proj, [hf_layer.self_attn.q_proj,
                              hf_layer.self_attn.k_proj, hf_layer.self_attn.v_proj])
            _copy_dequantized(layer.self_attn.o_proj, [hf_layer.self_attn.o_proj])
            _copy_dequantized(layer.mlp.gate_up_proj, [hf_layer.mlp.gate_proj,
                              hf_layer.mlp.up_proj])
            _copy_dequantized(layer.mlp.down_proj, [hf_layer.mlp.down_proj])
    logits, tokens = ours(model)
    ref_logits, ref_tokens = reference(hf_model)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits[: logits.shape[0]], rtol=0, atol=1e-4)


def _copy_dequantized(layer: LinearBase, hf_linears: list[torch.nn.Linear]) -> None:
    deq = dequantize_rows(layer.weight, layer.get_buffer("weight_scale"))
    for hf_linear, part in zip(hf_linears, deq.split([m.out_features for m in hf_linears]),
                               strict=True):
        hf_linear.weight.copy_(part)


def test_dummy_fp8_weights_are_the_quantized_dummy_weights(tmp_path: Path) -> None:
    tiny_hf_llama().config.save_pretrained(tmp_path)
    plain = load(tmp_path, load_format="dummy", seed=3)
    fp8 = load(tmp_path, load_format="dummy", seed=3, quantization="fp8")
    for name, layer in linear_layers(fp8).items():
        assert layer.weight.dtype == FP8_DTYPE, name
        full = linear_layers(plain)[name].weight
        deq = dequantize_rows(layer.weight, layer.get_buffer("weight_scale"))
        torch.testing.assert_close(deq, full, rtol=2**-4, atol=1e-4, msg=name)


def test_dummy_weights_of_an_fp8_checkpoint_are_quantized_at_load(tmp_path: Path) -> None:
    write_fp8_checkpoint(tiny_hf_llama(), tmp_path, FORMATS["modelopt"])
    model = load(tmp_path, load_format="dummy")
    for layer in linear_layers(model).values():
        assert isinstance(layer.linear_method, Fp8OnlineLinearMethod)
        assert layer.weight.dtype == FP8_DTYPE


def test_fp8_model_runs_one_token_steps_on_the_gemv_kernels(tmp_path: Path) -> None:
    """The fused GEMV kernels read FP8 weights with their row scales
    (``tests/model/test_gemv_decode.py`` compares their outputs)."""
    tiny_hf_llama().config.save_pretrained(tmp_path)
    fp8 = load(tmp_path, load_format="dummy", quantization="fp8")
    assert unsupported_reason(fp8, fp8.one_token_layers) is None
    assert isinstance(fp8.one_token_forward(), GemvDecodeForward)


def test_bf16_weight_in_an_fp8_checkpoint_is_named(tmp_path: Path) -> None:
    hf_model = tiny_hf_llama()
    write_fp8_checkpoint(hf_model, tmp_path, FORMATS["fp8-dynamic"], num_files=1)
    from safetensors.torch import load_file, save_file

    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match=f"{name}.*float8_e4m3fn.*bfloat16"):
        load(tmp_path)


def _fp8_gpu() -> bool:
    return (torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY)


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


@pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 tensor cores")
def test_fp8_on_the_gpu_agrees_with_bf16_where_they_part(tmp_path: Path) -> None:
    """The whole GPU path (FP8 GEMMs in compiled pieces and CUDA graphs, the FP8 GEMV for
    batch-1 decode) against the bf16 engine: where greedy tokens first differ, each engine's
    token is among the other's top 5."""
    tiny_hf_llama().save_pretrained(tmp_path)
    prompts = [[(7 * i + 13 * j) % 197 + 2 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    runs = {}
    for quantization in (None, "fp8"):
        llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", quantization=quantization,
                  skip_tokenizer_init=True, gpu_memory_utilization=0.3, max_num_seqs=8)
        batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                             use_tqdm=False)
        alone = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        runs[quantization] = [out.outputs[0] for out in batch + alone]  # alone: batch 1
        llm.engine_core.shutdown()
    for bf16, fp8 in zip(runs[None], runs["fp8"], strict=True):
        first = _first_divergence(bf16.token_ids, fp8.token_ids)
        if first is not None:
            assert bf16.logprobs is not None and fp8.logprobs is not None
            assert fp8.token_ids[first] in bf16.logprobs[first]
            assert bf16.token_ids[first] in fp8.logprobs[first]
