"""Make Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) work with numpy >= 2.4, and round
fp32 -> bf16 casts as the GPU does.

The interpreter keeps kernel scalars as one-element arrays and converts them with
``int(array)`` when a scalar is a loop bound (``for i in range(0, n, BLOCK)``); numpy 2.4 turned
that conversion into a TypeError (triton-lang/triton#9171, fixed upstream by the same
``squeeze``). This only changes the interpreter's per-launch patching, never compiled kernels,
and does nothing where numpy still converts one-element arrays.

The interpreter also casts fp32 to bf16 by dropping the low mantissa bits (round toward zero),
where compiled kernels round to nearest even; a CPU test of a bf16 kernel then disagrees with
torch (and with the GPU) by one bf16 step in about half the elements. ``apply`` makes that
cast round to nearest even, through torch (other casts, integers to bf16 among them, stay as
the interpreter does them).
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
    _round_bf16_casts_to_nearest()
    _squeeze_index_scalars()


def _round_bf16_casts_to_nearest() -> None:
    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl
    if getattr(original, _FIXED, False):
        return

    def cast_impl(self, src, dst_type):  # noqa: ANN001, ANN202
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.uint16).numpy(), dst_type.scalar)
        return original(self, src, dst_type)

    setattr(cast_impl, _FIXED, True)
    builder.cast_impl = cast_impl


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
