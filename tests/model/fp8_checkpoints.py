"""FP8 checkpoints written the way compressed-tensors, vLLM's ``fp8`` and ModelOpt store them,
from the weights of an unquantized Hugging Face model (tests only).

Each format quantizes the decoder's linear weights to float8_e4m3fn with its own scales and
names them as its producer does; ``write_fp8_checkpoint`` also returns the dequantized
weights, which a transformers model loads to be the reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_SCALE = 0.02  # a static activation scale (times the shard index + 1: they differ)


@dataclass(frozen=True)
class Fp8Format:
    name: str
    quantization_config: dict[str, Any]
    per_channel: bool
    static: bool
    scale_shape: tuple[int, ...]
    """Shape of a per-tensor scale as the format stores it."""
    modelopt_file: bool = False
    """True: the config goes to ``hf_quant_config.json``, not ``config.json``."""


def _compressed_tensors(strategy: str, activations: dict[str, Any] | None) -> dict[str, Any]:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
               "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}},
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "quantization_status": "compressed"}


TOKEN_DYNAMIC = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                 "symmetric": True}
TENSOR_STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                 "symmetric": True}
MODELOPT = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
            "exclude_modules": ["lm_head"]}

FORMATS = {
    f.name: f
    for f in (
        Fp8Format("compressed-tensors-channel", _compressed_tensors("channel", TOKEN_DYNAMIC),
                  per_channel=True, static=False, scale_shape=()),
        Fp8Format("compressed-tensors-tensor", _compressed_tensors("tensor", TENSOR_STATIC),
                  per_channel=False, static=True, scale_shape=(1,)),
        Fp8Format("fp8-static", {"quant_method": "fp8", "activation_scheme": "static"},
                  per_channel=False, static=True, scale_shape=()),
        Fp8Format("fp8-dynamic", {"quant_method": "fp8", "activation_scheme": "dynamic"},
                  per_channel=False, static=False, scale_shape=()),
        Fp8Format("modelopt", MODELOPT, per_channel=False, static=True, scale_shape=()),
        Fp8Format("modelopt-file", MODELOPT, per_channel=False, static=True, scale_shape=(),
                  modelopt_file=True),
    )
}


def quantize(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, fp32 scale [N, 1] or [1, 1]) with weight ~ q * scale."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
    scale = amax / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_tensors(
    state: dict[str, torch.Tensor], fmt: Fp8Format
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(checkpoint tensors of ``fmt``, the dequantized state dict)."""
    stored: dict[str, torch.Tensor] = {}
    dequantized = dict(state)
    for name, value in state.items():
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if module not in LINEARS:
            stored[name] = value
            continue
        prefix = name[: -len(".weight")]
        q, scale = quantize(value, fmt.per_channel)
        stored[name] = q
        stored[f"{prefix}.weight_scale"] = scale if fmt.per_channel else scale.reshape(
            fmt.scale_shape)
        if fmt.static:
            factor = LINEARS.index(module) + 1
            stored[f"{prefix}.input_scale"] = torch.tensor(INPUT_SCALE * factor).reshape(
                fmt.scale_shape)
        if module in ("k_proj", "v_proj") and fmt.name.startswith("modelopt"):
            stored[f"{prefix}.{module[0]}_scale"] = torch.tensor(1.0)  # FP8 KV-cache scale
        dequantized[name] = q.float() * scale
    return stored, dequantized


def write_fp8_checkpoint(
    hf_model: torch.nn.Module, folder: Path, fmt: Fp8Format, num_files: int = 2
) -> dict[str, torch.Tensor]:
    """``hf_model``'s weights as an FP8 checkpoint of ``fmt`` in ``num_files`` safetensors
    files (with an index when more than one). Returns the dequantized state dict."""
    state = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
    if getattr(hf_model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    stored, dequantized = fp8_tensors(state, fmt)
    folder.mkdir(parents=True, exist_ok=True)
    config = hf_model.config.to_dict()
    if fmt.modelopt_file:
        quant_file = {"producer": {"name": "modelopt"}, "quantization": fmt.quantization_config}
        (folder / "hf_quant_config.json").write_text(json.dumps(quant_file))
    else:
        config["quantization_config"] = fmt.quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    _save_sharded(stored, folder, num_files)
    return dequantized


def _save_sharded(tensors: dict[str, torch.Tensor], folder: Path, num_files: int) -> None:
    names = sorted(tensors)
    if num_files == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return
    weight_map = {}
    for i in range(num_files):
        file = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        part = names[i::num_files]
        save_file({n: tensors[n] for n in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
