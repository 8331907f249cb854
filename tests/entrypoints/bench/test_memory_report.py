"""memory_report on a CPU engine: the KV cache's bytes, no baseline, no graphs."""

from __future__ import annotations

import torch

from pagedserve import LLM
from pagedserve.entrypoints.bench.memory_report import free_at_largest_step, memory_report
from tests.engine.tiny_models import save_checkpoint


def test_memory_report_on_the_cpu(tmp_path) -> None:
    folder, _, _ = save_checkpoint("llama", tmp_path)
    llm = LLM(model=str(folder), dtype="float32", max_model_len=64, num_gpu_blocks_override=8,
              block_size=16, skip_tokenizer_init=True, device="cpu", enforce_eager=True)
    report = memory_report(llm)
    caches = llm.engine_core.model_runner.kv_caches.values()
    assert report["kv_cache_bytes"] == sum(t.numel() * t.element_size() for t in caches) > 0
    assert report["memory_baseline_bytes"] == 0 and report["graphs"] == {}
    if not torch.cuda.is_available():
        assert free_at_largest_step(llm) is None
