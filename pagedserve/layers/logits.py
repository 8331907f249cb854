"""Logits for the rows the caller selected (the runner passes ``hidden[logits_indices]``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedserve.layers.vocab_embedding import VocabParallelEmbedding

AllGather = Callable[[torch.Tensor], torch.Tensor]
"""Concatenates the ranks' tensors along the last dim."""


class LogitsProcessor(nn.Module):
    def __init__(
        self, vocab_size: int, tp_size: int = 1, all_gather: AllGather | None = None
    ) -> None:
        super().__init__()
        if tp_size > 1 and all_gather is None:
            raise ValueError(f"LogitsProcessor: tp_size {tp_size} needs an all_gather")
        self.vocab_size = vocab_size
        self.tp_size = tp_size
        self.all_gather = all_gather

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits [N, vocab_size] in the model dtype."""
        logits = lm_head.dense_linear(hidden_states, lm_head.weight)  # [N, vocab rows of rank]
        if self.tp_size > 1:
            assert self.all_gather is not None  # __init__ requires one when tp_size > 1
            logits = self.all_gather(logits)  # [N, padded vocab]
        return logits[:, : self.vocab_size]
