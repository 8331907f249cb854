"""The paged-attention kernels compiled for Hopper (sm_90) without a GPU, and the shared-memory
instructions of their PTX counted: how a launch stages and reads its tiles
(``benchmarks/attention_ptx.py`` prints them per launch; a test pins the FP8 decode kernel's).

Arguments are specialized as the launcher does at run time (pointers and strides divisible by
16), so the code is the code the card runs; Triton's bundled ``ptxas`` assembles it. Not under
the interpreter: ``TRITON_INTERPRET=1`` makes the kernels Python functions.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedserve.kernels.attention_common import dot_precision, gpu_dot_dtype
from pagedserve.kernels.paged_attention import KeyLoopLaunch, _paged_attention_kernel
from pagedserve.kernels.paged_attention_split import _split_kv_kernel

HOPPER = GPUTarget("cuda", 90, 32)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
"""Llama-3-8B's attention: query heads, KV heads, head size; 16-token cache blocks."""
PATTERNS = {
    "ld.shared.b8": r"ld\.shared\.[bu]8\b",
    "ld.shared": r"ld\.shared\.(?![bu]8\b)",
    "st.shared": r"st\.shared\.",
    "ldmatrix": r"ldmatrix\.",
    "cp.async": r"cp\.async\.c[ag]\.",
    "mma": r"\bmma\.sync\.",
    "wgmma": r"wgmma\.mma_async\.",
}
"""Column -> the PTX instructions it counts."""
_PTX_TYPES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv"}


def _compile(kernel: Any, cache_dtype: torch.dtype, constants: dict[str, Any],
             launch: KeyLoopLaunch) -> Any:
    """``kernel`` compiled for sm_90 with ``constants``; every other argument typed from its
    name (the kernels name pointers ``*_ptr``)."""
    names = kernel.arg_names
    signature: dict[str, str] = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in ("key_cache_ptr", "value_cache_ptr"):
            signature[name] = "*" + _PTX_TYPES[cache_dtype]
        elif name in ("query_ptr", "output_ptr"):
            signature[name] = "*bf16"
        elif name.startswith("partial"):
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        else:
            signature[name] = "fp32" if name in ("qk_scale", "v_scale") else "i32"
    aligned = [n for n in names if signature[n].startswith("*") or n.startswith("stride")]
    source = ASTSource(
        fn=kernel, signature=signature,
        constexprs={(names.index(n),): value for n, value in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )  # fmt: skip
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    return triton.compile(source, target=HOPPER, options=options)


def compile_attention(kind: str, cache_dtype: torch.dtype, launch: KeyLoopLaunch) -> Any:
    """The decode (split-KV) or prefill (varlen) kernel as ``launch`` runs it over a cache of
    ``cache_dtype``, compiled for sm_90."""
    query = torch.empty(0, dtype=torch.bfloat16)
    cache = torch.empty(0, dtype=cache_dtype)
    dot_dtype = gpu_dot_dtype(query, cache)
    group = HEADS // KV_HEADS
    constants: dict[str, Any] = dict(
        GROUP=group, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM, BLOCK_SIZE=BLOCK,
        TILE_N=launch.tile(HEAD_DIM), DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision(dot_dtype), P_DTYPE=dot_dtype,
    )  # fmt: skip
    if kind == "decode":
        constants.update(NUM_HEADS=HEADS, BLOCK_M=16)
        return _compile(_split_kv_kernel, cache_dtype, constants, launch)
    constants.update(GROUP_PAD=group, BLOCK_M=launch.query_rows(1024, group))
    return _compile(_paged_attention_kernel, cache_dtype, constants, launch)


def ptx_counts(compiled: Any) -> dict[str, int]:
    """``PATTERNS``' instruction counts in the kernel's PTX, and its shared memory in bytes."""
    ptx = compiled.asm["ptx"]
    counts = Counter({column: len(re.findall(pattern, ptx)) for column, pattern in PATTERNS.items()})
    return {**counts, "smem": compiled.metadata.shared}
