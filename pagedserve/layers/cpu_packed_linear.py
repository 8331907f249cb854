"""The CPU's linear for many rows: oneDNN's matmul on a weight reordered once into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``), as vLLM-CPU's linears.

Why: ``F.linear`` hands oneDNN (bf16) or MKL (fp32) the plain [n, k] weight, which they
repack into their blocked layout on every call; at a decode step's 16 rows that repack is a
large share of the product (the LM head's above all), and in fp32 the packed product is also
faster at a prompt's thousands of rows (docs/cpu.md#packed-linears has the figures). The cost
is memory: the packed copy sits beside the plain weight (the C decode step and the torch
reference read the plain one), so each packed weight is held twice.

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
    """``F.linear`` through oneDNN on packed weights, for 2-D fp32 inputs (and bf16 ones where
    the CPU multiplies bf16 natively; elsewhere oneDNN's bf16 is emulated); anything else, and
    anything autograd should see, goes to ``F.linear``."""

    def __init__(self, native_bf16: bool | None = None, budget: PackBudget | None = None) -> None:
        bf16 = cpu_has_fast_bf16() if native_bf16 is None else native_bf16
        self.dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
        self.copies = WeightCopies(_reorder, "linear", budget)
        """Each weight's copy in oneDNN's blocked layout."""

    def takes(self, rows: torch.Tensor, weight: torch.Tensor) -> bool:
        """2-D rows in a packed dtype, the weight in the same one, no gradient wanted."""
        return (rows.dim() == 2
                and rows.shape[0] > 0
                and rows.dtype in self.dtypes
                and weight.dtype == rows.dtype
                and weight.dim() == 2
                and not (torch.is_grad_enabled() and weight.requires_grad))

    def __call__(
        self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """rows [m, k], weight [n, k], bias [n] or None -> [m, n]."""
        packed = self.copies.get(weight) if self.takes(rows, weight) else None
        if packed is None:
            return F.linear(rows, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] in oneDNN's blocked layout for a linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)
