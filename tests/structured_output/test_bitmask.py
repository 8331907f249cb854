"""The packed token bitmask: the torch op against a plain loop, and the Triton kernel (under
TRITON_INTERPRET=1 on the CPU) against the torch op."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedserve.platform import platform_for
from pagedserve.structured_output.bitmask import (
    GrammarBitmask,
    TokenBitmaskApplier,
    apply_token_bitmask,
    bitmask_width,
    unpack_bitmask,
)

VOCAB = 100  # not a multiple of 32: the last word is partly past the vocabulary


def _random_bitmask(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, bitmask_width(VOCAB))
    return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32)


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.to(torch.int64).tolist()
    for k, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (words[k][t // 32] >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_op_masks_only_the_constrained_rows(dtype):
    logits = torch.randn(5, VOCAB).to(dtype)
    bitmask = _random_bitmask(2, seed=1)
    rows = [3, 0]
    expected = _reference(logits, bitmask, rows)
    apply_token_bitmask(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, expected)
    assert unpack_bitmask(bitmask, VOCAB).shape == (2, VOCAB)


def test_grammar_bitmask_maps_request_ids_to_logits_rows():
    logits = torch.zeros(3, VOCAB)
    allow_7 = np.zeros((2, bitmask_width(VOCAB)), dtype=np.int32)
    allow_7[:, 0] = 1 << 7
    grammar = GrammarBitmask(["b", "gone"], allow_7)  # "gone" did not sample this step
    TokenBitmaskApplier(platform_for(torch.device("cpu")))(logits, grammar, ["a", "b", "c"])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [7]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="needs TRITON_INTERPRET=1 or a GPU")
def test_triton_kernel_matches_the_torch_op():
    from pagedserve.kernels.token_bitmask import apply_token_bitmask_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(6, VOCAB, device=device)
    bitmask = _random_bitmask(3, seed=2).to(device)
    rows = torch.tensor([5, 1, 2], device=device)
    expected = logits.clone()
    apply_token_bitmask(expected, bitmask, rows)
    apply_token_bitmask_triton(logits, bitmask, rows)
    assert torch.equal(logits, expected)


class _TritonHost:
    """A platform whose Triton kernels run on the host (the interpreter), without pinning."""

    pin_memory = False

    def has_triton_kernels(self) -> bool:
        return True


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs TRITON_INTERPRET=1")
def test_applier_takes_the_triton_kernel_where_the_platform_runs_triton():
    from pagedserve.kernels.token_bitmask import apply_token_bitmask_triton

    applier = TokenBitmaskApplier(_TritonHost())  # type: ignore[arg-type]
    assert applier.op is apply_token_bitmask_triton
    logits = torch.randn(3, VOCAB)
    expected = logits.clone()
    grammar = GrammarBitmask(["x", "y"], _random_bitmask(2, seed=4).numpy())
    TokenBitmaskApplier(platform_for(torch.device("cpu")))(expected, grammar, ["y", "z", "x"])
    applier(logits, grammar, ["y", "z", "x"])
    assert torch.equal(logits, expected) and torch.isfinite(logits[1]).all()
