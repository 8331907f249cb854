"""Per-slot sampling parameters: the sampling columns of the request slots.

``RequestStates`` owns one ``SamplingStates``. Its ``add_request`` writes a slot's row from the
request's SamplingParams into the host side of the step's staging buffer, and the step's one
copy brings the row to the device (docs/architecture.md#step-7-logits-and-sampling). The sampler
and its token samplers read the device columns through idx_mapping. Host-side questions about a
batch ("is any row greedy?", "the largest top_k?") are answered from the host columns indexed
with idx_mapping_np, so the sampler chooses its ops without ever reading a device value.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.staging import StagedArray, StagingBuffer

NO_LOGPROBS = -1
"""``num_logprobs_np`` of a slot whose request asks for no logprobs."""
_MAX_SEED = 2**63  # exclusive, as SamplingParams.seed

# The staged columns: name -> (dtype, value of a slot that no request has written).
_COLUMNS: dict[str, tuple[torch.dtype, float]] = {
    "temperature": (torch.float32, 1.0),
    "greedy": (torch.bool, False),
    "top_k": (torch.int64, 0),
    "top_p": (torch.float32, 1.0),
    "min_p": (torch.float32, 0.0),
    "seeds": (torch.int64, 0),
    "repetition_penalty": (torch.float32, 1.0),
    "frequency_penalty": (torch.float32, 0.0),
    "presence_penalty": (torch.float32, 0.0),
    "min_tokens": (torch.int64, 0),
}


def uses_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


class SamplingStates:
    @staticmethod
    def staged_arrays(max_num_reqs: int) -> list[StagedArray]:
        """The columns SamplingStates keeps in a staging buffer."""
        return [StagedArray(name, dtype, max_num_reqs) for name, (dtype, _) in _COLUMNS.items()]

    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device,
        seed: int = 0,
        staging: StagingBuffer | None = None,
    ) -> None:
        """``staging`` must hold ``staged_arrays(max_num_reqs)``; None: a buffer of its own.
        ``seed`` seeds the seeds of requests that bring none (reproducible runs)."""
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        if staging is None:
            staging = StagingBuffer(self.staged_arrays(max_num_reqs), device)
        self.staging = staging
        for name, (_, fill) in _COLUMNS.items():
            staging.host[name].fill(fill)
        host, dev = staging.host, staging.device_views
        # Device columns, all [max_num_reqs] and indexed by slot; their host twins end in _np.
        # The divisor applied to logits; 1.0 for greedy slots so a mixed batch never divides by 0.
        self.temperature, self.temperature_np = dev["temperature"], host["temperature"]  # fp32
        self.greedy, self.greedy_np = dev["greedy"], host["greedy"]  # bool
        self.top_k, self.top_k_np = dev["top_k"], host["top_k"]  # int64; 0: off (also k >= V)
        self.top_p, self.top_p_np = dev["top_p"], host["top_p"]  # fp32
        self.min_p, self.min_p_np = dev["min_p"], host["min_p"]  # fp32
        self.seeds, self.seeds_np = dev["seeds"], host["seeds"]  # int64 in [0, 2**63)
        self.repetition_penalty = dev["repetition_penalty"]  # fp32
        self.repetition_penalty_np = host["repetition_penalty"]
        self.frequency_penalty = dev["frequency_penalty"]  # fp32
        self.frequency_penalty_np = host["frequency_penalty"]
        self.presence_penalty = dev["presence_penalty"]  # fp32
        self.presence_penalty_np = host["presence_penalty"]
        self.min_tokens, self.min_tokens_np = dev["min_tokens"], host["min_tokens"]  # int64
        # Host only: what the device never reads.
        self.num_logprobs_np = np.full(max_num_reqs, NO_LOGPROBS, dtype=np.int32)  # [max_num_reqs]
        self.uses_penalties_np = np.zeros(max_num_reqs, dtype=bool)  # [max_num_reqs]
        # Device only: advanced by Sampler.update_after_sampling, never mirrored on the host.
        # Equals the number of output tokens the slot's request has so far.
        self.num_output_tokens = torch.zeros(
            max_num_reqs, dtype=torch.int64, device=device
        )  # int64 [max_num_reqs]
        self.seed_rng = np.random.default_rng(seed)

    def add_request(self, slot: int, params: SamplingParams, num_output_tokens: int) -> None:
        """Write the slot's row (host columns: the step's staging copy takes them to the
        device). ``num_output_tokens``: the outputs a resumed request brings back."""
        self.greedy_np[slot] = params.greedy
        self.temperature_np[slot] = 1.0 if params.greedy else params.temperature
        self.top_k_np[slot] = params.top_k if 0 < params.top_k < self.vocab_size else 0
        self.top_p_np[slot] = params.top_p
        self.min_p_np[slot] = params.min_p
        seed = params.seed
        if seed is None:
            seed = int(self.seed_rng.integers(0, _MAX_SEED))
        self.seeds_np[slot] = seed
        self.repetition_penalty_np[slot] = params.repetition_penalty
        self.frequency_penalty_np[slot] = params.frequency_penalty
        self.presence_penalty_np[slot] = params.presence_penalty
        self.min_tokens_np[slot] = params.min_tokens
        self.uses_penalties_np[slot] = uses_penalties(params)
        self.num_logprobs_np[slot] = NO_LOGPROBS if params.logprobs is None else params.logprobs
        # fill_ with a Python scalar launches a kernel; item assignment would copy from the host.
        self.num_output_tokens[slot].fill_(num_output_tokens)

    def remove_request(self, slot: int) -> None:
        self.num_logprobs_np[slot] = NO_LOGPROBS
        self.uses_penalties_np[slot] = False

    def all_greedy(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.all(self.greedy_np[idx_mapping_np]))

    def any_greedy(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.greedy_np[idx_mapping_np]))

    def any_temperature(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.temperature_np[idx_mapping_np] != 1.0))

    def any_min_p(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.min_p_np[idx_mapping_np] > 0.0))

    def max_top_k(self, idx_mapping_np: np.ndarray) -> int:
        """The largest top_k in the batch; 0 when no row uses top-k."""
        return int(np.max(self.top_k_np[idx_mapping_np], initial=0))

    def any_top_p(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.top_p_np[idx_mapping_np] < 1.0))

    def any_truncation(self, idx_mapping_np: np.ndarray) -> bool:
        """Whether any row of the batch uses min-p, top-k or top-p."""
        return (
            self.any_min_p(idx_mapping_np)
            or self.max_top_k(idx_mapping_np) > 0
            or self.any_top_p(idx_mapping_np)
        )

    def any_penalties(self, idx_mapping_np: np.ndarray) -> bool:
        """Whether any row of the batch uses a repetition, frequency or presence penalty."""
        return bool(np.any(self.uses_penalties_np[idx_mapping_np]))

    def max_num_logprobs(self, idx_mapping_np: np.ndarray) -> int:
        """The most logprobs any row asks for; NO_LOGPROBS when none asks."""
        return int(np.max(self.num_logprobs_np[idx_mapping_np], initial=NO_LOGPROBS))

    def num_logprobs(self, idx_mapping_np: np.ndarray) -> list[int | None]:
        """Per row, the logprobs its request asks for (None: none)."""
        return [None if k == NO_LOGPROBS else k
                for k in self.num_logprobs_np[idx_mapping_np].tolist()]
