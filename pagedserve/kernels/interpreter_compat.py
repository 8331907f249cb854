"""Make Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) work with numpy >= 2.4, and round
fp32 -> bf16 and fp32 -> fp8 (e4m3) casts as the GPU does.

The interpreter keeps kernel scalars as one-element arrays and converts them with
``int(array)`` when a scalar is a loop bound (``for i in range(0, n, BLOCK)``); numpy 2.4 turned
that conversion into a TypeError (triton-lang/triton#9171, fixed upstream by the same
``squeeze``). This only changes the interpreter's per-launch patching, never compiled kernels,
and does nothing where numpy still converts one-element arrays.

The interpreter also casts fp32 to bf16 by dropping the low mantissa bits (round toward zero),
where compiled kernels round to nearest even; a CPU test of a bf16 kernel then disagrees with
torch (and with the GPU) by one bf16 step in about half the elements. ``apply`` makes that
cast round to nearest even, through torch (other casts, integers to bf16 among them, stay as
the interpreter does them). Its fp32 -> float8e4nv cast flushes e4m3's subnormals (below
2**-6) toward zero where the GPU rounds them to nearest even; ``apply`` casts those through
torch too, so the FP8 KV-cache write is byte-equal to the torch reference on the CPU.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as interpreter

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
"""Kernels run under the CPU interpreter (read once, as triton does)."""
_FIXED = "_pagedserve_fixed"
"""Marks an interpreter function already replaced, so that ``apply`` is idempotent."""


def _numpy_rejects_1d_scalars() -> bool:
    try:
        int(np.zeros(1, dtype=np.int32))
    except TypeError:
        return True
    return False


def apply() -> None:
    _round_casts_to_nearest()
    _squeeze_index_scalars()


def _cast_through_torch(src, dtype: torch.dtype, bits: torch.dtype, dst_type):  # noqa: ANN001, ANN202
    """fp32 ``src`` cast by torch (to nearest even), kept as the interpreter keeps ``dst_type``
    (its bits, as ``bits``)."""
    rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(dtype)
    return interpreter.TensorHandle(rounded.view(bits).numpy(), dst_type.scalar)


def _round_casts_to_nearest() -> None:
    """fp32 -> bf16 (``cast_impl``) and fp32 -> float8e4nv (``create_fp_to_fp``) through torch."""
    builder = interpreter.InterpreterBuilder
    original_cast, original_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp
    if getattr(original_cast, _FIXED, False):
        return

    def cast_impl(self, src, dst_type):  # noqa: ANN001, ANN202
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return _cast_through_torch(src, torch.bfloat16, torch.uint16, dst_type)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # noqa: ANN001, ANN202
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return _cast_through_torch(src, torch.float8_e4m3fn, torch.uint8, dst_type)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    setattr(cast_impl, _FIXED, True)
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp


def _squeeze_index_scalars() -> None:
    """Wrap the interpreter's tensor patching so ``__index__`` squeezes one-element arrays."""
    original = interpreter._patch_lang_tensor
    if getattr(original, _FIXED, False) or not _numpy_rejects_1d_scalars():
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    setattr(patch_lang_tensor, _FIXED, True)
    interpreter._patch_lang_tensor = patch_lang_tensor
