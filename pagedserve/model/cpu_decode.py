"""The CPU's decode step in C: every decoder layer of a Llama-family model and the final norm in
one call to ``cpu_decode.c``, for batches whose requests each decode one token.

Why: at a small batch a decode step multiplies each weight by a few rows, and the torch layers
spend some 70 small ops per layer around those products (norms, rotary, cache writes, casts),
each with its dispatch overhead, which on a shared CPU also waits for threads that are not
running. In C the step is the weight read plus a few passes over vectors.

The torch layers stay the reference and serve every other step (prompts, mixed batches) and
every model the C code was not written for: a model declares the layer classes it supports
(``cpu_decode_layers`` in ``model/llama.py``), and a layer of another class, quantized linear
weights, tensor parallelism or an FP8 KV cache leave it on the torch forward (the reason is
logged once). Built as the other CPU kernels (``attention/backends/cpu_native``); no compiler:
the torch forward.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from pagedserve.attention.backends.cpu_native import built_library
from pagedserve.attention.forward_context import ForwardContext, get_forward_context
from pagedserve.layers.linear import UnquantizedLinearMethod
from pagedserve.layers.panel_pack import PANEL_MIN_ROWS, panel_copies, panel_packable
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.model.llama import (
    LayerTypes,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    foreign_linear,
)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
DTYPES = (torch.float32, torch.bfloat16)
_STATUS = {1: "no memory for the step's scratch", 2: "no memory for the attention's scratch",
           3: "a position past the rotary table"}

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class LayerTable(ctypes.Structure):
    """``DecodeLayer`` of cpu_decode.c: one layer's tensors (NULL: no bias / no q/k norm)."""

    _fields_ = [(name, _p) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o_proj", "o_bias",
        "gate_up", "gate_up_bias", "down", "down_bias", "key_cache", "value_cache",
        "qkv_panels", "o_panels", "gate_up_panels", "down_panels")]


class ModelTable(ctypes.Structure):
    """``DecodeModel`` of cpu_decode.c."""

    _fields_ = [*[(name, _i64) for name in (
        "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
        "block_size", "cache_block_stride", "max_position")],
        ("norm_eps", ctypes.c_float), ("qk_norm_eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("is_bf16", ctypes.c_int), ("panel_min_rows", _i64), ("cos_sin", _p), ("final_norm", _p),
        ("layers", ctypes.POINTER(LayerTable))]


def decode_step_of(source: Path) -> Callable[..., int]:
    """``decode_step`` of ``source`` (cpu_decode.c or a copy of it) built, its argument types
    set. OSError, RuntimeError or SubprocessError where it cannot be built here."""
    fn = ctypes.CDLL(str(built_library(source))).decode_step
    fn.argtypes = [ctypes.POINTER(ModelTable), _p, _i64, _p, _p, _p, _i64, _p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast(Callable[..., int], fn)


@functools.cache
def load_decode_step() -> Callable[..., int] | None:
    """``decode_step`` of the built library; None (logged once) where it cannot be built."""
    try:
        return decode_step_of(SOURCE)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU decode step not built (%s): decode steps run the torch layers", e)
        return None


def unsupported_reason(model: LlamaForCausalLM, types: LayerTypes) -> str | None:
    """Why the C step cannot run ``model`` (None: it can)."""
    if model.tp.size != 1:
        return "tensor parallelism"
    foreign = foreign_linear(model, (UnquantizedLinearMethod,))
    if foreign is not None:
        return foreign
    for i, layer in enumerate(model.model.layers):
        part = types.foreign_part(layer)
        if part is not None:
            return f"layer {i}: {part}, the type the C step was written for"
    if type(model.model.rotary_emb) is not RotaryEmbedding:
        return f"rotary embedding {type(model.model.rotary_emb).__name__}"
    dtypes = {p.dtype for p in model.model.parameters()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        return f"parameter dtypes {sorted(map(str, dtypes))} (one of bf16, fp32 for all)"
    return None


def cpu_decode_forward(model: LlamaForCausalLM, types: LayerTypes) -> CpuDecodeForward | None:
    """The model's forward with decode steps in C; None (the reason logged) where the C step
    does not fit the model or cannot be built here."""
    reason = unsupported_reason(model, types)
    if reason is None and load_decode_step() is None:
        reason = "no C compiler built it"
    if reason is not None:
        logger.info("CPU decode steps run the torch layers: %s", reason)
        return None
    return CpuDecodeForward(model)


class CpuDecodeForward:
    """``(input_ids [T], positions [T]) -> hidden_states [T, hidden]``, as the model's forward:
    in C where every request of the step decodes one token, else the model's torch forward.

    The tables of the C step (weight and cache addresses) are built on the first decode step
    and again whenever the layers' KV caches are other tensors."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.layers = cast(list[LlamaDecoderLayer], list(model.model.layers))
        fn = load_decode_step()
        if fn is None:
            raise RuntimeError("CpuDecodeForward: the C step is not built here")
        self.fn = fn
        self.c_steps = 0
        """Steps run in C (tests read it)."""
        self.cache_refused = False
        self._caches: list[torch.Tensor] = []
        self._tables: tuple[ModelTable, ctypes.Array[LayerTable]] | None = None
        self._panels: list[list[torch.Tensor | None]] | None = None
        """Per layer: qkv, o, gate_up, down packed for panel_gemm (None: not yet; a weight's
        None: no copy, it reads the plain weight). Decode batches of ``PANEL_MIN_ROWS``
        requests or more multiply on them; smaller ones read the plain weights."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        step = self._decode_tables(ctx, input_ids.shape[0], positions)
        c_model = None if step is None else self._c_model(input_ids.shape[0])
        if step is None or c_model is None:
            return self.model(input_ids, positions)
        block_table, seq_lens, slots = step
        hidden = self.model.model.embed_tokens(input_ids).contiguous()  # [T, hidden]
        status = self.fn(
            ctypes.byref(c_model), hidden.data_ptr(), input_ids.shape[0],
            positions.data_ptr(), slots.data_ptr(), block_table.data_ptr(),
            block_table.stride(0), seq_lens.data_ptr(), torch.get_num_threads())  # fmt: skip
        if status != 0:
            raise RuntimeError(f"decode_step: {_STATUS.get(status, status)}")
        self.c_steps += 1
        return hidden

    def _decode_tables(
        self, ctx: ForwardContext, num_tokens: int, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(block_table, seq_lens, slot_mapping) of a step the C code serves: one KV-cache
        group, every request one token, no padding rows, the layouts it indexes; else None."""
        metadata = ctx.attn_metadata.get(self.layers[0].self_attn.attn.layer_name)
        if metadata is None or len({id(m) for m in ctx.attn_metadata.values()}) != 1:
            return None
        if not (metadata.num_reqs == metadata.num_actual_tokens == num_tokens
                and metadata.max_query_len == 1):
            return None
        slots = next(iter(ctx.slot_mapping.values()))
        if len({id(s) for s in ctx.slot_mapping.values()}) != 1:
            return None
        block_table, seq_lens = metadata.block_table, metadata.seq_lens
        if (block_table.dtype != torch.int32 or block_table.stride(1) != 1
                or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous()
                or slots.dtype != torch.int64 or not slots.is_contiguous()
                or positions.dtype != torch.int64 or not positions.is_contiguous()):
            return None
        return block_table, seq_lens, slots

    def _c_model(self, rows: int = 1) -> ModelTable | None:
        """The C step's tables for the layers' current caches (with packed weights from the
        first step of ``PANEL_MIN_ROWS`` rows on); None where a cache is not one the C step
        reads (an FP8 cache: the torch layers serve every step, logged once)."""
        caches = [layer.self_attn.attn.kv_cache for layer in self.layers]
        repack = rows >= PANEL_MIN_ROWS and self._panels is None
        if not repack and self._tables is not None and all(
                a is b for a, b in zip(caches, self._caches, strict=True)):
            return self._tables[0]
        dtype = self.model.model.embed_tokens.weight.dtype
        if not all(c is not None and c.dtype == dtype and c[0, 0].is_contiguous()
                   for c in caches):
            if not self.cache_refused:
                logger.info("CPU decode steps run the torch layers: the KV cache is not in "
                            "the model's dtype %s with contiguous blocks", dtype)
            self.cache_refused = True
            return None
        if repack:
            self._panels = self._pack_panels()
        self._caches = cast(list[torch.Tensor], caches)
        self._tables = self._build_tables(self._caches)
        return self._tables[0]

    def _pack_panels(self) -> list[list[torch.Tensor | None]]:
        """Every layer's panel weights, each where it fits the packed-copy budget (the others
        read the plain weight): in an engine, the copies its start-up made
        (``CpuPlatform.prepare_weights``); made here where none were."""
        return [[panel_copies().get(w) if panel_packable(w) else None
                 for w in _panel_weights(layer)] for layer in self.layers]

    def _build_tables(self, caches: list[torch.Tensor]) -> tuple[ModelTable, ctypes.Array[LayerTable]]:
        inner, first = self.model.model, self.layers[0]
        dtype = inner.embed_tokens.weight.dtype
        panels = self._panels or [[] for _ in self.layers]
        layers = (LayerTable * len(self.layers))(*(
            _layer_table(layer, cache, packed)
            for layer, cache, packed in zip(self.layers, caches, panels, strict=True)))
        attn = first.self_attn.attn
        q_norm = getattr(first.self_attn, "q_norm", None)
        cos_sin = inner.rotary_emb.cos_sin_cache  # [max_position, head_dim]
        c_model = ModelTable(
            len(self.layers), inner.embed_tokens.weight.shape[1], attn.num_heads,
            attn.num_kv_heads, attn.head_dim, first.mlp.down_proj.weight.shape[1],
            caches[0].shape[2], caches[0].stride(1), cos_sin.shape[0],
            first.input_layernorm.eps, q_norm.eps if q_norm is not None else 0.0, attn.scale,
            int(dtype == torch.bfloat16), PANEL_MIN_ROWS, _ptr(cos_sin), _ptr(inner.norm.weight), layers)
        return c_model, layers


def _ptr(tensor: torch.Tensor | None) -> int | None:
    """The address of a contiguous tensor (None: NULL)."""
    if tensor is None:
        return None
    if not tensor.is_contiguous():
        raise ValueError("CpuDecodeForward: the C step reads contiguous tensors")
    return tensor.data_ptr()


def _panel_weights(layer: LlamaDecoderLayer) -> list[torch.Tensor]:
    """qkv, o, gate_up, down: the weights the panels copy."""
    return [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
            layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]


def _layer_table(layer: LlamaDecoderLayer, cache: torch.Tensor,
                 panels: list[torch.Tensor | None]) -> LayerTable:
    """One layer's addresses; ``panels``: its packed weights (None or none at all: NULL)."""
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return LayerTable(
        _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight),
        _ptr(attn.qkv_proj.weight), _ptr(attn.qkv_proj.bias),
        _ptr(q_norm.weight if q_norm is not None else None),
        _ptr(k_norm.weight if k_norm is not None else None),
        _ptr(attn.o_proj.weight), _ptr(attn.o_proj.bias),
        _ptr(mlp.gate_up_proj.weight), _ptr(mlp.gate_up_proj.bias),
        _ptr(mlp.down_proj.weight), _ptr(mlp.down_proj.bias),
        cache[0].data_ptr(), cache[1].data_ptr(), *(_ptr(p) for p in panels))
