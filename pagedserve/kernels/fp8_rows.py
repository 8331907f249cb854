"""FP8 (e4m3) in Triton kernels: the saturating cast and the per-row quantization of an
activation for the FP8 linear layers that read it.

``quantize_row`` is ``layers/quantization/fp8_ops.quantize_rows`` for one row held by one
program: the scale maps the row's largest magnitude to 448 (at least ``MIN_SCALE``), the
values are divided by it, saturated and rounded to nearest even. Divisions are IEEE
(``tl.div_rn``): Triton's ``/`` on fp32 compiles to an approximate division on the GPU, and the
scales and bytes must be torch's.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX: tl.constexpr = tl.constexpr(448.0)
"""The largest finite float8_e4m3fn."""
MIN_SCALE: tl.constexpr = tl.constexpr(1.0 / (448.0 * 512.0))
"""The smallest row scale (an all-zero row): ``fp8_ops.MIN_SCALE``."""


@triton.jit
def saturate_to_fp8(x):
    """fp32 ``x`` clamped to +-448 and rounded to float8e4nv (an outlier clips, not NaN)."""
    return tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX).to(tl.float8e4nv)


@triton.jit
def row_scale(amax):
    """fp32 scale of a row whose largest magnitude is ``amax``."""
    return tl.maximum(tl.div_rn(amax, FP8_MAX), MIN_SCALE)
