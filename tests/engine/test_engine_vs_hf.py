"""The whole engine against transformers: greedy tokens of every request equal transformers'
greedy generation for that prompt alone, under chunked prefill (a 64-token step budget),
preemption (a KV pool far smaller than the batch needs) and prefix caching."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.core import EngineCore
from tests.engine.tiny_models import hf_greedy

MAX_TOKENS = 8
LENGTHS = [5, 300, 17, 260, 40, 220, 64, 180, 90, 150, 120, 33, 9, 275, 110, 71]
ENGINE_ARGS = dict(
    dtype="float32",
    max_num_batched_tokens=64,  # every prompt over 64 tokens is prefilled in chunks
    num_gpu_blocks_override=40,  # 16-token blocks: the 16 requests need ~150, one needs 20
    max_num_seqs=16,
    admission_policy="greedy",  # admit past what the pool holds: preemption is under test
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def mixed_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in LENGTHS]


def shared_prefix_prompts(vocab_size: int) -> list[list[int]]:
    """Eight prompts: one 200-token prefix, then distinct tails of 5 to 61 tokens."""
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab_size) for _ in range(200)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(5 + 8 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def hf_reference(checkpoints):
    """(arch, prompt set) -> transformers' greedy tokens per prompt, computed once."""
    cache: dict = {}

    def get(arch: str, prompts: list[list[int]]) -> list[list[int]]:
        key = (arch, tuple(map(tuple, prompts)))
        if key not in cache:
            _, model, _ = checkpoints(arch)
            cache[key] = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
        return cache[key]

    return get


def run_engine(folder, prompts, **overrides) -> tuple[list[list[int]], object]:
    llm = LLM(str(folder), **{**ENGINE_ARGS, **overrides})
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts  # input order
    stats = llm.engine_core.get_stats()
    assert stats.kv_cache_usage == 0.0  # every block came back
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_mixed_lengths_match_transformers(arch, checkpoints, hf_reference, prefix_caching):
    folder, _, tokenizer = checkpoints(arch)
    prompts = mixed_prompts(len(tokenizer))
    ours, stats = run_engine(folder, prompts, enable_prefix_caching=prefix_caching)
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert ours == hf_reference(arch, prompts)


def test_shared_prefixes_match_transformers(arch, checkpoints, hf_reference):
    folder, _, tokenizer = checkpoints(arch)
    prompts = shared_prefix_prompts(len(tokenizer))
    ours, stats = run_engine(folder, prompts, enable_prefix_caching=True)
    assert stats.prefix_cache_hits >= 7 * 192  # the 12 full prefix blocks, for 7 of 8 prompts
    assert ours == hf_reference(arch, prompts)


def test_async_scheduling_is_exact(arch, checkpoints, hf_reference, monkeypatch):
    """Step N+1 planned and launched before step N's tokens reach the host: the same tokens,
    under chunked prefill and preemption."""
    depths: list[int] = []
    launch = EngineCore._launch

    def spy(self):  # noqa: ANN001, ANN202
        depths.append(len(self._in_flight))
        return launch(self)

    monkeypatch.setattr(EngineCore, "_launch", spy)
    folder, _, tokenizer = checkpoints(arch)
    prompts = mixed_prompts(len(tokenizer))
    ours, stats = run_engine(folder, prompts, async_scheduling=True)
    assert max(depths) == 1, "no step was launched while another was in flight"
    assert stats.num_preemptions > 0
    assert ours == hf_reference(arch, prompts)
