"""Per-slot sampling parameters (temperature, top-k/p, min-p, seed, logprobs) and output counts.

Host-side questions about a batch ("is any row greedy?", "the largest top_k?") are answered from
the numpy mirrors indexed with idx_mapping_np, so the sampler chooses its ops without ever
reading a device value.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.sample.slot_buffer import SlotBuffer
from pagedserve.sampling_params import SamplingParams

NO_LOGPROBS = -1
_MAX_SEED = 2**63  # exclusive, as SamplingParams.seed


class SamplingStates:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        # The divisor applied to logits; 1.0 for greedy slots so a mixed batch never divides by 0.
        self.temperature = SlotBuffer((max_num_reqs,), torch.float32, device, 1.0)
        self.greedy = SlotBuffer((max_num_reqs,), torch.bool, device, False)
        self.top_k = SlotBuffer((max_num_reqs,), torch.int64, device, 0)  # 0: off (also k >= V)
        self.top_p = SlotBuffer((max_num_reqs,), torch.float32, device, 1.0)
        self.min_p = SlotBuffer((max_num_reqs,), torch.float32, device, 0.0)
        self.seeds = SlotBuffer((max_num_reqs,), torch.int64, device, 0)  # in [0, 2**63)
        self.num_logprobs = np.full(max_num_reqs, NO_LOGPROBS, dtype=np.int64)  # [max_num_reqs]
        # Device-owned: advanced by update_after_sampling, never mirrored on the host.
        # Equals the number of output tokens the slot's request has so far.
        self.num_output_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        # Seeds for requests that bring none; seeded by the engine seed for reproducible runs.
        self.seed_rng = np.random.default_rng(seed)

    def add_request(self, slot: int, params: SamplingParams, num_output_tokens: int) -> None:
        self.greedy[slot] = params.greedy
        self.temperature[slot] = 1.0 if params.greedy else params.temperature
        self.top_k[slot] = params.top_k if 0 < params.top_k < self.vocab_size else 0
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        seed = params.seed
        if seed is None:
            seed = int(self.seed_rng.integers(0, _MAX_SEED))
        self.seeds[slot] = seed
        self.num_logprobs[slot] = NO_LOGPROBS if params.logprobs is None else params.logprobs
        # fill_ with a Python scalar launches a kernel; item assignment would copy from the host.
        self.num_output_tokens[slot].fill_(num_output_tokens)

    def remove_request(self, slot: int) -> None:
        self.num_logprobs[slot] = NO_LOGPROBS

    def copy_to_device(self) -> None:
        for buffer in (
            self.temperature,
            self.greedy,
            self.top_k,
            self.top_p,
            self.min_p,
            self.seeds,
        ):
            buffer.copy_to_device()

    def all_greedy(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.all(self.greedy.np[idx_mapping_np]))

    def any_greedy(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.greedy.np[idx_mapping_np]))

    def any_temperature(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.temperature.np[idx_mapping_np] != 1.0))

    def any_min_p(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.min_p.np[idx_mapping_np] > 0.0))

    def max_top_k(self, idx_mapping_np: np.ndarray) -> int:
        """The largest top_k in the batch; 0 when no row uses top-k."""
        return int(np.max(self.top_k.np[idx_mapping_np], initial=0))

    def any_top_p(self, idx_mapping_np: np.ndarray) -> bool:
        return bool(np.any(self.top_p.np[idx_mapping_np] < 1.0))

    def any_truncation(self, idx_mapping_np: np.ndarray) -> bool:
        """Whether any row of the batch uses min-p, top-k or top-p."""
        return (
            self.any_min_p(idx_mapping_np)
            or self.max_top_k(idx_mapping_np) > 0
            or self.any_top_p(idx_mapping_np)
        )

    def max_num_logprobs(self, idx_mapping_np: np.ndarray) -> int:
        """The most logprobs any row asks for; NO_LOGPROBS when none asks."""
        return int(np.max(self.num_logprobs[idx_mapping_np], initial=NO_LOGPROBS))
