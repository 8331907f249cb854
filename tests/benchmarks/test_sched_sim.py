"""benchmarks/sched_sim.py: the real scheduler over a small fixed-length workload that the
cache cannot hold at full length, under each admission policy."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.benchmarks.script_loader import loaded_script


@pytest.fixture(scope="module")
def sim() -> Iterator[ModuleType]:
    with loaded_script("sched_sim") as module:
        yield module


def workload(policy: str, sync: bool = False) -> argparse.Namespace:
    # 8 requests of 16 + 16 tokens on 24 usable blocks of 4: 3 fit at their full 8 blocks.
    return argparse.Namespace(
        num_prompts=8,
        input_len=16,
        output_len=16,
        block_size=4,
        num_blocks=25,
        max_model_len=64,
        max_num_batched_tokens=64,
        admission_policy=policy,
        admission_ratio_init=0.7,
        admission_ratio_min=0.1,
        admission_ratio_decay_steps=600,
        sync=sync,
    )


@pytest.mark.parametrize("sync", [False, True])
def test_reserve_never_preempts_where_greedy_does(sim: ModuleType, sync: bool) -> None:
    reserve = sim.simulate(workload("reserve", sync), max_num_seqs=8)
    greedy = sim.simulate(workload("greedy", sync), max_num_seqs=8)
    assert (reserve.preemptions, reserve.recomputed_tokens, reserve.peak_running) == (0, 0, 3)
    assert greedy.preemptions > 0 and greedy.recomputed_tokens > 0
    assert greedy.peak_running > 3
    # Each request decodes its 15 tokens after the prefill step that samples its first.
    assert reserve.mean_decode_batch <= 3


def test_table_has_one_row_per_run(sim: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    sim.print_table([sim.simulate(workload("ratio"), n) for n in (2, 8)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 2 | ratio |")
