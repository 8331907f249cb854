"""Logprobs of sampled tokens and of prompt tokens, with each row's top-k.

These are *raw* logprobs (vLLM's default ``logprobs_mode="raw_logprobs"``): log_softmax of the
logits exactly as the model produced them, upcast to fp32, before logit_bias, min_tokens,
allowed_token_ids, bad_words, penalties, temperature or any truncation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsTensors:
    """Logprobs of one token per row plus the row's top-k, all on the logits' device.

    Column 0 of ``token_ids``/``logprobs`` is the sampled (or, for prompt logprobs, the target)
    token; columns 1..k are the k most likely tokens, most likely first.
    """

    token_ids: torch.Tensor  # int64 [num_rows, k + 1]
    logprobs: torch.Tensor  # fp32 [num_rows, k + 1]
    ranks: torch.Tensor  # int64 [num_rows]: tokens with logit >= column 0's (1 = most likely)


def compute_topk_logprobs(
    logits: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """Logprobs of token_ids (int64 [num_rows]) and of the top num_logprobs tokens per row.

    logits: [num_rows, V], any float dtype. Ranks count the tokens whose logit is >= the
    token's own, so the most likely token has rank 1 (ties share the larger rank, as in vLLM).
    """
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs}")
    logits = logits.float()
    ids = token_ids.view(-1, 1).to(torch.int64)  # [num_rows, 1]
    if num_logprobs > 0:
        ids = torch.cat((ids, logits.topk(num_logprobs, dim=-1).indices), dim=1)
    chosen = logits.gather(1, ids)  # fp32 [num_rows, k + 1]
    # log_softmax of the chosen columns only: logit - logsumexp(row).
    logprobs = chosen - logits.logsumexp(dim=-1, keepdim=True)
    ranks = (logits >= chosen[:, :1]).sum(dim=-1)
    return LogprobsTensors(token_ids=ids, logprobs=logprobs, ranks=ranks)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """prompt_logprobs: row i of logits [N, V] predicts target_token_ids[i] (next prompt token)."""
    if logits.shape[0] != target_token_ids.shape[0]:
        raise ValueError(
            f"target_token_ids: {target_token_ids.shape[0]} targets for "
            f"{logits.shape[0]} rows of logits"
        )
    return compute_topk_logprobs(logits, num_logprobs, target_token_ids)
