"""Start-up platform choices: which implementations each device gets, the CPU thread count for
a machine whose cores others may use, and the allocator settings of a CPU process."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedserve import platform
from pagedserve.attention.backends.cpu import CpuBackend
from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.layers.activation import SiluAndMul
from pagedserve.sample.token_sampler import TorchTokenSampler
from pagedserve.worker import input_prep

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.device("cuda")  # selection only: nothing below allocates on it


def _is_torch_reference(ops: platform.InputPrepOps) -> bool:
    return ops.name == "torch" and ops.compute_slot_mappings is input_prep.compute_slot_mappings


def test_cpu_gets_the_torch_references(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = platform.platform_for(torch.device("cpu"))
    assert isinstance(cpu, platform.CpuPlatform)
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
    assert isinstance(cuda, platform.CudaPlatform)
    ops = cuda.input_prep_ops()
    assert ops.name == "triton"
    assert ops.gather_block_tables is triton_input_prep.gather_block_tables
    assert isinstance(cuda.attention_backend(), TritonBackend)
    monkeypatch.setattr(platform.CudaPlatform, "multiprocessor_count", lambda self: 4)
    assert isinstance(cuda.token_sampler(32), TritonTokenSampler)
    assert cuda.has_triton_kernels() and SiluAndMul(CUDA).uses_kernel
    assert (cuda.pin_memory, cuda.compiles_by_default, cuda.has_cuda_graphs) == (True,) * 3
    assert (cuda.async_scheduling, cuda.dist_backend) == (True, "nccl")


def test_cuda_without_triton_runs_the_torch_references(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "triton_available", lambda: False)
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
    monkeypatch.setattr(platform, "cpu_has_fast_bf16", lambda: False)
    assert platform.resolve_dtype("auto", torch.device("cpu")) == torch.float32


@pytest.mark.parametrize(
    ("cores", "load", "expected"),
    [
        (2, 0.0, 2),  # idle machine: every core
        (2, 0.4, 2),  # a little background noise does not take a core
        (2, 0.6, 1),  # one core busy elsewhere
        (2, 5.2, 1),  # oversubscribed: still one thread
        (16, 3.6, 12),
        (1, 0.0, 1),
    ],
)
def test_cpu_thread_count_leaves_busy_cores_alone(cores: int, load: float, expected: int) -> None:
    assert platform.cpu_thread_count(cores, load) == expected


def test_cpu_thread_count_rejects_no_cores() -> None:
    with pytest.raises(ValueError, match="cores"):
        platform.cpu_thread_count(0, 0.0)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def four_cores_one_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "usable_cpu_cores", lambda: 4)
    monkeypatch.setattr(platform.os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.usefixtures("restore_threads", "four_cores_one_busy")
def test_configure_cpu_threads_respects_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(4)
    assert platform.configure_cpu_threads() == 3
    torch.set_num_threads(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert platform.configure_cpu_threads() == 4  # the user's choice is left alone


@pytest.mark.usefixtures("restore_threads", "four_cores_one_busy")
def test_configure_cpu_threads_never_raises_the_count() -> None:
    torch.set_num_threads(1)  # chosen earlier (a test's conftest, a user)
    assert platform.configure_cpu_threads() == 1


def test_configure_cpu_allocator_sets_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    class FakeLibc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(platform.ctypes, "CDLL", lambda name: FakeLibc())
    assert platform.configure_cpu_allocator() is True
    assert dict(calls) == platform.CPU_MALLOC_OPTIONS


def test_configure_cpu_allocator_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libc(name: str) -> None:
        raise OSError(f"{name}: not found")

    monkeypatch.setattr(platform.ctypes, "CDLL", no_libc)
    assert platform.configure_cpu_allocator() is False


def test_configure_cpu_allocator_reports_a_rejected_option(monkeypatch: pytest.MonkeyPatch) -> None:
    class OldLibc:
        def mallopt(self, param: int, value: int) -> int:
            return 0 if param == -3 else 1  # M_MMAP_THRESHOLD refused

    monkeypatch.setattr(platform.ctypes, "CDLL", lambda name: OldLibc())
    assert platform.configure_cpu_allocator() is False


@pytest.mark.usefixtures("restore_threads")
def test_configure_process_leaves_gpu_processes_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    touched: list[str] = []
    monkeypatch.setattr(platform, "configure_cpu_threads", lambda: touched.append("threads") or 1)
    monkeypatch.setattr(
        platform, "configure_cpu_allocator", lambda: touched.append("malloc") or True
    )
    assert platform.platform_for("cuda:0").configure_process() is platform.no_step_hook
    assert touched == []
    platform.platform_for("cpu").configure_process()
    assert touched == ["threads", "malloc"]


def test_usable_cpu_cores_is_positive() -> None:
    assert platform.usable_cpu_cores() >= 1


def test_cpu_zeros_cost_no_memory_up_front() -> None:
    """The CPU KV cache's zeros: pages mapped in on first touch, zero until written."""
    before = _rss_bytes()
    cache = platform.platform_for("cpu").zeros((2, 1 << 16, 16, 8, 64), torch.bfloat16)  # 2 GiB
    assert cache.shape == (2, 1 << 16, 16, 8, 64) and cache.dtype == torch.bfloat16
    assert _rss_bytes() - before < 64 << 20
    assert cache[1, -1].abs().sum() == 0 and cache[0, 12345].abs().sum() == 0
    cache[0, 7] = 1.5
    assert cache[0, 7].sum() == 1.5 * 16 * 8 * 64 and cache[0, 8].sum() == 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_fp8_linear_backend_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU dequantizes; an FP8 GPU uses tensor cores; an older GPU is refused by name."""
    assert platform.platform_for("cpu").fp8_linear_backend() == "dequantize"
    assert platform.platform_for("meta").fp8_linear_backend() == "dequantize"
    cuda = platform.platform_for(CUDA)
    monkeypatch.setattr(platform.CudaPlatform, "card_name", lambda self: "NVIDIA A100")
    monkeypatch.setattr(platform.CudaPlatform, "compute_capability", lambda self: (9, 0))
    assert cuda.fp8_linear_backend() == "scaled_mm"
    monkeypatch.setattr(platform.CudaPlatform, "compute_capability", lambda self: (8, 0))
    with pytest.raises(ValueError, match=r"quantization: FP8 .*NVIDIA A100 is 8\.0"):
        cuda.fp8_linear_backend()


def test_fp8_kv_cache_is_refused_on_a_gpu_without_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 resolves to float8_e4m3fn on the CPU and on an FP8 card; an older card is refused,
    naming the field and the card."""
    cpu = torch.device("cpu")
    assert platform.resolve_kv_cache_dtype("fp8", torch.float32, cpu) is torch.float8_e4m3fn
    monkeypatch.setattr(platform.CudaPlatform, "card_name", lambda self: "NVIDIA A100")
    monkeypatch.setattr(platform.CudaPlatform, "compute_capability", lambda self: (8, 9))
    resolved = platform.resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, CUDA)
    assert resolved is torch.float8_e4m3fn
    monkeypatch.setattr(platform.CudaPlatform, "compute_capability", lambda self: (8, 0))
    assert platform.resolve_kv_cache_dtype("auto", torch.bfloat16, CUDA) is torch.bfloat16
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: FP8 .*NVIDIA A100 is 8\.0$"):
        platform.resolve_kv_cache_dtype("fp8", torch.bfloat16, CUDA)
