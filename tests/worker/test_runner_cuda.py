"""The runner on CUDA: Triton input prep and attention, the profile run that sizes the KV
cache (and captures the PIECEWISE graphs the steps then replay), the side-stream output copy;
greedy tokens equal transformers' (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.worker import kv_cache
from pagedserve.worker.model_runner import ModelRunner
from tests.worker.conftest import TINY_LLAMA
from tests.worker.hand_plans import HandScheduler, hf_greedy, random_prompt, run_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BLOCK_SIZE = 16


def _cuda_runner(model_dir: Path) -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.5),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        device="cuda",
    )
    runner = ModelRunner(config, torch.device("cuda"))
    runner.load_model()
    return runner


def test_cuda_runner_sizes_its_cache_and_matches_hf_greedy(
    tiny_llama_dir: Path, hf_tiny_llama: LlamaForCausalLM
) -> None:
    runner = _cuda_runner(tiny_llama_dir)
    assert (runner.ops.name, runner.attn_backend.name) == ("triton", "triton")
    num_blocks = runner.determine_num_blocks()  # profile run; the tiny model hits the cap
    assert num_blocks == kv_cache.max_useful_blocks(8, TINY_LLAMA["max_position_embeddings"],
                                                    BLOCK_SIZE)
    # Profiling captured every PIECEWISE size its temporary cache holds (16 usable blocks of
    # 16 tokens: the budget of 256), and probed the FULL graphs without keeping them.
    assert runner.graphs.captured_sizes() == {"FULL": [],
                                              "PIECEWISE": [256, 192, 128, 64, 32, 16, 8, 4, 2]}
    assert runner.graphs.memory.full_estimate is not None
    runner.initialize_kv_cache(num_blocks)
    prompts = {r: random_prompt(n, i, TINY_LLAMA["vocab_size"])
               for i, (r, n) in enumerate((("A", 70), ("B", 23), ("C", 140)))}
    sched, outputs = HandScheduler(BLOCK_SIZE), {}
    run_step(runner, sched.step(new=[("A", prompts["A"], 40), ("B", prompts["B"], 23),
                                     ("C", prompts["C"], 100)]), outputs)
    run_step(runner, sched.step(running=[("A", 30), ("B", 1), ("C", 40)]), outputs)
    for _ in range(6):
        run_step(runner, sched.step(running=[("A", 1), ("B", 1), ("C", 1)]), outputs)
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == hf_greedy(hf_tiny_llama, prompt, len(outputs[req_id]))
    assert [len(outputs[r]) for r in "ABC"] == [7, 8, 7]


def test_cuda_steps_never_wait_for_the_device(tiny_llama_dir: Path) -> None:
    """execute_model and sample_tokens_async make no device-to-host sync; get_output is the
    only wait (torch raises on any synchronizing call in sync-debug mode "error")."""
    runner = _cuda_runner(tiny_llama_dir)
    runner.initialize_kv_cache(64)
    prompts = [random_prompt(n, 10 + n, TINY_LLAMA["vocab_size"]) for n in (30, 5)]
    sched = HandScheduler(BLOCK_SIZE)
    plans = [
        lambda: sched.step(new=[("A", prompts[0], 20)]),
        lambda: sched.step(new=[("B", prompts[1], 5)], running=[("A", 10)]),
        lambda: sched.step(running=[("A", 1), ("B", 1)]),
    ]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the detector works: .item() waits for the device
            torch.ones(1, device="cuda").item()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for make_plan in plans:
        plan = make_plan()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner.execute_model(plan)
            pending = runner.sample_tokens_async()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len(pending.get_output().req_ids) == len(plan.num_scheduled_tokens)
