"""The ``Platform`` interface every device implements, and what its implementations share:
the input-prep op sets, whether Triton is installed, the FP8 facts."""

from __future__ import annotations

import abc
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

if TYPE_CHECKING:
    from pagedserve.attention.backends.base import AttentionBackend
    from pagedserve.sample.token_sampler import TokenSampler


def no_step_hook() -> None:
    """What a platform with nothing to adjust between steps hands the engine."""


@dataclass(frozen=True)
class InputPrepOps:
    """The input-preparation ops of a step (``docs/architecture.md#step-3-prepare-inputs``).
    Both sets, the torch reference (``worker/input_prep.py``) and the Triton kernels
    (``kernels/input_prep.py``), have the same signatures, so a step never branches."""

    name: str
    prepare_prefill_inputs: Callable[..., None]
    prepare_pos_seq_lens: Callable[..., None]
    combine_sampled_tokens: Callable[..., None]
    gather_block_tables: Callable[..., None]
    compute_slot_mappings: Callable[..., None]

    @classmethod
    def from_module(cls, name: str, module: Any) -> InputPrepOps:  # noqa: ANN401
        return cls(
            name=name,
            prepare_prefill_inputs=module.prepare_prefill_inputs,
            prepare_pos_seq_lens=module.prepare_pos_seq_lens,
            combine_sampled_tokens=module.combine_sampled_tokens,
            gather_block_tables=module.gather_block_tables,
            compute_slot_mappings=module.compute_slot_mappings,
        )


def torch_input_prep_ops() -> InputPrepOps:
    """The reference set: torch ops, on any device."""
    from pagedserve.worker import input_prep

    return InputPrepOps.from_module("torch", input_prep)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


Fp8Backend = Literal["scaled_mm", "dequantize"]
FP8_MIN_CAPABILITY = (8, 9)
"""The first NVIDIA compute capability with FP8 tensor cores (Ada; Hopper is 9.0)."""


@dataclass(frozen=True)
class Platform(abc.ABC):
    """What differs between the devices the engine runs on, for one ``device``.

    Built by ``platform_for``; the class facts below answer start-up questions, the methods
    hand out the device's ops and do its device work (streams, synchronize, memory)."""

    device: torch.device

    pin_memory: ClassVar[bool]
    """Host buffers of asynchronous host-to-device copies are pinned: a copy from pageable
    memory may wait for the device's queued work."""
    accelerator: ClassVar[bool]
    """A device with its own memory and queue, beside the host."""
    compiles_by_default: ClassVar[bool]
    """``CompilationConfig.mode = "auto"`` compiles the model."""
    has_cuda_graphs: ClassVar[bool]
    async_scheduling: ClassVar[bool]
    """Default of ``SchedulerConfig.async_scheduling``: plan step N+1 while the device runs N."""
    kv_budget_from_memory: ClassVar[bool]
    """The KV cache takes what profiling leaves of the card (``gpu_memory_utilization``);
    else the host budget ``CacheConfig.kv_cache_memory`` sizes it, known before loading, so
    a context that does not fit is shortened (``docs/architecture.md#cpu-path``)."""
    dist_backend: ClassVar[str]
    """torch.distributed backend of the tensor-parallel group."""

    # ---- the device's ops (start-up) ----

    @abc.abstractmethod
    def input_prep_ops(self) -> InputPrepOps:
        """The step's input-prep ops (``docs/architecture.md#step-3-prepare-inputs``)."""

    @abc.abstractmethod
    def attention_backend(self) -> AttentionBackend:
        """The paged-attention implementation every attention layer calls."""

    @abc.abstractmethod
    def token_sampler(self, vocab_size: int) -> TokenSampler:
        """Token selection of the sampler (``docs/architecture.md#step-7-logits-and-sampling``)."""

    @abc.abstractmethod
    def has_triton_kernels(self) -> bool:
        """The model's fused Triton kernels run here (RMSNorm with the residual add, SiLU and
        mul, the one-token GEMV forward); else the layers run their torch code."""

    @abc.abstractmethod
    def dense_linear(self) -> Callable[..., torch.Tensor]:
        """The matmul of unquantized linear layers and the LM head, as ``F.linear``
        (x, weight, bias=None): the CPU's serves few-row bf16 inputs with its own kernel."""

    @abc.abstractmethod
    def decode_forward(
        self, model: torch.nn.Module
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """``model``'s forward with the steps whose requests each decode one token on this
        device's own code (the model's torch layers serve the other steps), or None: the
        model's forward (or the compiled one) serves every step."""

    @abc.abstractmethod
    def prepare_weights(self, model: torch.nn.Module, max_num_reqs: int) -> None:
        """Start-up work on the loaded weights that steps of up to ``max_num_reqs`` requests
        would otherwise do on their first use (the CPU's packed copies)."""

    @abc.abstractmethod
    def native_bf16(self) -> bool:
        """bf16 matmuls run natively: the dtype ``auto`` resolves to bf16."""

    # ---- process and ranks ----

    @abc.abstractmethod
    def configure_process(self) -> Callable[[], None]:
        """Start-up settings of an engine process on this device. Returns what the engine
        calls before each step (the CPU's thread count follows the machine's load)."""

    @abc.abstractmethod
    def configure_rank(self, world_size: int) -> None:
        """Start-up settings of one of ``world_size`` tensor-parallel worker processes."""

    @abc.abstractmethod
    def rank_device(self, local_rank: int) -> torch.device:
        """The device of the rank with this index on its host."""

    @abc.abstractmethod
    def max_ranks(self) -> int | None:
        """How many ranks one host holds (None: no limit)."""

    @abc.abstractmethod
    def process_group_device(self) -> torch.device | None:
        """The ``device_id`` of ``init_process_group`` (None: not bound to a device)."""

    @abc.abstractmethod
    def ray_resources(self) -> tuple[dict[str, float], dict[str, int]]:
        """(placement-group bundle, actor options) of one rank in a Ray cluster."""

    # ---- device work ----

    @abc.abstractmethod
    def new_stream(self) -> torch.cuda.Stream | None:
        """A side stream (None: the device has one queue; work on it is synchronous)."""

    @abc.abstractmethod
    def new_event(self) -> torch.cuda.Event | None:
        """An event to record on the current stream (None: nothing runs asynchronously)."""

    @abc.abstractmethod
    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor on the device, for a large buffer a run may never fill (the KV
        cache)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for the device's queued work."""

    @abc.abstractmethod
    def memory_allocated(self) -> int:
        """Bytes this process's tensors hold on the device (0 where not tracked)."""

    @abc.abstractmethod
    def multiprocessor_count(self) -> int:
        """Streaming multiprocessors; 1 where kernels run under the Triton interpreter."""

    @abc.abstractmethod
    def compute_capability(self) -> tuple[int, int]:
        """(major, minor) of the card; (0, 0) where there is none."""

    @abc.abstractmethod
    def card_name(self) -> str | None:
        """The card's marketing name (None: no card)."""

    @abc.abstractmethod
    def require_fp8(self, field: str) -> None:
        """ValueError naming ``field`` where FP8 (e4m3 storage and arithmetic) cannot run."""

    @abc.abstractmethod
    def fp8_linear_backend(self) -> Fp8Backend:
        """How FP8 linear layers compute here (``layers/quantization/fp8.py``): ``scaled_mm``
        on FP8 tensor cores, ``dequantize`` (FP8 storage, the matmul in the compute dtype).
        ValueError where FP8 cannot run."""
