"""The CPU backend's native decode kernel (``cpu_native/paged_decode.c``) against the torch
reference: head sizes with their own compiled copy (64, 128) and the generic loop (8, 80, 96),
GQA groups, bf16 and fp32, shuffled blocks, block sizes other than 16, builds for CPUs
without AVX512 or AVX512-BF16, several threads, strided query rows; its argument checks; and
the fallback when no compiler can build it.

The dense-reference cases of ``test_torch_ref.py`` run through this backend too.
"""

from __future__ import annotations

import logging
import platform
import random
import subprocess
import sys

import pytest
import torch

from pagedserve.attention.backends import cpu_native
from pagedserve.attention.backends.base import AttentionMetadata
from pagedserve.attention.backends.cpu import CpuBackend
from pagedserve.attention.backends.torch_ref import TorchRefBackend

KERNEL = cpu_native.load_paged_decode_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler to build the kernel")
BLOCK_SIZE = 16


def _decode_batch(
    seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random keys in shuffled blocks and one query row per request: (query, kv_cache, metadata)."""
    rng = random.Random(sum(seq_lens) + head_dim)
    width = max(-(-n // block_size) for n in seq_lens) + 1
    free = list(range(len(seq_lens) * width + 3))
    rng.shuffle(free)
    table = []
    for n in seq_lens:
        blocks = [free.pop() for _ in range(-(-n // block_size))]
        table.append(blocks + [-1] * (width - len(blocks)))  # past the end: never read
    kv_cache = torch.randn(2, len(free) + len(seq_lens) * width, block_size, num_kv_heads, head_dim)
    query = torch.randn(len(seq_lens), num_heads, head_dim)
    metadata = AttentionMetadata(
        num_reqs=len(seq_lens),
        num_actual_tokens=len(seq_lens),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
    )
    return query.to(dtype), kv_cache.to(dtype), metadata


def _run(backend, query, kv_cache, metadata, scale=0.3) -> torch.Tensor:  # noqa: ANN001
    output = torch.full_like(query, float("nan"))
    backend.forward(query, kv_cache, metadata, scale, output)
    return output


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128, 8, 96])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_the_torch_reference(
    head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(head_dim * num_heads)
    seq_lens = [1, 16, 17, 200, 5, 33]  # one token, exactly a block, a block and one, ...
    query, kv_cache, metadata = _decode_batch(seq_lens, num_heads, num_kv_heads, head_dim, dtype)
    expected = _run(TorchRefBackend(), query, kv_cache, metadata)
    got = _run(CpuBackend(KERNEL), query, kv_cache, metadata)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("block_size", [8, 24, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(12, 2, 80), (10, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_sizes_and_wide_groups(
    block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """The vector path reads a block as runs of up to 16 tokens and sums values for up to four
    heads of a group at a time: blocks shorter, longer and not a multiple of 16, groups of 5
    and 6 (a partial head tile), head_dim 80 (16 columns past the 64-column tiles; bf16 keys
    widened, not the dot-product instruction)."""
    seq_lens = [1, block_size, block_size + 1, 150, 31]
    query, kv_cache, metadata = _decode_batch(
        seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size)
    expected = _run(TorchRefBackend(), query, kv_cache, metadata)
    got = _run(CpuBackend(KERNEL), query, kv_cache, metadata)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("spread", [0.0, 40.0])
def test_softmax_of_equal_and_far_apart_scores(spread: float) -> None:
    """fp32 softmax rows of every length mod 16 (its 16-lane steps end masked): keys all equal
    (uniform weights), and scores hundreds apart, where the inline e^x of the smaller ones
    falls below fp32's normal range and clamps at e^-100 (their weights are 0 to fp32). The
    reference runs in fp64: a score of hundreds carries fp32 rounding of ~1e-5, a relative
    error of each weight, which both the torch reference in fp32 and the kernel show (2e-5 seen
    in either), so those rows are held to 1e-4."""
    seq_lens = list(range(1, 34))
    query, kv_cache, metadata = _decode_batch(seq_lens, 9, 3, 64, torch.float32)
    kv_cache[0] = kv_cache[0] * spread if spread else 1.0
    expected = _run(TorchRefBackend(), query.double(), kv_cache.double(), metadata).float()
    got = _run(CpuBackend(KERNEL), query, kv_cache, metadata)
    tol = 1e-4 if spread else 1e-5
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def _cpu_has(flag: str) -> bool:
    return f" {flag} " in cpu_native._cpu_flags() + " "


@needs_kernel
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 -march names")
@pytest.mark.parametrize("march", ["x86-64-v3", "skylake-avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_builds_for_other_cpus(
    march: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, tmp_path  # noqa: ANN001
) -> None:
    """The kernel built without AVX512 (the plain-C loops) and with AVX512 but no AVX512-BF16
    (bf16 keys widened in registers) gives the torch reference's result too."""
    if march == "skylake-avx512" and not _cpu_has("avx512bw"):
        pytest.skip("this CPU cannot run AVX512 code")
    flags = [f"-march={march}" if f == "-march=native" else f for f in cpu_native.COMPILE_FLAGS]
    monkeypatch.setattr(cpu_native, "COMPILE_FLAGS", flags)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel = cpu_native.PagedDecodeKernel(cpu_native.built_library(cpu_native.SOURCE))
    query, kv_cache, metadata = _decode_batch([1, 16, 17, 90], 9, 3, 64, dtype)
    expected = _run(TorchRefBackend(), query, kv_cache, metadata)
    got = _run(CpuBackend(kernel), query, kv_cache, metadata)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@needs_kernel
def test_threads_and_strided_query_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Query rows that are a column slice of a wider tensor (as after splitting a fused QKV
    projection) and several threads sharing the requests give the same result."""
    query, kv_cache, metadata = _decode_batch([40, 3, 77, 16, 120], 6, 2, 64, torch.float32)
    expected = _run(TorchRefBackend(), query, kv_cache, metadata)
    wide = torch.randn(query.shape[0], 10, 64)
    wide[:, 2:8] = query
    strided = wide[:, 2:8]  # row stride 640, heads packed
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    got = _run(CpuBackend(KERNEL), strided, kv_cache, metadata)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_fp16_takes_the_torch_path() -> None:
    """fp16 has no kernel copy: the backend hands it to the torch path (same result)."""
    query, kv_cache, metadata = _decode_batch([30, 7], 4, 2, 64, torch.float32)
    for dtype in (torch.float32, torch.float16):
        q, kv = query.to(dtype), kv_cache.to(dtype)
        expected = _run(TorchRefBackend(), q, kv, metadata)
        torch.testing.assert_close(_run(CpuBackend(KERNEL), q, kv, metadata), expected)


@needs_kernel
def test_loading_the_kernel_keeps_subnormal_floats() -> None:
    """Built with -ffast-math, the library must not carry crtfastmath's constructor, which
    sets flush-to-zero for the whole process on load (found by hypothesis in the server fuzz
    test: 'we can't represent subnormal floats right now'). A fresh process loads it."""
    code = (
        "import torch; from pagedserve.attention.backends.cpu_native import "
        "load_paged_decode_kernel as load; assert load() is not None; "
        "print(float(torch.tensor([1e-40]) * 1.0))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) > 0.0, "subnormal floats were flushed to zero"


@needs_kernel
def test_kernel_refuses_mismatched_arguments() -> None:
    query, kv_cache, metadata = _decode_batch([5, 9], 4, 2, 64, torch.float32)
    rows = torch.arange(2)
    table, lens = metadata.block_table, metadata.seq_lens
    out = torch.empty_like(query)
    with pytest.raises(ValueError, match="dtypes"):
        KERNEL(query, kv_cache.bfloat16(), rows, table, lens, 1.0, out)
    with pytest.raises(ValueError, match="int64/int32/int32"):
        KERNEL(query, kv_cache, rows.int(), table, lens, 1.0, out)
    with pytest.raises(ValueError, match="one contiguous row per request"):
        KERNEL(query, kv_cache, rows, table[:1], lens, 1.0, out)
    with pytest.raises(ValueError, match="does not fit"):
        KERNEL(query[:, :3], kv_cache, rows, table, lens, 1.0, out[:, :3])


def test_no_compiler_keeps_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture  # noqa: ANN001
) -> None:
    """A compiler that fails: no kernel, one warning naming the reason, the torch backend."""
    from pagedserve.platform.cpu import CpuPlatform

    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_native.load_paged_decode_kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            backend = CpuPlatform(torch.device("cpu")).attention_backend()
        assert isinstance(backend, TorchRefBackend) and not isinstance(backend, CpuBackend)
        assert "false failed" in caplog.text
    finally:
        cpu_native.load_paged_decode_kernel.cache_clear()


def test_library_name_follows_the_cpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path  # noqa: ANN001
) -> None:
    """-march=native code is only reused on a CPU with the same feature flags."""
    monkeypatch.setattr(cpu_native, "_compiler_version", lambda cc: "cc 1.0")
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: "flags: avx2")
    first = cpu_native.library_path("cc", tmp_path)
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: "flags: avx2 avx512f")
    assert cpu_native.library_path("cc", tmp_path) != first
