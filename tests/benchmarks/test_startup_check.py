"""The CPU-side parts of benchmarks/startup_check.py: arguments, the record collector, the
token comparison and the memory verdicts (the script itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import logging
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
