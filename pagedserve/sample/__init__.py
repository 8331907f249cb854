"""Sampling: logits -> token ids (and logprobs), without the host ever waiting for the device."""

from pagedserve.sample.logprob import (
    LogprobsTensors,
    compute_prompt_logprobs,
    compute_topk_logprobs,
)
from pagedserve.sample.sampler import Sampler, SamplerOutput
from pagedserve.sample.states import SamplingStates

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingStates",
    "compute_prompt_logprobs",
    "compute_topk_logprobs",
]
