"""A checkpoint's ``quantization_config``, read into an ``Fp8Scheme``, and the linear method
each layer of the model is built with.

Supported: FP8 weights with a scale per tensor or per output channel, stored by
compressed-tensors (``quant_method: compressed-tensors``, float8 weights), by vLLM / AutoFP8
(``quant_method: fp8``) and by NVIDIA ModelOpt (``quant_method: modelopt``,
``quant_algo: FP8``; in ``config.json`` or in the ``hf_quant_config.json`` beside it).
Everything else is refused by name: its weights are not FP8 floats, so loading them as such
would fail on a tensor of another shape or, worse, compute with raw integers.

FP8 KV-cache scales (``k_scale`` / ``v_scale``) that such checkpoints carry are skipped: the
KV cache is in the model's dtype.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagedserve.layers.linear import UNQUANTIZED, LinearMethod
from pagedserve.layers.quantization.fp8 import (
    ActivationScheme,
    Fp8LinearMethod,
    Fp8OnlineLinearMethod,
    Fp8Scheme,
)
from pagedserve.platform import platform_for

MODELOPT_CONFIG = "hf_quant_config.json"
SUPPORTED = "compressed-tensors (float8 weights), fp8, modelopt (quant_algo FP8)"

QuantConfig = dict[str, Any]


def quantization_config_of(hf_config: Any, folder: Path | None) -> QuantConfig | None:
    """``config.json``'s ``quantization_config`` as a dict, else ModelOpt's
    ``hf_quant_config.json`` in ``folder`` (its ``quantization`` section), else None."""
    config = getattr(hf_config, "quantization_config", None)
    if config:
        return dict(config) if isinstance(config, dict) else dict(config.to_dict())
    modelopt = folder / MODELOPT_CONFIG if folder is not None else None
    if modelopt is not None and modelopt.is_file():
        section = json.loads(modelopt.read_text()).get("quantization") or {}
        return {"quant_method": "modelopt", **section}
    return None


def checkpoint_scheme(hf_config: Any, folder: Path | None = None) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme; None for an unquantized one. ValueError naming the
    ``quantization_config`` field for anything else."""
    config = quantization_config_of(hf_config, folder)
    if not config:
        return None
    method = str(config.get("quant_method"))
    parse = _PARSERS.get(method)
    if parse is None:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported (supported: "
            f"{SUPPORTED}); use one of those, a bfloat16/float16/float32 checkpoint or a GGUF "
            f"file"
        )
    return parse(config)


def linear_method_for(
    quantization: str | None, scheme: Fp8Scheme | None, dummy: bool, device: torch.device
) -> LinearMethod:
    """The linear method of the model's layers: ``scheme`` (the checkpoint's) loads as
    stored; ``quantization="fp8"`` of an unquantized checkpoint, and FP8 dummy weights
    (``dummy``: random weights in the compute dtype), quantize at load."""
    if scheme is None and quantization is None:
        return UNQUANTIZED
    backend = platform_for(device).fp8_linear_backend()  # refuses GPUs without FP8
    if scheme is None or dummy:
        return Fp8OnlineLinearMethod(backend)
    return Fp8LinearMethod(scheme, backend)


def _refuse(field: str, value: object, why: str) -> ValueError:
    return ValueError(f"quantization_config.{field} {value!r}: {why}")


def _check_only_lm_head_skipped(config: QuantConfig, field: str) -> None:
    """The model quantizes every decoder linear; only the LM head (never quantized here) may
    be listed as left out."""
    others = [name for name in config.get(field) or [] if "lm_head" not in str(name)]
    if others:
        raise _refuse(field, others, "layers left unquantized (other than lm_head) are not "
                      "supported")


def _parse_fp8(config: QuantConfig) -> Fp8Scheme:
    """vLLM / AutoFP8: one scale per tensor; block-wise scales (``weight_block_size``,
    ``weight_scale_inv`` tensors) are refused."""
    block = config.get("weight_block_size")
    if block:
        raise _refuse("weight_block_size", block, "block-wise FP8 is not supported (FP8 with "
                      "a scale per tensor or per output channel is)")
    _check_only_lm_head_skipped(config, "ignored_layers")
    return Fp8Scheme("fp8", "tensor", _activation_scheme(config, "activation_scheme"))


def _activation_scheme(config: QuantConfig, field: str) -> ActivationScheme:
    value = config.get(field, "dynamic")
    if value not in ("dynamic", "static"):
        raise _refuse(field, value, "expected dynamic or static")
    return "static" if value == "static" else "dynamic"


def _parse_modelopt(config: QuantConfig) -> Fp8Scheme:
    """ModelOpt FP8: a scale per tensor for weights and (static) activations."""
    algo = config.get("quant_algo")
    if algo != "FP8":
        raise _refuse("quant_algo", algo, "only FP8 ModelOpt checkpoints are supported")
    _check_only_lm_head_skipped(config, "exclude_modules")
    return Fp8Scheme("modelopt", "tensor", "static")


def _parse_compressed_tensors(config: QuantConfig) -> Fp8Scheme:
    """compressed-tensors: every config group the same float8 scheme over ``Linear``."""
    fmt = config.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise _refuse("format", fmt, "only float-quantized (FP8) compressed-tensors "
                      "checkpoints are supported")
    groups = config.get("config_groups") or {}
    if not groups:
        raise _refuse("config_groups", groups, "no quantization scheme")
    schemes = {_compressed_tensors_group(name, group) for name, group in groups.items()}
    if len(schemes) > 1:
        raise _refuse("config_groups", sorted(groups), "groups of different schemes are not "
                      "supported")
    _check_only_lm_head_skipped(config, "ignore")
    return schemes.pop()


def _compressed_tensors_group(name: str, group: QuantConfig) -> Fp8Scheme:
    where = f"config_groups.{name}"
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise _refuse(f"{where}.targets", targets, "only ['Linear'] is supported")
    weights = group.get("weights") or {}
    _check_float8(weights, f"{where}.weights")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel"):
        raise _refuse(f"{where}.weights.strategy", strategy, "only tensor and channel scales "
                      "are supported (block-wise and group-wise FP8 are not)")
    activations = group.get("input_activations")
    if activations is None:  # weight-only FP8: activations quantized per token where needed
        return Fp8Scheme("compressed-tensors", strategy, "dynamic")
    _check_float8(activations, f"{where}.input_activations")
    if activations.get("dynamic"):
        return Fp8Scheme("compressed-tensors", strategy, "dynamic")
    if activations.get("strategy") != "tensor":
        raise _refuse(f"{where}.input_activations.strategy", activations.get("strategy"),
                      "static activation scales must be per tensor")
    return Fp8Scheme("compressed-tensors", strategy, "static")


def _check_float8(args: QuantConfig, where: str) -> None:
    kind = f"{args.get('type')}{args.get('num_bits')}"
    if kind != "float8":
        raise _refuse(where, kind, "only float8 (FP8) is supported (int8 / int4 / fp4 "
                      "compressed-tensors schemes are not)")
    if args.get("symmetric") is False:
        raise _refuse(f"{where}.symmetric", False, "only symmetric FP8 is supported")


_PARSERS: dict[str, Callable[[QuantConfig], Fp8Scheme]] = {
    "compressed-tensors": _parse_compressed_tensors,
    "fp8": _parse_fp8,
    "modelopt": _parse_modelopt,
}
