"""RMSNorm, with the residual add fused in front of it.

A decoder layer keeps the residual stream outside the norm: ``norm(x, residual)`` adds the
sublayer output ``x`` to ``residual`` in fp32, returns the normalized sum and the sum itself
(cast back to the model dtype) as the new residual. Layer 0 has no residual yet and calls
``norm(x)``.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.layers.linear import copy_shard, new_parameter


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = new_parameter((hidden_size,), dtype, device, self.weight_loader)
        with torch.no_grad():
            self.weight.fill_(1.0)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"RMSNorm holds one tensor, got shard_id {shard_id!r}")
        copy_shard(param.data, loaded_weight, 0, 1, 0)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` [..., hidden] -> normed, or (normed, x + residual) when a residual is given."""
        if residual is None:
            return self._normalize(x.float(), x.dtype)
        summed = x.float() + residual.float()  # fp32 [..., hidden]
        return self._normalize(summed, x.dtype), summed.to(x.dtype)

    def _normalize(self, x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)
