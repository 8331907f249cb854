"""Make Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) work with numpy >= 2.4.

The interpreter keeps kernel scalars as one-element arrays and converts them with
``int(array)`` when a scalar is a loop bound (``for i in range(0, n, BLOCK)``); numpy 2.4 turned
that conversion into a TypeError (triton-lang/triton#9171, fixed upstream by the same
``squeeze``). This only changes the interpreter's per-launch patching, never compiled kernels,
and does nothing where numpy still converts one-element arrays.
"""

from __future__ import annotations

import numpy as np
import triton.runtime.interpreter as interpreter


def _numpy_rejects_1d_scalars() -> bool:
    try:
        int(np.zeros(1, dtype=np.int32))
    except TypeError:
        return True
    return False


def apply() -> None:
    """Wrap the interpreter's tensor patching so ``__index__`` squeezes one-element arrays."""
    original = interpreter._patch_lang_tensor
    if getattr(original, "_pagedserve_fixed", False) or not _numpy_rejects_1d_scalars():
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._pagedserve_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor
