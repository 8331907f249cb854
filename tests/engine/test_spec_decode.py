"""Speculative decoding end to end on a tiny random Llama (fp32, CPU): the tokens with drafts
are the tokens without, greedy and seeded, through chunked prefill, preemption, prefix caching,
stop strings, max_tokens inside an accepted run and n > 1; sampled first tokens of verify steps
follow the plain engine's distribution (chi-square).

A random model rarely repeats its prompt, so besides ngram a reference proposer drafts what the
plain engine generated, wrong at some positions: runs of every length are accepted and cut."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.spec_decode.proposer import DraftRequest, StatelessProposer

ENGINE = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=48, num_gpu_blocks_override=40,
              block_size=4, max_num_seqs=8, admission_policy="greedy")
"""A small pool (greedy admission: preemptions happen) and a small token budget (prompts are
chunked)."""
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "min_acceptance_rate": 0.0}
TEMPERATURE = 0.1
"""The tiny random model's logits are nearly flat: sharpened, its second token takes a few
values with frequencies a chi-square test can compare."""


class ReferenceProposer(StatelessProposer):
    """Drafts the continuation of a reference sequence the request's tokens start, with a wrong
    token wherever ``(num_tokens + j) % wrong_every == 0``."""

    def __init__(self, sequences: list[list[int]], wrong_every: int = 5) -> None:
        self.sequences = sequences
        self.wrong_every = wrong_every

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            n = len(r.token_ids)
            ref = next((s for s in self.sequences if s[:n] == r.token_ids), [])
            drafts = ref[n : n + r.max_drafts]
            out.append([t + 1 if (n + j) % self.wrong_every == 0 else t
                        for j, t in enumerate(drafts)])
        return out


@pytest.fixture(scope="module")
def engines(checkpoints):
    folder, _, tokenizer = checkpoints("llama")
    plain = LLM(str(folder), **ENGINE)
    spec = LLM(str(folder), **ENGINE, speculative_config=SPEC)
    return plain, spec, tokenizer


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(5)
    pattern = [rng.randrange(3, vocab_size) for _ in range(7)]
    shared = [rng.randrange(3, vocab_size) for _ in range(20)]
    return [
        pattern * 6,  # repeats itself: ngram drafts
        shared + [rng.randrange(3, vocab_size) for _ in range(9)],
        shared + [rng.randrange(3, vocab_size) for _ in range(3)],  # a prefix-cache hit
        [rng.randrange(3, vocab_size) for _ in range(60)],  # chunked
    ]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True, n=2),
        SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=17, logprobs=2,
                       ignore_eos=True),
    ]


def _generate(llm: LLM, prompts, params):  # type: ignore[no-untyped-def]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


def _logprobs(llm: LLM, prompts, params):  # type: ignore[no-untyped-def]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[{t: round(lp.logprob, 4) for t, lp in row.items()} for row in o.outputs[0].logprobs]
            for o in outputs]


@pytest.mark.parametrize("proposer", ["ngram", "reference"])
def test_tokens_equal_the_plain_engine(engines, proposer):
    plain, spec, tokenizer = engines
    prompts, params = _prompts(len(tokenizer)), _params()
    expected = _generate(plain, prompts, params)
    scheduler = spec.engine_core.scheduler
    before = scheduler.get_stats()
    if proposer == "reference":
        sequences = [p + c[0] for p, out in zip(prompts, expected, strict=True) for c in out]
        saved, scheduler.proposer = scheduler.proposer, ReferenceProposer(sequences)
    try:
        got = _generate(spec, prompts, params)
    finally:
        if proposer == "reference":
            scheduler.proposer = saved
    assert got == expected
    stats = scheduler.get_stats()
    assert stats.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens
    assert stats.num_preemptions > 0 or proposer == "ngram"
    if proposer == "reference":  # a run of every length was accepted
        assert all(n > 0 for n in stats.spec_decode_accepted_per_position)


def test_logprobs_and_stops_inside_accepted_runs(engines):
    plain, spec, tokenizer = engines
    prompts = _prompts(len(tokenizer))[:2]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reference = _generate(plain, prompts, greedy)
    sequences = [p + out[0][0] for p, out in zip(prompts, reference, strict=True)]
    # A stop string from the middle of the output, a stop token id, max_tokens mid-run.
    text = reference[0][0][1]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, stop=[text[len(text) // 2:][:3]]),
        SamplingParams(temperature=0.0, max_tokens=11, stop_token_ids=[reference[1][0][0][7]],
                       logprobs=3, ignore_eos=True),
    ]
    scheduler = spec.engine_core.scheduler
    saved, scheduler.proposer = scheduler.proposer, ReferenceProposer(sequences, wrong_every=9)
    try:
        got = _generate(spec, prompts, params)
        got_logprobs = _logprobs(spec, prompts[1:], params[1:])
    finally:
        scheduler.proposer = saved
    assert got == _generate(plain, prompts, params)
    assert got_logprobs == _logprobs(plain, prompts[1:], params[1:])


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty: the chi-square quantile at upper tail ~0.001 (z = 3.09)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def test_sampled_tokens_of_verify_steps_follow_the_target(checkpoints):
    """Every request drafts token ``t`` twice after its first token, so output indices 1 and 2
    come from one verify step (accepted drafts, a resample, the token after the run). The
    frequencies of those pairs with drafts and without, from disjoint seeds, must pass a
    chi-square test of one distribution. A verifier that accepted a rejected draft would
    condition index 2 on ``t`` where index 1 is not ``t``, and fail it."""
    folder, _, tokenizer = checkpoints("llama")
    config = dict(dtype="float32", max_model_len=64, max_num_seqs=256,
                  num_gpu_blocks_override=400, block_size=4)
    plain = LLM(str(folder), **config)
    spec = LLM(str(folder), **config, speculative_config={
        **SPEC, "disable_by_batch_size": 256, "num_speculative_tokens": 2})
    prompt = [{"prompt_token_ids": _prompts(len(tokenizer))[1]}]
    num = 240

    def pairs(llm: LLM, first_seed: int) -> Counter[tuple[int, ...]]:
        params = [SamplingParams(temperature=TEMPERATURE, seed=first_seed + i, max_tokens=4,
                                 ignore_eos=True) for i in range(num)]
        return Counter(tuple(o.outputs[0].token_ids[1:3]) for o in
                       llm.generate(prompt * num, params, use_tqdm=False))

    without = pairs(plain, 0)
    draft = Counter({t[0]: c for t, c in without.items()}).most_common(2)[1][0]

    class Fixed(StatelessProposer):
        def propose(self, requests):  # type: ignore[no-untyped-def]
            return [[draft] * r.max_drafts for r in requests]

    spec.engine_core.scheduler.proposer = Fixed()
    with_drafts = pairs(spec, 10_000)
    common = [t for t, c in (without + with_drafts).items() if c >= 10]
    cells = [(without[t], with_drafts[t]) for t in common]
    cells.append((num - sum(a for a, _ in cells), num - sum(b for _, b in cells)))
    cells = [c for c in cells if sum(c) > 0]
    statistic = sum((a - b) ** 2 / (a + b) for a, b in cells)  # equal sample sizes
    assert statistic < _chi_square_critical(len(cells) - 1), (statistic, cells)
    stats = spec.engine_core.scheduler.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("draft_arch", ["llama", "qwen3"])
def test_draft_model_tokens_equal_the_plain_engine(engines, checkpoints, draft_arch):
    """A tiny random draft of the same vocabulary: the target itself (every draft accepted)
    or a Qwen3 of other weights (few accepted). Preemption and chunking as above."""
    plain, _, tokenizer = engines
    target, _, _ = checkpoints("llama")
    draft, _, _ = checkpoints(draft_arch)
    spec = LLM(str(target), **ENGINE, speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
        "min_acceptance_rate": 0.0})
    prompts, params = _prompts(len(tokenizer)), _params()
    assert _generate(spec, prompts, params) == _generate(plain, prompts, params)
    before = spec.engine_core.get_stats()
    assert before.spec_decode_num_drafts > 0
    if draft_arch == "llama":  # greedy requests accept every draft of the target itself
        greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        assert _generate(spec, prompts, greedy) == _generate(plain, prompts, greedy)
        now = spec.engine_core.get_stats()
        drafted = now.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = now.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        assert accepted == drafted > 0


def test_async_scheduling_gives_the_same_tokens(engines, checkpoints):
    """The GPU's default: steps overlap except around drafts (the core plans nothing past a
    step with drafts, nor while the scheduler may draft). Two requests per batch limit let a
    batch of four run above it, overlapped, and then draft again as requests finish."""
    plain, _, tokenizer = engines
    folder, _, _ = checkpoints("llama")
    spec = LLM(str(folder), **ENGINE, async_scheduling=True,
               speculative_config={**SPEC, "disable_by_batch_size": 2})
    prompts, params = _prompts(len(tokenizer)), _params()
    expected = _generate(plain, prompts, params)
    sequences = [p + c[0] for p, out in zip(prompts, expected, strict=True) for c in out]
    spec.engine_core.scheduler.proposer = ReferenceProposer(sequences)
    assert _generate(spec, prompts, params) == expected
    assert spec.engine_core.get_stats().spec_decode_num_accepted_tokens > 0


def test_allowed_token_ids_with_drafts(engines):
    """Verification samples through the same processing, so allowed_token_ids hold there too:
    the drafts (the plain engine's tokens, with wrong ones the restriction rules out) leave the
    tokens those of the plain engine, greedy and seeded."""
    plain, spec, tokenizer = engines
    prompts = _prompts(len(tokenizer))
    allowed = sorted(random.Random(4).sample(range(3, len(tokenizer)), 6))
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True,
                       allowed_token_ids=allowed),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=3, seed=8, max_tokens=20, ignore_eos=True,
                       allowed_token_ids=allowed[:2]),
    ]
    expected = _generate(plain, prompts, params)
    got = _with_reference_drafts(spec, prompts, params, expected)
    for i in (0, 1, 3):
        assert set(got[i][0][0]) <= set(params[i].allowed_token_ids)


def test_bad_words_with_drafts(engines):
    """Requests with bad words do not draft (their recent output tokens advance one step at a
    time) and get the plain engine's tokens, next to requests that draft, through preemption
    (a resumed request matches the outputs it brings back)."""
    plain, spec, tokenizer = engines
    prompts = _prompts(len(tokenizer))
    free = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True)]
    base = _generate(plain, prompts[:2], free)
    pair, token = base[0][0][0][5:7], base[1][0][0][3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                       bad_words_token_ids=[pair]),
        SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True,
                       bad_words_token_ids=[[token], [1, 2, 3]]),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=8, max_tokens=30, ignore_eos=True),
    ]
    expected = _generate(plain, prompts, params)
    assert expected[0][0][0][:6] == base[0][0][0][:6] and expected[0][0][0][6] != pair[1]
    assert token not in expected[1][0][0]
    _with_reference_drafts(spec, prompts, params, expected)


def _with_reference_drafts(spec, prompts, params, expected):
    """The spec engine's outputs with drafts read from the expected outputs (every 4th one
    wrong); they must equal ``expected``, and some drafts must have been accepted."""
    sequences = [p + c[0] for p, out in zip(prompts, expected, strict=True) for c in out]
    scheduler = spec.engine_core.scheduler
    before = scheduler.get_stats().spec_decode_num_accepted_tokens
    saved, scheduler.proposer = scheduler.proposer, ReferenceProposer(sequences, wrong_every=4)
    try:
        got = _generate(spec, prompts, params)
    finally:
        scheduler.proposer = saved
    assert got == expected
    assert scheduler.get_stats().spec_decode_num_accepted_tokens > before
    return got
