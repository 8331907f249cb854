"""The CPU-side parts of benchmarks/startup_check.py: arguments, the record collector, the
token comparison, the memory verdicts and the Triton compile records (the script itself needs a
GPU)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from pagedserve.compilation.phase_log import log_phase

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "startup_check.py"


@pytest.fixture(scope="module")
def check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("startup_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments(check: ModuleType) -> None:
    args = check.parse_args(["--out", "/tmp/x", "--timeouts", "100,60,40"])
    assert args.timeouts == {"cold": 100.0, "warm": 60.0, "eager": 40.0}
    assert args.child is None and args.gpu_memory_utilization == 0.9
    for bad in (["--timeouts", "1,2"], ["--gpu-memory-utilization", "1.5"], ["--child", "fast"]):
        with pytest.raises(SystemExit):
            check.parse_args(bad)


def test_collector_keeps_phases_engine_lines_and_the_budget(check: ModuleType) -> None:
    collector = check.PhaseCollector()
    logger = logging.getLogger("pagedserve.test_collector")
    logger.addHandler(collector)
    logger.setLevel(logging.INFO)
    try:
        log_phase(logger, "compile", 3.25, "detail", aot_hits=33)
        logger.info("engine start-up: %s took %.2f s", "load model", 1.5)
        logger.info("KV cache budget", extra={"kv_budget": {"budget": 7}})
        logger.info("something else")
    finally:
        logger.removeHandler(collector)
    assert collector.phases == [{"phase": "compile", "seconds": 3.25, "aot_hits": 33},
                                {"phase": "engine: load model", "seconds": 1.5}]
    assert collector.kv_budget == {"budget": 7}


def test_logprobs_close_rule(check: ModuleType) -> None:
    a = {"tokens": [1, 2, 3], "top": [[1, 9], [2, 5], [3, 4]]}
    assert check.logprobs_close(a, a) == (True, -1)
    near_tie = {"tokens": [1, 5, 7], "top": [[1, 9], [5, 2], [7, 8]]}
    assert check.logprobs_close(a, near_tie) == (True, 1)
    apart = {"tokens": [1, 6, 7], "top": [[1, 9], [6, 8], [7, 8]]}
    assert check.logprobs_close(a, apart) == (False, 1)


def test_memory_verdicts(check: ModuleType) -> None:
    gib = 2**30
    fast = {"card_bytes": 100 * gib, "memory_baseline_bytes": gib // 2,
            "free_after_start_bytes": 12 * gib, "free_at_largest_step_bytes": 9 * gib,
            "graphs": {"estimate_bytes": 3 * 2**20, "actual_bytes": 2**20}}
    verdict = check.memory_checks(fast, util=0.9, tolerance=gib // 4)
    assert verdict["free_after_start_ok"] is True
    assert verdict["free_at_largest_step_ok"] is False  # 9 GiB < 10 - 0.5 - 0.25 GiB
    assert verdict["margin_at_largest_step_gib"] == -0.25
    assert verdict["card_wide_margin_at_largest_step_gib"] == -1.0
    assert verdict["graph_estimate_minus_actual_mib"] == 2.0


def test_divergence_margins(check: ModuleType) -> None:
    a = {"tokens": [1, 2], "top": [[1, 9], [2, 5, 8]], "lp": [[-0.5, -1.0], [-1.0, -1.02, -3.0]]}
    b = {"tokens": [1, 5], "top": [[1, 9], [5, 2, 4]], "lp": [[-0.5, -1.0], [-0.9, -0.95, -2.5]]}
    assert check.divergence_margins(a, b, 1) == {"a": 0.02, "a_bound": False,
                                                 "b": 0.05, "b_bound": False}
    c = {"tokens": [1, 7], "top": [[1, 9], [7, 4, 6]], "lp": [[-0.5, -1.0], [-0.2, -0.6, -0.7]]}
    # neither top-3 holds the other's token: each margin is a lower bound (top-1 minus 3rd)
    assert check.divergence_margins(a, c, 1) == {"a": 2.0, "a_bound": True,
                                                 "b": 0.5, "b_bound": True}


_LISTEN = """
import importlib.util, json, sys, torch, triton
spec = importlib.util.spec_from_file_location("startup_check", sys.argv[1])
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
from pagedserve.kernels.attention_ptx import compile_attention
from pagedserve.kernels.paged_attention import KeyLoopLaunch
compiles = check.TritonCompiles()
triton.knobs.compilation.listener = compiles
for _ in range(2):  # compiled, then found in the cache
    compile_attention("decode", torch.bfloat16, KeyLoopLaunch(tile_n=64, num_stages=1))
print(json.dumps(compiles.summary()))
"""


def test_triton_compiles_are_counted_with_cache_hits_apart(tmp_path: Path) -> None:
    # Compiled for sm_90 on the CPU, so not under the interpreter; a fresh cache.
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(SCRIPT.parents[1])}
    done = subprocess.run([sys.executable, "-c", _LISTEN, str(SCRIPT)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["compiled"] == 1 and summary["cache_hits"] == 1
    assert list(summary["by_kernel"]) == ["_split_kv_kernel"]
    assert summary["by_kernel"]["_split_kv_kernel"]["variants"] == 1
    assert 0 < summary["compile_seconds"] <= summary["last_done_at_s"]
