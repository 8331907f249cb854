"""FP8 linear methods: float8_e4m3fn weights with fp32 scales, for ``layers/linear.py``.

``Fp8LinearMethod`` loads the weights of an FP8 checkpoint as they are stored (a
``weight_scale`` per tensor or per output channel; an ``input_scale`` per tensor when the
activations are quantized statically). ``Fp8OnlineLinearMethod`` quantizes a bf16 / fp16 /
fp32 checkpoint while it loads (``quantization="fp8"``).

Either way the forward reads one fp32 scale per output channel (``weight_scale`` [N]):
per-tensor scales of fused layers (q / k / v, gate / up: one scale each) are spread over
their rows once loaded, which is exact, so no shard is requantized to a common scale. Under
tensor parallelism a per-channel scale splits with its weight's rows; a row-parallel layer
keeps every row, so its scales stay whole.

How the matmul runs is the ``backend`` (``Platform.fp8_linear_backend``): FP8 tensor cores
(activations quantized per token, or with the static scale: the largest of a fused layer's
shards, as all of them see the same input) or, on the CPU, the weight dequantized into the
compute dtype (``layers/quantization/fp8_ops.py``). Per-token activations come quantized from
the layers in front where those are FP8-writing ones (``input_layers``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from pagedserve.layers.linear import LinearBase, ShardId, new_parameter
from pagedserve.layers.quantization.fp8_activations import (
    FP8_INPUT_LAYERS,
    PLAIN_INPUT_LAYERS,
    InputLayers,
)
from pagedserve.layers.quantization.fp8_ops import (
    FP8_DTYPE,
    Fp8Activation,
    dequantized_linear,
    quantize_rows,
    scaled_mm_linear,
)
from pagedserve.platform.base import Fp8Backend

ScaleGranularity = Literal["tensor", "channel"]
ActivationScheme = Literal["dynamic", "static"]


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint stores its FP8 linear layers."""

    method: str
    """The ``quant_method`` it came from (named in messages)."""
    weight_scale: ScaleGranularity
    activation: ActivationScheme
    """static: an ``input_scale`` per layer in the checkpoint; dynamic: a scale per token."""


ONLINE_SCHEME = Fp8Scheme("fp8", "channel", "dynamic")
"""Online quantization: a scale per output channel, computed at load; per-token activations.
Per channel because each checkpoint tensor (each fused shard, each rank's slice) quantizes
on its own as it streams in, and it is more accurate than one scale per tensor."""


@dataclass(frozen=True)
class Fp8LinearMethod:
    """The weights of an FP8 checkpoint (see the module docstring)."""

    scheme: Fp8Scheme
    backend: Fp8Backend

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        layer.weight = new_parameter(layer.weight_shape, FP8_DTYPE, device,
                                     functools.partial(_load_fp8_weight, layer))
        if self.scheme.weight_scale == "channel":
            scale = new_parameter((layer.output_size_per_rank,), torch.float32, device,
                                  functools.partial(_load_channel_scale, layer))
        else:
            scale = _shard_scales(layer, device)
        layer.register_parameter("weight_scale", scale)
        if self.scheme.activation == "static":
            layer.register_parameter("input_scale", _shard_scales(layer, device))

    def finish_loading(self, layer: LinearBase) -> None:
        """Scales into forward form, as buffers: weight_scale fp32 [N] (per-tensor ones spread
        over their shard's rows), input_scale fp32 [1] (the largest of the shards')."""
        scale = layer.get_parameter("weight_scale").data
        if self.scheme.weight_scale == "tensor":
            scale = _spread_over_rows(layer, scale)
        _to_buffer(layer, "weight_scale", scale)
        if self.scheme.activation == "static":
            _to_buffer(layer, "input_scale", layer.get_parameter("input_scale").data.amax(0, True))

    def apply(
        self, layer: LinearBase, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return fp8_apply(layer, x, bias, self.backend, self.scheme.activation)

    @property
    def input_layers(self) -> InputLayers:
        """The norm and activation layers in front of these layers (``input_layers_for``)."""
        return input_layers_for(self.backend, self.scheme.activation)


@dataclass(frozen=True)
class Fp8OnlineLinearMethod:
    """A bf16 / fp16 / fp32 checkpoint quantized to FP8 as it loads: each tensor is cut to
    this rank's slice and quantized row by row into the FP8 weight and its scale buffer."""

    backend: Fp8Backend
    scheme: Fp8Scheme = ONLINE_SCHEME

    def create_weights(self, layer: LinearBase, dtype: torch.dtype, device: torch.device) -> None:
        layer.weight = new_parameter(layer.weight_shape, FP8_DTYPE, device,
                                     functools.partial(_quantize_on_load, layer))
        scale = torch.ones(layer.output_size_per_rank, dtype=torch.float32, device=device)
        layer.register_buffer("weight_scale", scale)  # [N]: filled with the weight

    def finish_loading(self, layer: LinearBase) -> None:
        return None

    def apply(
        self, layer: LinearBase, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return fp8_apply(layer, x, bias, self.backend, self.scheme.activation)

    @property
    def input_layers(self) -> InputLayers:
        """The norm and activation layers in front of these layers (``input_layers_for``)."""
        return input_layers_for(self.backend, self.scheme.activation)


def input_layers_for(backend: Fp8Backend, activation: ActivationScheme) -> InputLayers:
    """FP8-writing norm and SiLU-and-mul where the activations are quantized per token on FP8
    tensor cores; the plain layers where a static scale quantizes them (the layer's own pass)
    or the weights are dequantized (the activations stay in the model dtype)."""
    if backend == "scaled_mm" and activation == "dynamic":
        return FP8_INPUT_LAYERS
    return PLAIN_INPUT_LAYERS


def fp8_apply(
    layer: LinearBase, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None,
    backend: Fp8Backend, activation: ActivationScheme,
) -> torch.Tensor:
    """The forward of an FP8 layer once loaded (its scales are buffers); ``x`` comes quantized
    per token from an FP8-writing layer, or in the model dtype."""
    weight_scale = layer.get_buffer("weight_scale")  # [N]
    if backend == "dequantize":
        return dequantized_linear(x, layer.weight, weight_scale, bias)
    input_scale = layer.get_buffer("input_scale") if activation == "static" else None  # [1]
    return scaled_mm_linear(x, layer.weight, weight_scale, input_scale, bias)


def _load_fp8_weight(
    layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId
) -> None:
    if loaded.dtype != FP8_DTYPE:
        raise ValueError(f"expected a float8_e4m3fn weight (the checkpoint's "
                         f"quantization_config says FP8), got {loaded.dtype}")
    layer.weight_loader(param, loaded, shard_id)


def _load_channel_scale(
    layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId
) -> None:
    """A scale per output channel ([N] or [N, 1]) splits with the weight's rows."""
    layer.weight_loader(param, loaded.reshape(-1).float(), shard_id)


def _shard_scales(layer: LinearBase, device: torch.device) -> nn.Parameter:
    """One fp32 scale per checkpoint tensor of ``layer`` (q / k / v, gate / up, or one)."""
    return new_parameter((len(layer.shard_ids),), torch.float32, device,
                         functools.partial(_load_shard_scale, layer))


def _load_shard_scale(
    layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId
) -> None:
    layer.shard_rows(shard_id)  # ValueError for a shard_id the layer does not have
    if loaded.numel() != 1:
        raise ValueError(f"expected one scale per tensor, got shape {tuple(loaded.shape)} "
                         "(the quantization_config says per-tensor)")
    param.data[layer.shard_ids.index(shard_id)] = loaded.reshape(()).float()


def _spread_over_rows(layer: LinearBase, shard_scales: torch.Tensor) -> torch.Tensor:
    """[len(shard_ids)] -> [output_size_per_rank]: each shard's scale on each of its rows."""
    out = torch.empty(layer.output_size_per_rank, dtype=torch.float32,
                      device=shard_scales.device)  # [N]
    for i, shard_id in enumerate(layer.shard_ids):
        rows = layer.shard_rows(shard_id)
        out[rows.offset : rows.offset + rows.size] = shard_scales[i]
    return out


def _to_buffer(layer: LinearBase, name: str, value: torch.Tensor) -> None:
    """Replace the loaded parameter ``name`` by a buffer (the forward reads buffers only)."""
    delattr(layer, name)
    layer.register_buffer(name, value.contiguous())


def _quantize_on_load(
    layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId
) -> None:
    if loaded.dtype == FP8_DTYPE:
        raise ValueError("a float8 weight in a checkpoint without an FP8 quantization_config "
                         "(its scales are unknown)")
    offset, piece = layer.shard_of(loaded, shard_id, tuple(param.shape))
    q, scale = quantize_rows(piece.to(param.device))  # [rows, K], [rows]
    param.data.narrow(0, offset, piece.shape[0]).copy_(q)
    layer.get_buffer("weight_scale").narrow(0, offset, piece.shape[0]).copy_(scale)
