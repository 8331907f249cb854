"""Vocabulary embedding and LM head: padding to 64 per rank, TP split, logits cut to the vocab."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.layers.logits import LogitsProcessor
from pagedserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

CPU = torch.device("cpu")
F32 = torch.float32


def _embedding(weight: torch.Tensor, rank: int = 0, tp_size: int = 1) -> VocabParallelEmbedding:
    layer = VocabParallelEmbedding(
        weight.shape[0], weight.shape[1], F32, CPU, rank, tp_size, all_reduce=lambda t: t
    )
    layer.weight.weight_loader(layer.weight, weight)
    return layer


def test_padding_rows_are_zero_and_lookup_matches() -> None:
    weight = torch.randn(200, 8)
    layer = _embedding(weight)
    assert layer.weight.shape == (256, 8)
    assert not layer.weight[200:].any()
    ids = torch.tensor([0, 199, 5, 5])
    torch.testing.assert_close(layer(ids), F.embedding(ids, weight))


def test_tp_ranks_sum_to_full_lookup() -> None:
    weight = torch.randn(200, 8)
    ranks = [_embedding(weight, r, 2) for r in range(2)]
    assert [r.weight.shape[0] for r in ranks] == [128, 128]  # 200 -> 256 = 2 x 128
    ids = torch.tensor([0, 127, 128, 199])
    total = sum(r(ids) for r in ranks)  # all_reduce is the identity here; sum by hand
    torch.testing.assert_close(total, F.embedding(ids, weight))


def test_logits_for_given_rows_cut_to_vocab() -> None:
    weight, hidden = torch.randn(200, 8), torch.randn(3, 8)
    head = ParallelLMHead(200, 8, F32, CPU)
    head.weight.weight_loader(head.weight, weight)
    logits = LogitsProcessor(200)(head, hidden)
    assert logits.shape == (3, 200)
    torch.testing.assert_close(logits, hidden @ weight.T)


def test_tp_logits_gathered_and_cut() -> None:
    weight, hidden = torch.randn(200, 8), torch.randn(3, 8)
    ranks = [_embedding(weight, r, 2) for r in range(2)]

    def all_gather(local: torch.Tensor) -> torch.Tensor:  # stands in for the collective
        return torch.cat([F.linear(hidden, r.weight) for r in ranks], dim=-1)

    logits = LogitsProcessor(200, tp_size=2, all_gather=all_gather)(ranks[0], hidden)
    torch.testing.assert_close(logits, hidden @ weight.T)


def test_errors() -> None:
    layer = VocabParallelEmbedding(200, 8, F32, CPU)
    with pytest.raises(ValueError, match=r"expected a tensor of shape \(200, 8\), got \(256, 8\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(256, 8))
    with pytest.raises(ValueError, match="all_reduce"):
        VocabParallelEmbedding(200, 8, F32, CPU, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="all_gather"):
        LogitsProcessor(200, tp_size=2)
