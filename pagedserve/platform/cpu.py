"""The CPU platform: torch reference ops, the C kernels where a compiler builds them, eager
steps, the process's thread count and allocator set at start-up."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from pagedserve.cpu_memory import configure_cpu_allocator, zeroed_host_tensor
from pagedserve.cpu_threads import configure_cpu_threads, cpu_thread_governor, usable_cpu_cores
from pagedserve.platform.base import (
    Fp8Backend,
    InputPrepOps,
    Platform,
    no_step_hook,
    torch_input_prep_ops,
)

if TYPE_CHECKING:
    from pagedserve.attention.backends.base import AttentionBackend
    from pagedserve.sample.token_sampler import TokenSampler

logger = logging.getLogger(__name__)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 matrices natively (AMX tiles or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return any(flag in flags for flag in ("amx_bf16", "avx512_bf16"))


@dataclass(frozen=True)
class CpuPlatform(Platform):
    """The CPU: torch reference ops, the native paged-decode kernel where a C compiler builds
    it (``docs/architecture.md#cpu-path``), eager steps, no pinning, no streams."""

    pin_memory: ClassVar[bool] = False
    accelerator: ClassVar[bool] = False
    compiles_by_default: ClassVar[bool] = False
    has_cuda_graphs: ClassVar[bool] = False
    async_scheduling: ClassVar[bool] = False
    kv_budget_from_memory: ClassVar[bool] = False
    dist_backend: ClassVar[str] = "gloo"

    def input_prep_ops(self) -> InputPrepOps:
        return torch_input_prep_ops()

    def attention_backend(self) -> AttentionBackend:
        """The native decode and prefill kernels when a C compiler can build them, else the
        torch reference."""
        from pagedserve.attention.backends.cpu import CpuBackend
        from pagedserve.attention.backends.cpu_native import load_paged_decode_kernel
        from pagedserve.attention.backends.cpu_native.prefill import load_paged_prefill_kernel
        from pagedserve.attention.backends.torch_ref import TorchRefBackend

        kernel = load_paged_decode_kernel()
        if kernel is None:
            return TorchRefBackend()
        return CpuBackend(kernel, load_paged_prefill_kernel())

    def token_sampler(self, vocab_size: int) -> TokenSampler:
        from pagedserve.sample.token_sampler import TorchTokenSampler

        return TorchTokenSampler(vocab_size, self.device)

    def has_triton_kernels(self) -> bool:
        return False

    def dense_linear(self) -> Callable[..., torch.Tensor]:
        """``layers/cpu_gemv.py``: a C kernel for bf16 inputs of a few rows, ``F.linear`` for
        the rest (and everywhere where no C compiler builds the kernel)."""
        from pagedserve.layers.cpu_gemv import cpu_linear

        return cpu_linear()

    def decode_forward(
        self, model: torch.nn.Module
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The decode step in C (``model/cpu_decode.py``) where the model declares one and it
        fits (Llama-family layers in bf16 or fp32 on one rank, a C compiler)."""
        declared = getattr(model, "cpu_decode_forward", None)  # a model capability
        return None if declared is None else declared()

    def prepare_weights(self, model: torch.nn.Module, max_num_reqs: int) -> None:
        """The panel copies (``layers/panel_pack.py``) that batches of ``PANEL_MIN_ROWS``
        requests or more multiply on, the C decode step's weights and the LM head among them:
        made here, within the packed-copy budget, so that a user's first such batch does not
        wait for them. Below that many requests no decode step or LM head reads panels (a
        prompt chunk of a few rows still makes its layers' copies on first use)."""
        from pagedserve.layers.cpu_gemv import pack_panels
        from pagedserve.layers.panel_pack import PANEL_MIN_ROWS

        if max_num_reqs >= PANEL_MIN_ROWS:
            pack_panels(model)

    def native_bf16(self) -> bool:
        return cpu_has_fast_bf16()

    def configure_process(self) -> Callable[[], None]:
        """The thread count (``configure_cpu_threads``, then ``cpu_thread_governor`` between
        steps, up to the count torch had before) and the allocator
        (``configure_cpu_allocator``); the C kernels not built yet, all at once (their loaders
        would build them one after another)."""
        from pagedserve.attention.backends.cpu_native import build_all

        build_all()  # a failed build is logged by its loader, which keeps the torch path
        max_threads = min(torch.get_num_threads(), usable_cpu_cores())
        threads = configure_cpu_threads()
        allocator = "tuned" if configure_cpu_allocator() else "default (mallopt missing or refused)"
        logger.info("CPU start-up: %d torch threads (up to %d as cores go idle), malloc %s",
                    threads, max_threads, allocator)
        return cpu_thread_governor(max_threads) or no_step_hook

    def configure_rank(self, world_size: int) -> None:
        """The ranks share the host's cores; then the engine's thread and malloc policy at
        start-up (a rank's count stays: the ranks would count each other as the load)."""
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        self.configure_process()

    def rank_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def max_ranks(self) -> int | None:
        return None

    def process_group_device(self) -> torch.device | None:
        return None

    def ray_resources(self) -> tuple[dict[str, float], dict[str, int]]:
        return {"CPU": 1.0}, {"num_cpus": 1}

    def new_stream(self) -> torch.cuda.Stream | None:
        return None

    def new_event(self) -> torch.cuda.Event | None:
        return None

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """From the kernel's zero pages (``zeroed_host_tensor``): memory only as it fills."""
        return zeroed_host_tensor(tuple(shape), dtype)

    def synchronize(self) -> None:
        return None

    def memory_allocated(self) -> int:
        return 0

    def multiprocessor_count(self) -> int:
        return 1

    def compute_capability(self) -> tuple[int, int]:
        return (0, 0)

    def card_name(self) -> str | None:
        return None

    def require_fp8(self, field: str) -> None:
        """torch's float8 dtypes exist on every CPU (FP8 storage, dequantized to compute)."""
        return None

    def fp8_linear_backend(self) -> Fp8Backend:
        return "dequantize"
