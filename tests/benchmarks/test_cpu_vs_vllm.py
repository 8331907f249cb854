"""benchmarks/cpu_vs_vllm.py on the CPU: the threads each engine's child gets."""

from __future__ import annotations

import os

import pytest

from tests.benchmarks.script_loader import loaded_script


def test_equal_threads_pin_both_engines() -> None:
    with loaded_script("cpu_vs_vllm") as cvv:
        ours, theirs = cvv.child_env("pagedserve", 1), cvv.child_env("vllm", 1)
    assert ours["OMP_NUM_THREADS"] == theirs["OMP_NUM_THREADS"] == "1"
    assert theirs["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))


def test_own_threads_leave_pagedserve_to_its_rule() -> None:
    cores = len(os.sched_getaffinity(0))
    with loaded_script("cpu_vs_vllm") as cvv:
        ours = cvv.child_env("pagedserve", cores, own_threads=True)
        theirs = cvv.child_env("vllm", cores, own_threads=True)
    assert "OMP_NUM_THREADS" not in ours
    assert theirs["OMP_NUM_THREADS"] == str(cores)
    assert len(theirs["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == cores


def test_own_threads_refuses_a_thread_count(monkeypatch) -> None:
    with loaded_script("cpu_vs_vllm") as cvv:
        monkeypatch.setattr("sys.argv", ["cpu_vs_vllm.py", "--own-threads", "--threads", "1"])
        with pytest.raises(SystemExit):
            cvv.parse_args()
        monkeypatch.setattr("sys.argv", ["cpu_vs_vllm.py", "--own-threads"])
        assert cvv.parse_args().own_threads
