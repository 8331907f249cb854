"""Triton kernels: input preparation and slot mapping (``input_prep``), the rotary embedding
with the KV-cache write (``rope_kv_write``), paged attention (``paged_attention``,
``paged_attention_split``), the decoder layer's residual add + RMSNorm (``rms_norm``) and
SiLU-and-mul (``silu_and_mul``), batch-1 GEMVs (``gemv``) and sampling (``sampling_gumbel``:
temperature + seeded Gumbel-max; ``sampling_truncation``: top-k / top-p / min-p cuts without
a sort).

Integer arguments that change from step to step (``num_reqs``, padded token counts) are marked
``do_not_specialize``: Triton otherwise compiles a new variant of the kernel the first time such
a value is 1 or a multiple of 16, in the middle of serving, where the compile stalls a step
(docs/gpu.md#host-side-stalls)."""

import torch

from pagedserve.kernels import interpreter_compat
from pagedserve.platform import platform_for

interpreter_compat.apply()

DEFAULT_SMS = 4
"""The SM count assumed where no CUDA device tells its own (interpreter runs on the CPU)."""


def sm_count(device: torch.device | None = None) -> int:
    """Streaming multiprocessors of ``device`` (None: the current CUDA device, if any), sizing
    launches that aim at a number of programs per SM: the platform's ``multiprocessor_count``
    on CUDA, ``DEFAULT_SMS`` elsewhere (the interpreter's launches still split work)."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is None or device.type != "cuda":
        return DEFAULT_SMS
    return platform_for(device).multiprocessor_count()
