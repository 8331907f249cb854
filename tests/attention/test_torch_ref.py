"""torch_ref paged attention against dense causal attention computed from the full K/V.
The same cases run through the CPU backend (torch_ref with the native decode kernel).

Each case mixes requests: decodes (query_len 1), whole prompts (no cached prefix) and chunks
after a cached prefix, in shuffled non-contiguous blocks; the cached prefix is written
in an earlier call, the step's keys with padding rows (slot -1) that must write nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from pagedserve.attention.backends.base import PAD_SLOT_ID, AttentionMetadata
from pagedserve.attention.backends.cpu import CpuBackend
from pagedserve.attention.backends.cpu_native import load_paged_decode_kernel
from pagedserve.attention.backends.torch_ref import TorchRefBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 40
HEAD_DIM = 8


@dataclass
class Req:
    seq_len: int
    query_len: int
    blocks: list[int]
    keys: torch.Tensor  # [seq_len, Hkv, D], every position
    values: torch.Tensor  # [seq_len, Hkv, D]

    def slots(self, positions: range) -> list[int]:
        return [self.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def _make_reqs(shapes: list[tuple[int, int]], num_kv_heads: int, rng: random.Random) -> list[Req]:
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    reqs = []
    for seq_len, query_len in shapes:
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        kv = torch.randn(2, seq_len, num_kv_heads, HEAD_DIM)
        reqs.append(Req(seq_len, query_len, blocks, kv[0], kv[1]))
    return reqs


def _metadata(reqs: list[Req], num_padding: int, causal: bool) -> AttentionMetadata:
    starts = [0]
    for r in reqs:
        starts.append(starts[-1] + r.query_len)
    width = max(len(r.blocks) for r in reqs) + 1
    # Entries past a request's blocks must never be read: fill them with an invalid id.
    table = [r.blocks + [-1] * (width - len(r.blocks)) for r in reqs]
    slots = [s for r in reqs for s in r.slots(range(r.seq_len - r.query_len, r.seq_len))]
    return AttentionMetadata(
        num_reqs=len(reqs),
        num_actual_tokens=starts[-1],
        max_query_len=max(r.query_len for r in reqs),
        max_seq_len=max(r.seq_len for r in reqs),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([r.seq_len for r in reqs], dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [PAD_SLOT_ID] * num_padding, dtype=torch.int64),
        causal=causal,
    )


def _dense_reference(q: torch.Tensor, req: Req, scale: float, causal: bool) -> torch.Tensor:
    """q [query_len, Hq, D] at the last query_len positions -> [query_len, Hq, D], float64."""
    group = q.shape[1] // req.keys.shape[1]
    k = req.keys.double().repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
    v = req.values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal:
        q_pos = torch.arange(req.seq_len - req.query_len, req.seq_len)
        visible = torch.arange(req.seq_len)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.fixture(params=["torch_ref", "cpu"])
def make_backend(request: pytest.FixtureRequest):  # noqa: ANN201
    """A factory of the backend under test (a fresh one per call: plans are per backend)."""
    if request.param == "torch_ref":
        return TorchRefBackend
    kernel = load_paged_decode_kernel()
    if kernel is None:
        pytest.skip("no C compiler to build the CPU decode kernel")
    return lambda: CpuBackend(kernel)


SHAPES = {
    "decodes": [(9, 1), (1, 1), (17, 1)],
    "equal_decodes": [(9, 1), (9, 1), (9, 1)],  # no mask: keys cut at seq_len, mid-block
    "prefills": [(5, 5), (12, 12)],
    "mixed": [(9, 1), (14, 6), (3, 3), (1, 1), (20, 4), (8, 2)],
}


@pytest.mark.parametrize("shape_case", sorted(SHAPES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_dense_reference(
    shape_case: str, num_heads: int, num_kv_heads: int, causal: bool, make_backend
) -> None:
    rng = random.Random(f"{shape_case}-{num_heads}-{num_kv_heads}")
    torch.manual_seed(rng.randrange(1 << 30))
    reqs = _make_reqs(SHAPES[shape_case], num_kv_heads, rng)
    backend = make_backend()
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)

    # The cached prefixes, written by "earlier steps".
    prefix_slots = [s for r in reqs for s in r.slots(range(r.seq_len - r.query_len))]
    if prefix_slots:
        k = torch.cat([r.keys[: r.seq_len - r.query_len] for r in reqs])
        v = torch.cat([r.values[: r.seq_len - r.query_len] for r in reqs])
        backend.write_kv(k, v, kv_cache, torch.tensor(prefix_slots, dtype=torch.int64))

    # This step: its own keys plus 3 padding rows (garbage keys, slot -1).
    num_padding = 3
    metadata = _metadata(reqs, num_padding, causal)
    garbage = torch.full((num_padding, num_kv_heads, HEAD_DIM), 1e4)
    new_k = torch.cat([r.keys[r.seq_len - r.query_len :] for r in reqs] + [garbage])
    new_v = torch.cat([r.values[r.seq_len - r.query_len :] for r in reqs] + [garbage])
    before = kv_cache.clone()
    backend.write_kv(new_k, new_v, kv_cache, metadata.slot_mapping)
    changed = (kv_cache != before).flatten(1, 2).flatten(2).any(-1).any(0)  # bool [num slots]
    written = set(metadata.slot_mapping[: metadata.num_actual_tokens].tolist())
    assert set(changed.nonzero().flatten().tolist()) <= written, "a padding row wrote the cache"

    num_tokens = metadata.num_actual_tokens + num_padding
    query = torch.randn(num_tokens, num_heads, HEAD_DIM)
    output = torch.full((num_tokens, num_heads, HEAD_DIM), float("nan"))
    scale = HEAD_DIM**-0.5
    backend.forward(query, kv_cache, metadata, scale, output)

    start = 0
    for r in reqs:
        rows = slice(start, start + r.query_len)
        expected = _dense_reference(query[rows], r, scale, causal).float()
        torch.testing.assert_close(output[rows], expected, atol=1e-5, rtol=1e-5)
        start += r.query_len
    assert output[start:].isnan().all(), "padding rows must stay untouched"


def test_write_kv_rejects_mismatched_slot_mapping() -> None:
    kv_cache = torch.zeros(2, 4, BLOCK_SIZE, 1, HEAD_DIM)
    key = torch.zeros(3, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="slot_mapping: 2 entries for 3 key rows"):
        TorchRefBackend().write_kv(key, key, kv_cache, torch.tensor([0, 1]))


def test_host_copies_are_used_when_given() -> None:
    """The CPU copies of query_start_loc / seq_lens describe the batch when present."""
    reqs = _make_reqs([(6, 2)], 1, random.Random(0))
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 1, HEAD_DIM)
    slots = torch.tensor(reqs[0].slots(range(6)), dtype=torch.int64)
    TorchRefBackend().write_kv(reqs[0].keys, reqs[0].values, kv_cache, slots)
    metadata = _metadata(reqs, 0, True)
    metadata.query_start_loc_cpu = metadata.query_start_loc.clone()
    metadata.seq_lens_cpu = metadata.seq_lens.clone()
    metadata.query_start_loc = torch.full_like(metadata.query_start_loc, -7)  # must not be read
    query, output = torch.randn(2, 2, HEAD_DIM), torch.empty(2, 2, HEAD_DIM)
    TorchRefBackend().forward(query, kv_cache, metadata, 0.5, output)
    torch.testing.assert_close(output, _dense_reference(query, reqs[0], 0.5, True).float())


def _step(reqs: list[Req], kv_cache: torch.Tensor, num_heads: int, dtype: torch.dtype):
    """Write every request's keys, then return (metadata, query) for its last query_len rows."""
    backend = TorchRefBackend()
    for r in reqs:
        slots = torch.tensor(r.slots(range(r.seq_len)), dtype=torch.int64)
        backend.write_kv(r.keys.to(dtype), r.values.to(dtype), kv_cache, slots)
    metadata = _metadata(reqs, 0, True)
    query = torch.randn(metadata.num_actual_tokens, num_heads, HEAD_DIM).to(dtype)
    return metadata, query


def _expected(reqs: list[Req], query: torch.Tensor, scale: float) -> torch.Tensor:
    rows, start = [], 0
    for r in reqs:
        q = query[start : start + r.query_len].float()
        keys = Req(r.seq_len, r.query_len, r.blocks, r.keys.to(query.dtype), r.values.to(query.dtype))
        rows.append(_dense_reference(q, keys, scale, True).float())
        start += r.query_len
    return torch.cat(rows)


def test_one_backend_serves_successive_steps(make_backend) -> None:
    """The batch plan is built once per metadata object: a later step (a new object with a
    different layout) through the same backend must not reuse the earlier plan."""
    rng = random.Random(7)
    backend = make_backend()
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM)
    for shapes in ([(9, 1), (14, 6), (5, 1)], [(17, 1), (3, 3)], [(9, 1), (14, 6), (5, 1)]):
        reqs = _make_reqs(shapes, 2, rng)
        metadata, query = _step(reqs, kv_cache, 4, torch.float32)
        for _ in range(2):  # two layers of one step share the metadata
            output = torch.empty_like(query)
            backend.forward(query, kv_cache, metadata, 0.25, output)
            torch.testing.assert_close(output, _expected(reqs, query, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4)])
def test_bf16_matches_the_dense_reference(
    num_heads: int, num_kv_heads: int, make_backend
) -> None:
    """bf16 decodes (query heads as rows of their KV head) and prefills, within bf16 rounding."""
    torch.manual_seed(3)
    reqs = _make_reqs([(9, 1), (17, 1), (12, 12), (10, 3), (2, 1)], num_kv_heads, random.Random(3))
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype=torch.bfloat16)
    metadata, query = _step(reqs, kv_cache, num_heads, torch.bfloat16)
    output = torch.empty_like(query)
    make_backend().forward(query, kv_cache, metadata, HEAD_DIM**-0.5, output)
    expected = _expected(reqs, query, HEAD_DIM**-0.5)
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)
