"""Token embedding and LM head, split over the vocabulary for tensor parallelism.

The vocabulary is padded to a multiple of ``64 * tp_size`` so each rank holds a slice of
``padded / tp_size`` rows (a multiple of 64). Rank r owns token ids
``[r * rows, (r + 1) * rows)``; padding rows are zero and their logits are cut off by
``LogitsProcessor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.linear import AllReduce, new_parameter
from pagedserve.math_utils import round_up
from pagedserve.platform import platform_for

VOCAB_PADDING = 64


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    return round_up(vocab_size, multiple)


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
    ) -> None:
        super().__init__()
        if tp_size > 1 and all_reduce is None:
            raise ValueError(f"{type(self).__name__}: tp_size {tp_size} needs an all_reduce")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = tp_size
        self.all_reduce = all_reduce
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, VOCAB_PADDING * tp_size)
        self.rows_per_rank = self.num_embeddings_padded // tp_size
        self.vocab_start = tp_rank * self.rows_per_rank
        self.vocab_end = self.vocab_start + self.rows_per_rank
        shape = (self.rows_per_rank, embedding_dim)
        self.weight = new_parameter(shape, dtype, device, self.weight_loader)
        # The LM head's matmul, when this table is one (LogitsProcessor): F.linear's signature.
        self.dense_linear = platform_for(device).dense_linear()

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: None = None
    ) -> None:
        expected = (self.num_embeddings, self.embedding_dim)
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} holds one tensor, got shard_id {shard_id!r}")
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"expected a tensor of shape {expected}, got {tuple(loaded_weight.shape)}"
            )
        num_real = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        param.data[:num_real].copy_(loaded_weight[self.vocab_start : self.vocab_start + num_real])
        param.data[num_real:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int [T] -> [T, embedding_dim]."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # bool [T]
        local_ids = (input_ids - self.vocab_start) * owned
        embedded = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1)
        assert self.all_reduce is not None  # __init__ requires one when tp_size > 1
        return self.all_reduce(embedded)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection of an untied model: same layout as the embedding.

    ``LogitsProcessor`` multiplies hidden states with its ``weight``; a tied model passes its
    ``embed_tokens`` there instead.
    """
