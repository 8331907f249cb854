"""What the sampler hands back to the model runner (device tensors; the runner copies them out)."""

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


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [num_rows]
    logprobs: LogprobsTensors | None  # None when no row of the batch asked for logprobs
