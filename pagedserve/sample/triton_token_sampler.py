"""The CUDA token sampler: a truncation kernel (only when some row uses min-p, top-k or top-p)
and one fused noise-and-argmax pass. Same results as ``TorchTokenSampler`` (see
``pagedserve/kernels/sampling_*.py`` for where exactly, and the top-p rounding caveat).

The kernels read per-slot parameters straight from the ``SamplingStates`` device columns through
idx_mapping and read the logits in their own dtype, so a step adds no gathers and no fp32 copy
of the logits.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.kernels.sampling_common import SlotParams
from pagedserve.kernels.sampling_gumbel import NoiseHash, gumbel_sample, num_splits_for
from pagedserve.kernels.sampling_truncation import DEFAULT_BUFFER_SIZE, truncation_cuts
from pagedserve.platform import platform_for
from pagedserve.sample.noise import HASH_MUL, SEED_SALT, UNIFORM_BITS, VOCAB_SALT
from pagedserve.sample.states import SamplingStates

NOISE_HASH = NoiseHash(
    mul=HASH_MUL, seed_salt=SEED_SALT, vocab_salt=VOCAB_SALT, uniform_bits=UNIFORM_BITS
)
_PROGRAMS_PER_SM = 2  # the noise pass splits rows until about this many programs per SM


def slot_params(states: SamplingStates) -> SlotParams:
    return SlotParams(
        temperature=states.temperature,
        greedy=states.greedy,
        top_k=states.top_k,
        top_p=states.top_p,
        min_p=states.min_p,
        seeds=states.seeds,
        counters=states.num_output_tokens,
    )


class TritonTokenSampler:
    def __init__(
        self, vocab_size: int, device: torch.device, buffer_size: int = DEFAULT_BUFFER_SIZE
    ) -> None:
        self.vocab_size = vocab_size
        self.buffer_size = buffer_size  # per-row scratch of the truncation search
        self.target_programs = _PROGRAMS_PER_SM * platform_for(device).multiprocessor_count()

    def sample(
        self,
        logits: torch.Tensor,
        states: SamplingStates,
        idx_mapping: torch.Tensor,
        idx_mapping_np: np.ndarray,
    ) -> torch.Tensor:
        if states.all_greedy(idx_mapping_np):
            return logits.argmax(dim=-1)
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        params = slot_params(states)
        cuts = None
        if states.any_truncation(idx_mapping_np):
            cuts = truncation_cuts(logits, idx_mapping, params, self.buffer_size)
        num_splits = num_splits_for(len(idx_mapping_np), self.vocab_size, self.target_programs)
        return gumbel_sample(logits, idx_mapping, params, cuts, NOISE_HASH, num_splits)
