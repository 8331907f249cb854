"""TritonBackend (rope_and_write_kv + forward) against the dense reference and TorchRefBackend.

The step's keys go in through ``rope_and_write_kv`` with cos = 1, sin = 0: a rotation that
leaves every value exactly as it is, so the cases keep their unrotated keys. On a CUDA
machine with ``TRITON_INTERPRET=0`` the batches live on the GPU and the kernels compile for it;
in CI they run on the CPU under the interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_device import DEVICE
from paged_kv_cases import SENTINEL, dense_causal_attention, make_paged_batch

from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.attention.backends.triton import (
    FEW_PAIRS_LAUNCH,
    PREFILL_LAUNCH,
    SPLIT_KV_LAUNCH,
    TritonBackend,
    choose_num_splits,
    decode_launch,
    decodes_apart,
    prefill_launch,
)

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _run(backend, batch, kv_cache: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_and_write_kv (identity rotation) then forward on ``kv_cache``; returns (output,
    cache)."""
    num_tokens, _, head_dim = batch.query.shape
    half = torch.ones(num_tokens, head_dim // 2, dtype=batch.query.dtype, device=batch.query.device)
    cos_sin = torch.cat([half, torch.zeros_like(half)], dim=-1)  # [T, D]: cos 1, sin 0
    query = backend.rope_and_write_kv(
        batch.query.flatten(1), batch.new_keys.flatten(1), batch.new_values.flatten(1), cos_sin,
        kv_cache, batch.metadata.slot_mapping,
    )  # fmt: skip
    assert torch.equal(query, batch.query.flatten(1))
    output = torch.full_like(batch.query, SENTINEL)
    backend.forward(query.view(batch.query.shape), kv_cache, batch.metadata, scale, output)
    return output, kv_cache


def _check_against_oracles(backend: TritonBackend, batch, scale: float) -> None:
    # Unowned cache entries hold NaN for the Triton kernels (reading one would show). The torch
    # reference multiplies masked-out entries by a zero weight, so it gets finite filler.
    output, kv_cache = _run(backend, batch, batch.kv_cache.clone(), scale)
    ref_cache = batch.kv_cache.nan_to_num(SENTINEL)
    ref_output, ref_cache = _run(TorchRefBackend(), batch, ref_cache, scale)
    num_tokens = batch.metadata.num_actual_tokens
    tol = TOLERANCE[batch.query.dtype]
    assert torch.equal(kv_cache.nan_to_num(SENTINEL), ref_cache.nan_to_num(SENTINEL))
    expected = dense_causal_attention(batch, scale)
    torch.testing.assert_close(output[:num_tokens].float(), expected, **tol)
    torch.testing.assert_close(output[:num_tokens], ref_output[:num_tokens], **tol)
    assert (output[num_tokens:] == SENTINEL).all(), "padding rows were written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_takes_the_split_kv_path(dtype: torch.dtype) -> None:
    backend = TritonBackend(target_programs=64, min_keys_per_split=16)
    batch = make_paged_batch([1, 1], [97, 200], 4, 1, 128, 8, dtype, device=DEVICE)
    meta = batch.metadata
    assert choose_num_splits(meta.num_reqs, 1, meta.max_seq_len, 64, 16) == 8
    _check_against_oracles(backend, batch, 128**-0.5)


def test_mixed_batch_runs_the_varlen_kernel() -> None:
    backend = TritonBackend(target_programs=64, min_keys_per_split=16)
    batch = make_paged_batch([1, 12, 5], [60, 4, 0], 8, 2, 64, 16, torch.float32, device=DEVICE)
    _check_against_oracles(backend, batch, 0.125)


def _spy_kernels(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(kernel, num_reqs) of each attention launch the backend makes from now on."""
    from pagedserve.attention.backends import triton as backend_module

    calls: list[tuple[str, int]] = []

    def spy(name: str, kernel):
        def run(*args, **kwargs):
            calls.append((name, args[5]))  # num_reqs
            return kernel(*args, **kwargs)
        return run

    monkeypatch.setattr(backend_module, "paged_attention_split_kv",
                        spy("split_kv", backend_module.paged_attention_split_kv))
    monkeypatch.setattr(backend_module, "paged_attention",
                        spy("varlen", backend_module.paged_attention))
    return calls


# 9 decodes, then prompt chunks of 3 and 2 rows: with 4-row query blocks (the longest query of
# 3 rows x 4 heads a kv head: 16-row tiles), the decode rows end inside block 2.
MIXED_QUERY_LENS = [1] * 9 + [3, 2]
MIXED_CONTEXT_LENS = [70, 3, 33, 0, 120, 9, 1, 40, 64, 17, 0]


def test_over_an_fp8_cache_a_mixed_batchs_decodes_run_the_split_kv_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The leading one-row queries go to the split-KV kernel, the rest to the varlen kernel,
    whose programs start at the first prompt row: the FP8 launch's query blocks are 32 rows
    (128-row tiles of 4 heads), so 70 decode rows end inside block 2. The outputs are those of
    one varlen launch over every row (which ``test_fp8_kv_kernels`` holds to the reference)."""
    calls = _spy_kernels(monkeypatch)
    backend = TritonBackend(target_programs=64, min_keys_per_split=16)
    context_lens = [(7 * i) % 45 for i in range(70)] + [17, 0]
    batch = make_paged_batch([1] * 70 + [3, 2], context_lens, 8, 2, 64, 8, torch.bfloat16,
                             device=DEVICE)  # fmt: skip
    assert batch.metadata.num_decodes == 70
    apart, cache = _run(backend, batch, batch.kv_cache.to(torch.float8_e4m3fn), 0.125)
    assert calls == [("split_kv", 70), ("varlen", 2)]
    batch.metadata.num_decodes = 0
    together, _ = _run(backend, batch, cache, 0.125)  # rewrites the same keys
    assert calls[2:] == [("varlen", 72)]
    n = batch.metadata.num_actual_tokens
    torch.testing.assert_close(apart[:n], together[:n], atol=1e-2, rtol=1e-2)
    assert (apart[n:] == SENTINEL).all(), "padding rows were written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_over_a_cache_in_the_model_dtype_a_mixed_batch_is_one_varlen_launch(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    calls = _spy_kernels(monkeypatch)
    backend = TritonBackend(target_programs=64, min_keys_per_split=16)
    batch = make_paged_batch(MIXED_QUERY_LENS, MIXED_CONTEXT_LENS, 8, 2, 64, 8, dtype,
                             device=DEVICE)  # fmt: skip
    _check_against_oracles(backend, batch, 0.125)
    assert calls == [("varlen", 11)]


@pytest.mark.parametrize(
    ("num_decodes", "cache_dtype", "expected"),
    [(9, torch.float8_e4m3fn, 9), (9, torch.bfloat16, 0), (0, torch.float8_e4m3fn, 0)],
)
def test_decodes_apart(num_decodes: int, cache_dtype: torch.dtype, expected: int) -> None:
    assert decodes_apart(num_decodes, cache_dtype) == expected


@pytest.mark.parametrize(
    "num_reqs,num_kv_heads,max_seq_len,expected",
    [
        (1, 8, 1024, 8),  # batch-1 decode: 264 // 8 = 33 by occupancy, 1024 // 128 = 8 by length
        (1, 8, 100_000, 32),  # capped at 32 segments
        (4, 8, 1024, 8),  # 264 // 32 = 8
        (16, 8, 4096, 2),  # 264 // 128 = 2
        (64, 8, 4096, 1),  # the batch alone fills the GPU
        (1, 8, 200, 1),  # too short to split
        (1, 8, 383, 2),  # 383 // 128 = 2 -> a power of two
        (1, 4, 800, 4),  # 6 by length, rounded down to 4
    ],
)
def test_choose_num_splits(
    num_reqs: int, num_kv_heads: int, max_seq_len: int, expected: int
) -> None:
    assert choose_num_splits(num_reqs, num_kv_heads, max_seq_len, 264, 128) == expected


def test_forward_rejects_bad_inputs() -> None:
    backend = TritonBackend(target_programs=16)
    batch = make_paged_batch([2], [3], 4, 2, 64, 4, torch.float32, device=DEVICE)
    out = torch.empty_like(batch.query)
    with pytest.raises(ValueError, match="query"):
        backend.forward(batch.query[:, :3], batch.kv_cache, batch.metadata, 0.1, out[:, :3])
    with pytest.raises(ValueError, match="dtype"):
        backend.forward(batch.query.half(), batch.kv_cache, batch.metadata, 0.1, out.half())
    batch.metadata.causal = False
    with pytest.raises(ValueError, match="causal"):
        backend.forward(batch.query, batch.kv_cache, batch.metadata, 0.1, out)
    with pytest.raises(ValueError, match="min_keys_per_split"):
        TritonBackend(target_programs=16, min_keys_per_split=0)


@pytest.mark.parametrize(
    "target_programs,min_keys_per_split",
    [(4, 10_000), (64, 10_000)],  # one segment: pairs above the target programs, below it
)  # fmt: skip
def test_unsplit_decode_batch_runs_the_split_kv_kernel(
    monkeypatch: pytest.MonkeyPatch, target_programs: int, min_keys_per_split: int
) -> None:
    """A decode batch of one segment per (request, kv head) pair runs the split-KV kernel
    too, whether its pairs fill the target programs or not."""
    def no_varlen(*args, **kwargs) -> None:
        raise AssertionError("the varlen kernel ran a decode batch")

    monkeypatch.setattr("pagedserve.attention.backends.triton.paged_attention", no_varlen)
    backend = TritonBackend(target_programs, min_keys_per_split)
    batch = make_paged_batch([1, 1, 1], [97, 20, 51], 4, 2, 64, 8, torch.float32, device=DEVICE)
    _check_against_oracles(backend, batch, 0.125)


@pytest.mark.parametrize(
    "num_splits,num_pairs,expected",
    [(2, 8, SPLIT_KV_LAUNCH), (1, 2048, SPLIT_KV_LAUNCH), (1, 512, FEW_PAIRS_LAUNCH),
     (1, 528, FEW_PAIRS_LAUNCH)],  # batch 256 / batch 64 / 66 of 8 kv heads on 132 SMs
)  # fmt: skip
def test_decode_launch(num_splits: int, num_pairs: int, expected) -> None:
    assert decode_launch(num_splits, num_pairs, 528, torch.bfloat16) is expected
    assert FEW_PAIRS_LAUNCH.tile_n == 64 and SPLIT_KV_LAUNCH.tile_n == 128


@pytest.mark.parametrize("num_splits,num_pairs", [(2, 8), (1, 2048), (1, 512)])
def test_an_fp8_cache_decodes_with_128_key_tiles(num_splits: int, num_pairs: int) -> None:
    assert decode_launch(num_splits, num_pairs, 528, torch.float8_e4m3fn) is SPLIT_KV_LAUNCH
    assert SPLIT_KV_LAUNCH.tile_n == 128


def test_an_fp8_cache_prefills_with_128_row_query_tiles() -> None:
    assert prefill_launch(torch.bfloat16) is PREFILL_LAUNCH
    assert prefill_launch(torch.float8_e4m3fn).block_m == 128


@pytest.mark.parametrize(
    "target_programs,min_keys_per_split",
    [(64, 16), (4, 10_000), (64, 10_000)],  # segments: several; one (128- / 64-key tiles)
)  # fmt: skip
def test_padded_requests_of_a_full_graph_write_nothing(
    target_programs: int, min_keys_per_split: int
) -> None:
    """FULL-graph padding appends requests with no query row (query_start_loc repeats, seq_len
    0); they must be skipped, leaving their rows and the padding rows untouched."""
    backend = TritonBackend(target_programs, min_keys_per_split)
    batch = make_paged_batch(
        [1, 1], [70, 33], 4, 2, 64, 8, torch.float32, num_padding=2, device=DEVICE
    )
    meta = batch.metadata
    meta.num_reqs = 4
    padding_qsl = torch.tensor([2, 2], dtype=torch.int32, device=DEVICE)
    meta.query_start_loc = torch.cat([meta.query_start_loc, padding_qsl])
    meta.seq_lens = torch.cat([meta.seq_lens, torch.zeros(2, dtype=torch.int32, device=DEVICE)])
    meta.block_table = torch.cat([meta.block_table, meta.block_table])
    output, _ = _run(backend, batch, batch.kv_cache.clone(), 0.125)
    meta.num_reqs = 2  # the dense reference reads only the real requests
    expected = dense_causal_attention(batch, 0.125)
    torch.testing.assert_close(output[:2], expected, **TOLERANCE[torch.float32])
    assert (output[2:] == SENTINEL).all()
