"""The NVIDIA GPU platform: Triton kernels (the torch references where Triton is missing),
compiled steps and CUDA graphs, pinned host buffers, FP8 from compute capability 8.9."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from pagedserve.platform.base import (
    FP8_MIN_CAPABILITY,
    Fp8Backend,
    InputPrepOps,
    Platform,
    no_step_hook,
    torch_input_prep_ops,
    triton_available,
)

if TYPE_CHECKING:
    from pagedserve.attention.backends.base import AttentionBackend
    from pagedserve.sample.token_sampler import TokenSampler


@dataclass(frozen=True)
class CudaPlatform(Platform):
    """NVIDIA GPUs: the Triton kernels where triton is installed (else the torch references),
    compiled steps and CUDA graphs, pinned host buffers, a side stream for the output copy."""

    pin_memory: ClassVar[bool] = True
    accelerator: ClassVar[bool] = True
    compiles_by_default: ClassVar[bool] = True
    has_cuda_graphs: ClassVar[bool] = True
    async_scheduling: ClassVar[bool] = True
    kv_budget_from_memory: ClassVar[bool] = True
    dist_backend: ClassVar[str] = "nccl"

    def input_prep_ops(self) -> InputPrepOps:
        if not triton_available():
            return torch_input_prep_ops()
        from pagedserve.kernels import input_prep  # needs triton

        return InputPrepOps.from_module("triton", input_prep)

    def attention_backend(self) -> AttentionBackend:
        if not triton_available():
            from pagedserve.attention.backends.torch_ref import TorchRefBackend

            return TorchRefBackend()
        from pagedserve.attention.backends.triton import TritonBackend

        return TritonBackend()

    def token_sampler(self, vocab_size: int) -> TokenSampler:
        if not triton_available():
            from pagedserve.sample.token_sampler import TorchTokenSampler

            return TorchTokenSampler(vocab_size, self.device)
        from pagedserve.sample.triton_token_sampler import TritonTokenSampler

        return TritonTokenSampler(vocab_size, self.device)

    def has_triton_kernels(self) -> bool:
        return triton_available()

    def dense_linear(self) -> Callable[..., torch.Tensor]:
        return torch.nn.functional.linear

    def decode_forward(
        self, model: torch.nn.Module
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """None: one-token steps run the model's Triton GEMV forward inside the compiled one
        (``model.one_token_forward``, chosen by the runner), eager runs the torch layers."""
        return None

    def prepare_weights(self, model: torch.nn.Module, max_num_reqs: int) -> None:
        """Nothing: the card's products read the weights as loaded."""
        return None

    def native_bf16(self) -> bool:
        return True

    def configure_process(self) -> Callable[[], None]:
        return no_step_hook

    def configure_rank(self, world_size: int) -> None:
        torch.cuda.set_device(self.device)

    def rank_device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank)

    def max_ranks(self) -> int | None:
        return torch.cuda.device_count()

    def process_group_device(self) -> torch.device | None:
        return self.device

    def ray_resources(self) -> tuple[dict[str, float], dict[str, int]]:
        """A GPU per rank; its actor needs no CPU slot."""
        return {"GPU": 1.0}, {"num_gpus": 1, "num_cpus": 0}

    def new_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> torch.cuda.Event | None:
        return torch.cuda.Event()

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def multiprocessor_count(self) -> int:
        return _multiprocessor_count(self.device)

    def compute_capability(self) -> tuple[int, int]:
        return torch.cuda.get_device_capability(self.device)

    def card_name(self) -> str | None:
        return torch.cuda.get_device_name(self.device)

    def require_fp8(self, field: str) -> None:
        """From compute capability 8.9 (Ada, Hopper) on; older cards have no FP8 tensor cores
        nor e4m3 conversions and are refused."""
        capability = self.compute_capability()
        if capability < FP8_MIN_CAPABILITY:
            raise ValueError(
                f"{field}: FP8 needs FP8 tensor cores (compute capability 8.9 or newer); "
                f"{self.card_name()} is {capability[0]}.{capability[1]}"
            )

    def fp8_linear_backend(self) -> Fp8Backend:
        """``scaled_mm``, where the card has FP8 (``require_fp8``)."""
        self.require_fp8("quantization")
        return "scaled_mm"


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    """Asked of the driver once per device: kernel launches on the step's path size by it."""
    return torch.cuda.get_device_properties(device).multi_processor_count
