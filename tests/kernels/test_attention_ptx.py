"""The FP8 decode kernel compiled for Hopper on the CPU (``kernels/attention_ptx.py``): widened in
registers, it reads its operands from shared memory as a bf16 cache's kernel does, with
``ldmatrix``, where Triton's default placement of the widening reads FP8 bytes one at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_COMPILE = """
import json, torch
from pagedserve.kernels.attention_ptx import compile_attention, ptx_counts
from pagedserve.kernels.paged_attention import KeyLoopLaunch
cases = {"bf16": (torch.bfloat16, False), "fp8": (torch.float8_e4m3fn, False),
         "fp8 widened": (torch.float8_e4m3fn, True)}
print(json.dumps({name: ptx_counts(compile_attention("decode", dtype, KeyLoopLaunch(
    tile_n=128, num_warps=4, num_stages=2, widen_in_registers=widen)))
    for name, (dtype, widen) in cases.items()}))
"""


def test_fp8_decode_tiles_widened_in_registers_are_read_with_ldmatrix() -> None:
    # Compiled, not interpreted: under TRITON_INTERPRET=1 the kernels are Python functions.
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.splitlines()[-1])
    bf16, fp8, widened = counts["bf16"], counts["fp8"], counts["fp8 widened"]
    assert bf16["ld.shared.b8"] == 0 and widened["ld.shared.b8"] == 0
    assert widened["ldmatrix"] == bf16["ldmatrix"] > 0
    assert widened["mma"] == bf16["mma"] > 0
    # Why the option exists; if a Triton release stages FP8 tiles well by itself, it may go.
    assert fp8["ld.shared.b8"] > 0 and fp8["ldmatrix"] < bf16["ldmatrix"]
