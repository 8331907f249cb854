"""The CPU's prefill-attention kernel (cpu_native/paged_prefill.c) against the torch reference:
prompts from position 0, chunks after a cached prefix, decode rows in the same step, block
boundaries, GQA, threads."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.attention.backends import cpu_native
from pagedserve.attention.backends.base import AttentionMetadata
from pagedserve.attention.backends.cpu import CpuBackend
from pagedserve.attention.backends.cpu_native.prefill import SOURCE as PREFILL_SOURCE
from pagedserve.attention.backends.cpu_native.prefill import (
    PagedPrefillKernel,
    load_paged_prefill_kernel,
)
from pagedserve.attention.backends.torch_ref import TorchRefBackend
from tests.attention.avx2_build import built_for_avx2

DECODE, PREFILL = cpu_native.load_paged_decode_kernel(), load_paged_prefill_kernel()
pytestmark = pytest.mark.skipif(DECODE is None or PREFILL is None, reason="no C compiler")
BLOCK_SIZE = 16


def _step(
    requests: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """requests: (query_len, seq_len) each; random keys in shuffled blocks."""
    rng = random.Random(len(requests) * 31 + head_dim)
    width = max(-(-s // BLOCK_SIZE) for _, s in requests) + 1
    free = list(range(len(requests) * width + 2))
    rng.shuffle(free)
    table = []
    for _, seq_len in requests:
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        table.append(blocks + [-1] * (width - len(blocks)))  # past the end: never read
    kv_cache = torch.randn(2, len(requests) * width + 2, BLOCK_SIZE, num_kv_heads, head_dim)
    starts = [0]
    for query_len, _ in requests:
        starts.append(starts[-1] + query_len)
    metadata = AttentionMetadata(
        num_reqs=len(requests),
        num_actual_tokens=starts[-1],
        max_query_len=max(q for q, _ in requests),
        max_seq_len=max(s for _, s in requests),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in requests], dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
    )
    query = torch.randn(starts[-1], num_heads, head_dim)
    return query.to(dtype), kv_cache.to(dtype), metadata


def _run(backend, query, kv_cache, metadata) -> torch.Tensor:  # noqa: ANN001
    output = torch.full_like(query, float("nan"))
    backend.forward(query, kv_cache, metadata, 0.3, output)
    return output


STEPS = [
    [(128, 128)],  # one prompt, block-aligned
    [(17, 17), (1, 40), (33, 33), (5, 5)],  # prompts and a decode row
    [(20, 53), (16, 32), (1, 9), (70, 150)],  # chunks after a cached prefix
    [(2, 2), (64, 65), (65, 65)],  # the kernel's row chunks: 64
]


@pytest.mark.parametrize("requests", STEPS)
@pytest.mark.parametrize("head_dim", [64, 128, 8, 96])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_the_torch_reference(
    requests: list[tuple[int, int]], head_dim: int, num_heads: int, num_kv_heads: int,
    dtype: torch.dtype,
) -> None:
    query, kv_cache, metadata = _step(requests, num_heads, num_kv_heads, head_dim, dtype)
    ours = _run(CpuBackend(DECODE, PREFILL), query, kv_cache, metadata)  # type: ignore[arg-type]
    ref = _run(TorchRefBackend(), query.float(), kv_cache.float(), metadata)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_and_strided_query_rows(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    query, kv_cache, metadata = _step(STEPS[2], 9, 3, 64, torch.bfloat16)
    wide = torch.randn(query.shape[0], 13, 64).to(torch.bfloat16)
    wide[:, :9] = query
    ours = _run(CpuBackend(DECODE, PREFILL), wide[:, :9], kv_cache, metadata)  # type: ignore[arg-type]
    ref = _run(TorchRefBackend(), query.float(), kv_cache.float(), metadata)
    torch.testing.assert_close(ours.float(), ref, atol=2e-2, rtol=2e-2)


def test_without_the_kernel_prompts_run_sdpa() -> None:
    query, kv_cache, metadata = _step(STEPS[1], 4, 2, 32, torch.float32)
    ours = _run(CpuBackend(DECODE, None), query, kv_cache, metadata)  # type: ignore[arg-type]
    torch.testing.assert_close(ours, _run(TorchRefBackend(), query, kv_cache, metadata))


BLOCKS = [  # the kernel's blocks of 6 query vectors: short tails, prompts of several row chunks
    [(200, 300), (3, 3), (64, 130)],
    [(97, 97), (1, 20), (40, 40)],
]


@pytest.mark.parametrize("requests", BLOCKS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [
    (9, 3, 64), (8, 2, 64), (8, 2, 80), (16, 2, 128), (6, 6, 64), (16, 2, 96), (6, 3, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_blocks_match_the_torch_reference(
    requests: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype,
) -> None:
    """GQA groups of 1 to 8 against the 6 query vectors of a block (a block straddles rows),
    head sizes of the vector path (80: a half tile of key words; 96: 64 output columns, then
    16) and of the plain one (40).

    bf16: the kernel rounds the probabilities to bf16 for their products with the values, as
    GPU kernels do: each weight moves by at most 2^-9 relative (the normalizer sums the
    rounded weights), the size of the output's own rounding, which alone puts the reference
    up to ~1e-2 off here. So the elementwise tolerance stays the bf16 one, and the mean error
    must stay near the output rounding's (measured: 1.1-1.2 times it)."""
    query, kv_cache, metadata = _step(requests, num_heads, num_kv_heads, head_dim, dtype)
    ours = _run(CpuBackend(DECODE, PREFILL), query, kv_cache, metadata)  # type: ignore[arg-type]
    ref = _run(TorchRefBackend(), query.float(), kv_cache.float(), metadata)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(ours.float(), ref, atol=2e-2, rtol=2e-2)
    rounding = (ref.to(dtype).float() - ref).abs().mean()
    assert (ours.float() - ref).abs().mean() < 1.5 * rounding


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_give_the_same_bits(
    threads: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each output row is one task's, whichever thread runs it and whatever keys its buffers
    already held (a thread reuses the keys it packed for a request and KV head)."""
    query, kv_cache, metadata = _step(BLOCKS[0] + BLOCKS[1], 9, 3, 64, dtype)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = _run(CpuBackend(DECODE, PREFILL), query, kv_cache, metadata)  # type: ignore[arg-type]
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    many = _run(CpuBackend(DECODE, PREFILL), query, kv_cache, metadata)  # type: ignore[arg-type]
    assert torch.equal(one, many)


@pytest.fixture(scope="module")
def avx2_kernel(tmp_path_factory: pytest.TempPathFactory) -> PagedPrefillKernel:
    """The kernel built without AVX512 (x86-64-v3: AVX2 and FMA), once for the module."""
    return PagedPrefillKernel(built_for_avx2(PREFILL_SOURCE, tmp_path_factory.mktemp("avx2")))


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [
    (9, 3, 64), (8, 2, 128), (8, 1, 80), (6, 6, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plain_path_built_for_avx2(
    avx2_kernel: PagedPrefillKernel, num_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype,
) -> None:
    """Every head size takes the plain path there: groups of 1 to 8 heads (4 at a time),
    64-column value passes and their tails."""
    query, kv_cache, metadata = _step(BLOCKS[0], num_heads, num_kv_heads, head_dim, dtype)
    ours = _run(CpuBackend(DECODE, avx2_kernel), query, kv_cache, metadata)  # type: ignore[arg-type]
    ref = _run(TorchRefBackend(), query.float(), kv_cache.float(), metadata)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref, atol=tol, rtol=tol)
