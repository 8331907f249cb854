"""Where the engine runs: the device, the dtype ``auto`` resolves to, and the ``Platform``,
the one place that knows what differs between devices.

``platform_for(device)`` is the only branch on the device type in the engine. Everything that
differs (which input-prep ops, token sampler and attention backend run, whether host buffers
are pinned, streams and events, memory queries, process-group backend, compile and CUDA-graph
defaults) is a field or method of the platform it returns. Components ask it once at start-up
and keep what it hands them; no step asks it again. The torch implementations are the CPU's
and the reference the tests hold the Triton ones to.
"""

from __future__ import annotations

import abc
import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from pagedserve.cpu_memory import configure_cpu_allocator, zeroed_host_tensor
from pagedserve.cpu_threads import configure_cpu_threads, cpu_thread_governor, usable_cpu_cores

if TYPE_CHECKING:
    from pagedserve.attention.backends.base import AttentionBackend
    from pagedserve.sample.token_sampler import TokenSampler

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pagedserve`` if set, else ``~/.cache/pagedserve``: converted
    tokenizers, compiled CPU kernels."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedserve"


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but no CUDA device is available")
    return torch.device(device)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 matrices natively (AMX tiles or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return any(flag in flags for flag in ("amx_bf16", "avx512_bf16"))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on GPUs and on CPUs with native bf16 matmuls, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if platform_for(device).native_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}")
    return _DTYPES[dtype]


KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
"""``kv_cache_dtype`` values other than auto, and the cache's element type."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype,
                           device: torch.device) -> torch.dtype:
    """The KV cache's element type: the model's for ``auto``; float8_e4m3fn for ``fp8`` /
    ``fp8_e4m3``, where the device has FP8 (``Platform.require_fp8``)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: unknown {kv_cache_dtype!r} (auto, fp8, fp8_e4m3)")
    platform_for(device).require_fp8("kv_cache_dtype")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def no_step_hook() -> None:
    """What a platform with nothing to adjust between steps hands the engine."""


# ---- the platform -----------------------------------------------------------------------------


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

    def native_bf16(self) -> bool:
        return cpu_has_fast_bf16()

    def configure_process(self) -> Callable[[], None]:
        """The thread count (``configure_cpu_threads``, then ``cpu_thread_governor`` between
        steps, up to the count torch had before) and the allocator
        (``configure_cpu_allocator``)."""
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
        return torch.cuda.get_device_properties(self.device).multi_processor_count

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


_PLATFORMS: dict[str, type[Platform]] = {
    "cpu": CpuPlatform,
    "cuda": CudaPlatform,
    "meta": CpuPlatform,  # shapes only (a model built to read its parameter shapes): torch code
}


@functools.cache
def platform_for(device: torch.device | str) -> Platform:
    """The platform of ``device`` (a resolved device, not ``auto``): the one place that looks
    at the device type. Cheap and allocation-free (nothing touches the device), cached per
    device."""
    device = torch.device(device)
    kind = _PLATFORMS.get(device.type)
    if kind is None:
        raise ValueError(f"device: {str(device)!r} is not supported (cpu or cuda)")
    return kind(device)
