"""The start-up heap is frozen out of the garbage collector's walks."""

from __future__ import annotations

import gc
import weakref

import pytest

from pagedserve.engine.core import EngineCore
from pagedserve.engine.gc_heap import startup_gc_paused
from pagedserve.entrypoints.llm import LLM


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    gc.enable()
    yield
    gc.unfreeze()
    gc.enable()


def test_pause_ends_with_the_collector_on_and_start_up_frozen(unfrozen):
    with pytest.raises(ValueError, match="start-up failed"), startup_gc_paused():
        assert not gc.isenabled()
        built = [object() for _ in range(3)] + [[]]  # a list: tracked by the collector
        raise ValueError("start-up failed")
    assert gc.isenabled()
    assert gc.get_freeze_count() > 0
    assert not any(o is built[-1] for o in gc.get_objects())


def test_an_inner_pause_leaves_the_outer_one_paused(unfrozen):
    with startup_gc_paused():
        with startup_gc_paused():
            pass
        assert not gc.isenabled()  # the outer start-up goes on without collections
    assert gc.isenabled()


def test_a_pause_keeps_a_collector_the_caller_turned_off(unfrozen):
    gc.disable()
    with startup_gc_paused():
        pass
    assert not gc.isenabled()


def test_the_engine_freezes_what_its_start_up_built(unfrozen, checkpoints):
    folder, _, _ = checkpoints("llama")
    llm = LLM(model=str(folder), dtype="float32", max_model_len=64, num_gpu_blocks_override=16,
              max_num_seqs=2, skip_tokenizer_init=True)
    core = llm.engine_core
    assert isinstance(core, EngineCore)
    tracked = {id(o) for o in gc.get_objects()}
    # The scheduler and the runner's per-request state were built in start-up: frozen.
    assert id(core.scheduler) not in tracked and id(core.scheduler.waiting) not in tracked
    assert id(core.model_runner.states) not in tracked


def test_the_engine_collects_start_up_garbage_before_freezing(unfrozen, checkpoints):
    class Cycle:
        pass

    garbage = Cycle()
    garbage.me = garbage  # a reference cycle: only the collector frees it
    probe = weakref.ref(garbage)
    gc.disable()  # as under the CLI's start-up pause: only the engine's own collection runs
    del garbage
    folder, _, _ = checkpoints("llama")
    LLM(model=str(folder), dtype="float32", max_model_len=64, num_gpu_blocks_override=16,
        max_num_seqs=2, skip_tokenizer_init=True)
    assert probe() is None


def test_dropping_the_engine_unfreezes_so_its_cycles_can_be_freed(unfrozen, checkpoints):
    class Cycle:
        pass

    folder, _, _ = checkpoints("llama")
    llm = LLM(model=str(folder), dtype="float32", max_model_len=64, num_gpu_blocks_override=16,
              max_num_seqs=2, skip_tokenizer_init=True)
    cycle = Cycle()
    cycle.me = cycle  # a reference cycle held by the engine, frozen as start-up's would be
    llm.engine_core.leftover = cycle
    gc.freeze()
    probe = weakref.ref(cycle)
    del cycle
    del llm
    assert gc.get_freeze_count() == 0  # the engine went by refcounting: everything unfrozen
    gc.collect()
    assert probe() is None  # a frozen cycle would have stayed
