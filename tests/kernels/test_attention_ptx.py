"""The paged-attention decode kernel compiled for Hopper on the CPU (``kernels/attention_ptx.py``):
over a bf16 cache both dot operands come from shared memory through ``ldmatrix``; over an FP8
cache Triton widens the value tile after staging it, so that operand is read back one byte at a
time (``ld.shared.b8``; docs/gpu.md#attention-launches has what was tried against it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_COMPILE = """
import json, torch
from pagedserve.attention.backends.triton import SPLIT_KV_LAUNCH
from pagedserve.kernels.attention_ptx import compile_attention, ptx_counts
cases = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}  # the engine's decode launch
print(json.dumps({name: ptx_counts(compile_attention("decode", dtype, SPLIT_KV_LAUNCH))
                  for name, dtype in cases.items()}))
"""


def test_the_decode_kernel_reads_an_fp8_value_tile_a_byte_at_a_time() -> None:
    # Compiled, not interpreted: under TRITON_INTERPRET=1 the kernels are Python functions.
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.splitlines()[-1])
    bf16, fp8 = counts["bf16"], counts["fp8"]
    assert bf16["ld.shared.b8"] == 0 and bf16["ldmatrix"] > 0
    assert fp8["mma"] == bf16["mma"] > 0 and fp8["wgmma"] == 0
    # If a Triton release stages FP8 tiles for ldmatrix by itself, the docs' figures change.
    assert fp8["ld.shared.b8"] > 0 and fp8["ldmatrix"] < bf16["ldmatrix"]
    assert 0 < fp8["smem"] < bf16["smem"]
