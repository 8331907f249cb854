"""Truncation of the distribution: min-p, top-k and top-p, by writing -inf into the logits.

All ops take temperature-scaled fp32 logits [num_rows, V] and per-row parameters already gathered
through idx_mapping. Each row is handled on its own, so the result never depends on the batch.
Every op keeps at least the most likely token, so a greedy row's argmax survives them.

top-p uses a full sort over the vocabulary (vLLM's torch fallback). On CUDA the Triton path
(``pagedserve/kernels/sampling_truncation.py``) finds the same kept sets with a per-row pivot
search instead; these functions are its reference.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below min_p (fp32 [num_rows]) times the row's top one.

    In logit space: logit < max_logit + log(min_p). min_p = 0 gives a -inf threshold: no change.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [num_rows, 1]
    logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Keep each row's top_k (int64 [num_rows], 0 = off) largest logits; ties with the k-th stay.

    max_top_k: a host-side bound >= every top_k of the batch (from the host mirror), so only
    max_top_k values per row are selected instead of sorting the vocabulary.
    """
    top_values = logits.topk(max_top_k, dim=-1).values  # [num_rows, max_top_k], descending
    kth = top_values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))  # [num_rows, 1]
    kth = torch.where(top_k.unsqueeze(1) > 0, kth, _NEG_INF)
    logits.masked_fill_(logits < kth, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k (int64 [num_rows], 0 = off) then top-p (fp32 [num_rows]) by sorting each row.

    Top-p keeps the smallest set of most likely tokens whose probability (after top-k,
    renormalised) reaches top_p; the most likely token is always kept. Returns a new tensor.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, stable=True)  # ascending, [num_rows, V]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size)
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [num_rows, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [num_rows, V], ascending mass
    drop = cum_probs <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1].fill_(False)  # the most likely token always stays
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
