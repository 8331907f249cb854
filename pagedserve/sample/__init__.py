"""Sampling: logits -> token ids (and logprobs), with per-slot state that never syncs the device."""

from pagedserve.sample.logprob import compute_prompt_logprobs, compute_topk_logprobs
from pagedserve.sample.output import LogprobsTensors, SamplerOutput
from pagedserve.sample.sampler import Sampler

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "compute_prompt_logprobs",
    "compute_topk_logprobs",
]
