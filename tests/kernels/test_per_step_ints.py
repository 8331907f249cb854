"""Integer arguments that change from step to step are not specialized (see the note in
pagedserve/kernels/__init__.py): Triton would otherwise compile a new variant of the kernel the
first time such a value is 1 or a multiple of 16, stalling a running engine (measured on an
H200: 1.03 s for the attention kernel in the first step of a 256-request run)."""

from __future__ import annotations

import pytest
from kernel_device import ON_GPU
from triton.runtime.jit import JITFunction

from pagedserve.kernels import input_prep, paged_attention, paged_attention_split

# These read the interpreter's kernel objects (the same check on the card's would need its own).
pytestmark = pytest.mark.skipif(ON_GPU, reason="written for the interpreter's kernel objects")

PER_STEP_INTS = [
    (paged_attention._paged_attention_kernel, "num_reqs"),
    (input_prep._prepare_pos_seq_lens_kernel, "num_reqs"),
    (input_prep._compute_slot_mappings_kernel, "num_reqs"),
    (input_prep._compute_slot_mappings_kernel, "num_tokens_padded"),
    (paged_attention_split._split_kv_kernel, "num_splits"),
    (paged_attention_split._reduce_splits_kernel, "num_splits"),
]


@pytest.mark.parametrize(("kernel", "arg"), PER_STEP_INTS,
                         ids=[f"{k.fn.__name__}.{a}" for k, a in PER_STEP_INTS])
def test_per_step_int_is_not_specialized(kernel, arg: str) -> None:  # noqa: ANN001
    params = {p.name: p for p in JITFunction(kernel.fn, **kernel.kwargs).params}
    assert not params[arg].is_constexpr
    assert params[arg].do_not_specialize, f"{kernel.fn.__name__}: {arg} would be specialized"
