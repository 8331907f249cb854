"""Start-up platform choices: which implementations each device gets, and what a CPU process
configures (its threads and allocator, each tested in its own module)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedserve import platform
from pagedserve.attention.backends.cpu import CpuBackend
from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.layers.activation import SiluAndMul
from pagedserve.platform import base as platform_base
from pagedserve.platform import cpu as cpu_platform
from pagedserve.platform import cuda as cuda_platform
from pagedserve.sample.token_sampler import TorchTokenSampler
from pagedserve.worker import input_prep

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.device("cuda")  # selection only: nothing below allocates on it


def _is_torch_reference(ops: platform_base.InputPrepOps) -> bool:
    return ops.name == "torch" and ops.compute_slot_mappings is input_prep.compute_slot_mappings


def test_cpu_gets_the_torch_references(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = platform.platform_for(torch.device("cpu"))
    assert isinstance(cpu, cpu_platform.CpuPlatform)
    assert _is_torch_reference(cpu.input_prep_ops())
    assert isinstance(cpu.token_sampler(32), TorchTokenSampler)
    assert not cpu.has_triton_kernels() and not SiluAndMul(cpu.device).uses_kernel
    assert (cpu.pin_memory, cpu.compiles_by_default, cpu.has_cuda_graphs) == (False,) * 3
    assert (cpu.async_scheduling, cpu.dist_backend, cpu.new_stream()) == (False, "gloo", None)
    monkeypatch.setattr("pagedserve.attention.backends.cpu_native.load_paged_decode_kernel",
                        lambda: None)  # no C compiler: the torch reference
    backend = cpu.attention_backend()
    assert isinstance(backend, TorchRefBackend) and not isinstance(backend, CpuBackend)


def test_cpu_attention_takes_the_native_kernel_when_it_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel = object()
    monkeypatch.setattr("pagedserve.attention.backends.cpu_native.load_paged_decode_kernel",
                        lambda: kernel)
    backend = platform.platform_for("cpu").attention_backend()
    assert isinstance(backend, CpuBackend) and backend.kernel is kernel


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_cuda_gets_the_triton_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.attention.backends.triton import TritonBackend
    from pagedserve.kernels import input_prep as triton_input_prep
    from pagedserve.sample.triton_token_sampler import TritonTokenSampler

    cuda = platform.platform_for(CUDA)
    assert isinstance(cuda, cuda_platform.CudaPlatform)
    ops = cuda.input_prep_ops()
    assert ops.name == "triton"
    assert ops.gather_block_tables is triton_input_prep.gather_block_tables
    assert isinstance(cuda.attention_backend(), TritonBackend)
    monkeypatch.setattr(cuda_platform.CudaPlatform, "multiprocessor_count", lambda self: 4)
    assert isinstance(cuda.token_sampler(32), TritonTokenSampler)
    assert cuda.has_triton_kernels() and SiluAndMul(CUDA).uses_kernel
    assert (cuda.pin_memory, cuda.compiles_by_default, cuda.has_cuda_graphs) == (True,) * 3
    assert (cuda.async_scheduling, cuda.dist_backend) == (True, "nccl")


def test_cuda_without_triton_runs_the_torch_references(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_platform, "triton_available", lambda: False)
    cuda = platform.platform_for(CUDA)
    assert _is_torch_reference(cuda.input_prep_ops())
    assert type(cuda.attention_backend()) is TorchRefBackend
    assert not cuda.has_triton_kernels()


def test_platform_for_is_one_object_per_device() -> None:
    assert platform.platform_for(torch.device("cpu")) is platform.platform_for(torch.device("cpu"))
    assert platform.platform_for("cuda:1").rank_device(3) == torch.device("cuda", 3)
    assert platform.platform_for("cpu").rank_device(3) == torch.device("cpu")


def test_platform_for_names_an_unsupported_device() -> None:
    with pytest.raises(ValueError, match="device: 'mps' is not supported"):
        platform.platform_for(torch.device("mps"))


def test_auto_dtype_follows_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    assert platform.resolve_dtype("auto", CUDA) == torch.bfloat16
    monkeypatch.setattr(cpu_platform, "cpu_has_fast_bf16", lambda: False)
    assert platform.resolve_dtype("auto", torch.device("cpu")) == torch.float32


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("restore_threads")
def test_configure_process_leaves_gpu_processes_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    touched: list[str] = []
    monkeypatch.setattr(cpu_platform, "configure_cpu_threads", lambda: touched.append("threads") or 1)
    monkeypatch.setattr(
        cpu_platform, "configure_cpu_allocator", lambda: touched.append("malloc") or True
    )
    assert platform.platform_for("cuda:0").configure_process() is platform_base.no_step_hook
    assert touched == []
    platform.platform_for("cpu").configure_process()
    assert touched == ["threads", "malloc"]


def test_fp8_linear_backend_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU dequantizes; an FP8 GPU uses tensor cores; an older GPU is refused by name."""
    assert platform.platform_for("cpu").fp8_linear_backend() == "dequantize"
    assert platform.platform_for("meta").fp8_linear_backend() == "dequantize"
    cuda = platform.platform_for(CUDA)
    monkeypatch.setattr(cuda_platform.CudaPlatform, "card_name", lambda self: "NVIDIA A100")
    monkeypatch.setattr(cuda_platform.CudaPlatform, "compute_capability", lambda self: (9, 0))
    assert cuda.fp8_linear_backend() == "scaled_mm"
    monkeypatch.setattr(cuda_platform.CudaPlatform, "compute_capability", lambda self: (8, 0))
    with pytest.raises(ValueError, match=r"quantization: FP8 .*NVIDIA A100 is 8\.0"):
        cuda.fp8_linear_backend()


def test_fp8_kv_cache_is_refused_on_a_gpu_without_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 resolves to float8_e4m3fn on the CPU and on an FP8 card; an older card is refused,
    naming the field and the card."""
    cpu = torch.device("cpu")
    assert platform.resolve_kv_cache_dtype("fp8", torch.float32, cpu) is torch.float8_e4m3fn
    monkeypatch.setattr(cuda_platform.CudaPlatform, "card_name", lambda self: "NVIDIA A100")
    monkeypatch.setattr(cuda_platform.CudaPlatform, "compute_capability", lambda self: (8, 9))
    resolved = platform.resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, CUDA)
    assert resolved is torch.float8_e4m3fn
    monkeypatch.setattr(cuda_platform.CudaPlatform, "compute_capability", lambda self: (8, 0))
    assert platform.resolve_kv_cache_dtype("auto", torch.bfloat16, CUDA) is torch.bfloat16
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: FP8 .*NVIDIA A100 is 8\.0$"):
        platform.resolve_kv_cache_dtype("fp8", torch.bfloat16, CUDA)
