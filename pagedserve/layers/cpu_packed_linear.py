"""The CPU's linear for many rows: oneDNN's matmul on a weight reordered once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``), as vLLM-CPU's linears.

Why: ``F.linear`` hands oneDNN (bf16) or MKL (fp32) the plain [n, k] weight, which they
repack into their blocked layout on every call; at a decode step's 16 rows that repack is a
large share of the product (the LM head's above all), and in fp32 the packed product is also
faster at a prompt's thousands of rows (docs/cpu.md#packed-linears has the figures). The cost
is memory: the packed copy sits beside the plain weight (the C decode step and the torch
reference read the plain one), so each packed weight is held twice.

Where the CPU has no native bf16 matmul (no AVX512-BF16 or AMX), oneDNN's bf16 product is
emulated, several times slower than its fp32 one; there bf16 rows are widened to fp32 (exact)
and multiplied on an fp32 packed copy of the bf16 weight, and the fp32 sums are rounded to bf16
once, as a native bf16 product rounds them. That copy takes twice the bf16 weight's bytes.

Packed copies are made on a weight's first call and kept per weight tensor
(``weight_copies.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.layers.cpu_pack_budget import PackBudget
from pagedserve.layers.weight_copies import WeightCopies
from pagedserve.platform.cpu import cpu_has_fast_bf16


def packing_available() -> bool:
    """This torch build has oneDNN and the reorder / pointwise-linear ops."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear:
    """``F.linear`` through oneDNN on packed weights, for 2-D fp32 and bf16 inputs (bf16 ones
    widened to fp32 where the CPU has no native bf16 matmul); anything else, and anything
    autograd should see, goes to ``F.linear``."""

    def __init__(self, native_bf16: bool | None = None, budget: PackBudget | None = None) -> None:
        bf16 = cpu_has_fast_bf16() if native_bf16 is None else native_bf16
        self.widens_bf16 = not bf16
        """bf16 products run in fp32 on a widened copy (the CPU has no native bf16 matmul)."""
        self.copies = WeightCopies(_reorder, "linear", budget)
        """Each weight's copy in oneDNN's blocked layout, in its own dtype."""
        self.widened = WeightCopies(_reorder_widened, "linear widened to fp32", budget,
                                    copy_dtype=torch.float32)
        """Each bf16 weight's copy widened to fp32, in oneDNN's layout (``widens_bf16``)."""

    def takes(self, rows: torch.Tensor, weight: torch.Tensor) -> bool:
        """2-D fp32 or bf16 rows, the weight in the same dtype, no gradient wanted."""
        return (rows.dim() == 2
                and rows.shape[0] > 0
                and rows.dtype in (torch.float32, torch.bfloat16)
                and weight.dtype == rows.dtype
                and weight.dim() == 2
                and not (torch.is_grad_enabled() and weight.requires_grad))

    def __call__(
        self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """rows [m, k], weight [n, k], bias [n] or None -> [m, n]."""
        if not self.takes(rows, weight):
            return F.linear(rows, weight, bias)
        widen = self.widens_bf16 and rows.dtype == torch.bfloat16
        packed = (self.widened if widen else self.copies).get(weight)
        if packed is None:
            return F.linear(rows, weight, bias)
        if not widen:
            return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        wide_bias = None if bias is None else bias.float()  # [n]
        out = torch.ops.mkldnn._linear_pointwise(rows.float(), packed, wide_bias, "none", [], "")
        return out.to(torch.bfloat16)  # [m, n]


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] in oneDNN's blocked layout for a linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _reorder_widened(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weight [n, k] widened to fp32, in oneDNN's blocked layout for a linear."""
    return _reorder(weight.float())
