"""Speculative decoding on a GPU: its targets, on the Llama-3-8B shape, dummy bf16.

``python benchmarks/spec_decode_bench.py --out DIR`` (or ``benchmarks/suite.py --sections
spec``, which reuses the suite's plain 8B engine) prints one JSON line per figure and appends
it to DIR/suite.json:

- ``spec.tiny_greedy_equal``: the suite's tiny workload on the fast path with drafts of the
  CPU reference's own tokens (one in five wrong): its greedy tokens equal the CPU run's
  without speculation; the accepted drafts are counted.
- ``spec.steps``: at batch 1 (1024-token prompt), the plain decode step (the plain engine: FULL
  graph, async scheduling), the verify step of 1 + k tokens for k = 1..5 (drafts that dummy
  weights reject, so every step verifies k), and the decode step of a Llama-3.2-1B-shaped
  draft model. From them, per k: the break-even acceptance rate and the speedup at acceptance
  0.8, for ngram drafts (no draft cost) and for a 1B draft model (k draft steps per verify).
- ``spec.e2e``: output tok/s at batch 1 over 256 tokens, plain engine against the speculative
  engine with (a) ngram on a prompt that repeats one random paragraph eight times, (b) drafts of
  the target's own greedy output, each draft wrong with probability 0.2 (acceptance ~0.8) and
  (c) never wrong (acceptance ~1). Dummy weights do not copy their prompt, so (b) and (c) are
  the measurement of the mechanics at a known acceptance; (a) reports what ngram found.
- ``spec.b64``: the batch-64 decode step with speculation configured (ngram, k = 4, defaults:
  it turns itself off above 32 running requests) against the plain engine: ratio >= 0.97 is
  the target.
- ``spec.draft_model`` (``run_draft_model``): the engine with the 1B-shaped draft model, its
  whole speculative step (k draft steps, then the verify step) measured at k = 1..5 (dummy
  weights: the drafts are rejected, every step drafts k), the break-even acceptance and the
  speedup at 0.8 from those measured steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.bench import latency
from pagedserve.entrypoints.bench.common import make_llm
from pagedserve.entrypoints.cli import build_parser
from pagedserve.spec_decode.proposer import DraftRequest, StatelessProposer

MAX_K = 5
SPEC_CONFIG = json.dumps({"method": "ngram", "num_speculative_tokens": MAX_K})
ACCEPTANCE = 0.8
E2E_TOKENS = 256
PROMPT_LEN = 1024
STEP_TOKENS = 64
"""Tokens per request when a decode step is timed."""


class FixedDrafts(StatelessProposer):
    """k drafts of fixed random ids (dummy weights reject them: every step verifies k)."""

    def __init__(self, k: int, vocab_size: int) -> None:
        self.drafts = np.random.default_rng(k).integers(10, vocab_size, k).tolist()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.drafts[: r.max_drafts] for r in requests]


class ReferenceDrafts(StatelessProposer):
    """Drafts the continuation of ``reference`` (the target's own greedy tokens), each draft
    replaced by a wrong id with probability ``p_wrong``."""

    def __init__(self, reference: list[int], p_wrong: float, seed: int = 0) -> None:
        self.reference = reference
        self.p_wrong = p_wrong
        self.rng = np.random.default_rng(seed)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            n = len(r.token_ids)
            drafts = self.reference[n : n + r.max_drafts]
            wrong = self.rng.random(len(drafts)) < self.p_wrong
            out.append([t + 1 if w else t for t, w in zip(drafts, wrong, strict=True)])
        return out


def bench_args(argv: list[str]) -> argparse.Namespace:
    parser, _ = build_parser("bench")
    return parser.parse_args(["bench", *argv])


def expected_tokens(a: float, k: int) -> float:
    """Tokens per verify step with per-draft acceptance ``a``: 1 + a + ... + a^k."""
    return float(sum(a**i for i in range(k + 1)))


def break_even(ratio: float, k: int) -> float | None:
    """The acceptance at which ``expected_tokens`` equals ``ratio`` (a speculative step's cost
    over a plain step's); None when even acceptance 1 does not pay."""
    if ratio <= 1.0:
        return 0.0
    if expected_tokens(1.0, k) <= ratio:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < ratio else (lo, mid)
    return round(hi, 4)


def step_figures(t_plain: float, t_verify: dict[int, float], t_draft: float) -> dict:
    """Per k: break-even acceptance and speedup at ACCEPTANCE, ngram and draft model."""
    out = {}
    for k, t in t_verify.items():
        ngram_cost, model_cost = t / t_plain, (t + k * t_draft) / t_plain
        e = expected_tokens(ACCEPTANCE, k)
        out[k] = {"verify_ms": t * 1e3, "ngram_break_even": break_even(ngram_cost, k),
                  "ngram_speedup_at_0.8": e / ngram_cost,
                  "draft_model_break_even": break_even(model_cost, k),
                  "draft_model_speedup_at_0.8": e / model_cost}
    return out


def decode_step_s(llm, prompt: list[int], max_tokens: int) -> float:  # noqa: ANN001
    """Seconds per decode step of one request: (T(max_tokens) - T(1)) over the steps, where a
    step that accepted drafts counts once."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (max_tokens, 1)]
    prompts = [{"prompt_token_ids": prompt}]
    llm.generate(prompts, params[0], use_tqdm=False)  # warm-up; the prompt is cached after it
    before = llm.engine_core.get_stats().spec_decode_num_accepted_tokens
    start = time.perf_counter()
    llm.generate(prompts, params[0], use_tqdm=False)
    t_full = time.perf_counter() - start
    accepted = llm.engine_core.get_stats().spec_decode_num_accepted_tokens - before
    start = time.perf_counter()
    llm.generate(prompts, params[1], use_tqdm=False)
    t_first = time.perf_counter() - start
    return (t_full - t_first) / (max_tokens - 1 - accepted)


def tokens_per_s(llm, prompt: list[int]) -> tuple[float, list[int], float]:  # noqa: ANN001
    """Output tok/s of one greedy request of E2E_TOKENS tokens (after a warm-up), its tokens,
    and the acceptance rate of the drafts it ran."""
    params = SamplingParams(temperature=0.0, max_tokens=E2E_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt}]
    llm.generate(prompts, params, use_tqdm=False)
    before = llm.engine_core.get_stats()
    start = time.perf_counter()
    (out,) = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    now = llm.engine_core.get_stats()
    drafted = now.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = now.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return E2E_TOKENS / elapsed, out.outputs[0].token_ids, accepted / drafted if drafted else 0.0


def free(llm) -> None:  # noqa: ANN001
    llm.engine_core.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


class CappedDrafts:
    """Another proposer's drafts, at most ``k`` per request."""

    def __init__(self, inner, k: int) -> None:  # noqa: ANN001
        self.inner = inner
        self.k = k

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return self.inner.propose([DraftRequest(r.req_id, r.token_ids, min(r.max_drafts, self.k))
                                   for r in requests])

    def finish(self, req_ids: Iterable[str]) -> None:
        self.inner.finish(req_ids)


class SequenceDrafts(StatelessProposer):
    """Drafts the continuation of whichever sequence the request's tokens start, one draft in
    five wrong."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            n = len(r.token_ids)
            seq = next((s for s in self.sequences if s[:n] == r.token_ids), [])
            out.append([t + 1 if (n + j) % 5 == 0 else t
                        for j, t in enumerate(seq[n : n + r.max_drafts])])
        return out


class NoDrafts(StatelessProposer):
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [[] for _ in requests]


def tiny_spec_check(work: Path) -> dict:
    from suite import tiny_workload

    prompts, common = tiny_workload(work)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cpu = LLM(**common, device="cpu", enforce_eager=True)
    ref = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    del cpu
    fast = LLM(**common, speculative_config=SPEC_CONFIG)
    sequences = [p["prompt_token_ids"] + r for p, r in zip(prompts, ref, strict=True)]
    fast.engine_core.scheduler.proposer = SequenceDrafts(sequences)
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    stats = fast.engine_core.get_stats()
    return {"equal": got == ref, "drafts": stats.spec_decode_num_draft_tokens,
            "accepted": stats.spec_decode_num_accepted_tokens,
            "async_scheduling": fast.engine_core.config.scheduler.async_scheduling}


def run(log, plain, engine_argv: list[str], work: Path) -> None:  # noqa: ANN001
    """The figures; ``plain`` is an engine of ``engine_argv`` without speculation."""
    log("spec.tiny_greedy_equal", **tiny_spec_check(work))
    vocab = plain.engine_core.vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, vocab, PROMPT_LEN).tolist()
    repeating = rng.integers(10, vocab, PROMPT_LEN // 8).tolist() * 8
    t_plain = decode_step_s(plain, prompt, STEP_TOKENS)

    draft = make_llm(bench_args(["latency", *draft_args(work)]))
    t_draft = decode_step_s(draft, prompt, STEP_TOKENS)
    free(draft)

    spec = make_llm(bench_args(["latency", *spec_engine_args(engine_argv)]))
    scheduler = spec.engine_core.scheduler
    ngram = scheduler.proposer
    t_verify = {}
    for k in range(1, MAX_K + 1):
        scheduler.proposer = FixedDrafts(k, vocab)
        t_verify[k] = decode_step_s(spec, prompt, STEP_TOKENS)
    log("spec.steps", plain_step_ms=t_plain * 1e3, draft_step_ms=t_draft * 1e3,
        per_k=step_figures(t_plain, t_verify, t_draft))

    plain_tps, _, _ = tokens_per_s(plain, repeating)
    scheduler.proposer = NoDrafts()  # the target's own tokens, for the reference drafts
    no_drafts_tps, reference, _ = tokens_per_s(spec, repeating)
    e2e: dict = {"plain_tok_per_s": plain_tps, "no_drafts_tok_per_s": no_drafts_tps}
    for name, proposer in (("ngram", ngram),
                           ("reference_0.8", ReferenceDrafts(repeating + reference, 0.2)),
                           ("reference_1.0", ReferenceDrafts(repeating + reference, 0.0))):
        scheduler.proposer = proposer
        tps, _, rate = tokens_per_s(spec, repeating)
        e2e[name] = {"tok_per_s": tps, "speedup": tps / plain_tps, "acceptance": rate}
    log("spec.e2e", **e2e)

    scheduler.proposer = ngram
    b64 = ["latency", *engine_argv, "--batch-size", "64", "--num-iters", "2",
           "--input-len", str(PROMPT_LEN)]
    t_spec = latency.run(spec, bench_args(b64))["decode_step_ms"]
    t_base = latency.run(plain, bench_args(b64))["decode_step_ms"]
    log("spec.b64", plain_step_ms=t_base, spec_configured_step_ms=t_spec,
        throughput_ratio=t_base / t_spec)
    free(spec)


def run_draft_model(log, plain, engine_argv: list[str], work: Path) -> None:  # noqa: ANN001
    """``spec.draft_model``: measured speculative steps with the 1B-shaped draft."""
    vocab = plain.engine_core.vocab_size
    prompt = np.random.default_rng(0).integers(10, vocab, PROMPT_LEN).tolist()
    t_plain = decode_step_s(plain, prompt, STEP_TOKENS)
    draft_model = draft_args(work)[1]
    config = json.dumps({"method": "draft_model", "model": draft_model,
                         "num_speculative_tokens": MAX_K})
    argv = spec_engine_args(engine_argv, config)
    # Batch 1 only: few sequences keep the draft's cache, sized outside the memory share for
    # max_num_seqs requests of max_model_len tokens, small beside the plain engine.
    i = argv.index("--max-num-seqs")
    argv[i + 1] = "16"
    spec = make_llm(bench_args(["latency", *argv]))
    scheduler = spec.engine_core.scheduler
    draft = scheduler.proposer
    per_k = {}
    for k in range(1, MAX_K + 1):
        scheduler.proposer = CappedDrafts(draft, k)
        t_step = decode_step_s(spec, prompt, STEP_TOKENS)
        e = expected_tokens(ACCEPTANCE, k)
        per_k[k] = {"step_ms": t_step * 1e3, "break_even": break_even(t_step / t_plain, k),
                    "speedup_at_0.8": e * t_plain / t_step}
    log("spec.draft_model", plain_step_ms=t_plain * 1e3, per_k=per_k)
    free(spec)


def spec_engine_args(engine: list[str], config: str = SPEC_CONFIG) -> list[str]:
    """The speculative 8B engine's arguments: the plain one's with ``config`` (ngram, k up to
    MAX_K, by default), a smaller memory share (it runs beside the plain engine) and a context
    of 2048 (the draft model's cache is sized from it, outside that share)."""
    i = engine.index("--gpu-memory-utilization")
    return [*engine[:i], "--gpu-memory-utilization", "0.25", *engine[i + 2:],
            "--max-model-len", "2048", "--speculative-config", config]


def draft_args(work: Path) -> list[str]:
    """The Llama-3.2-1B-shaped draft model, timed as a plain engine."""
    from suite import COMMON, model_dir

    return ["--model", model_dir(work, "llama-3.2-1b.json"), *COMMON,
            "--gpu-memory-utilization", "0.06", "--max-num-seqs", "16"]


def main() -> None:
    import tempfile

    from suite import COMMON, Suite, model_dir  # the suite's engine arguments and log

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite, work = Suite(out), Path(tempfile.mkdtemp())
    engine = ["--model", model_dir(work, "llama-3-8b.json"), *COMMON,
              "--gpu-memory-utilization", "0.6", "--max-num-seqs", "256"]
    plain = suite.run("8b.start_cold", make_llm, bench_args(["latency", *engine]))
    if plain is not None:
        suite.run("spec", run, suite.log, plain, engine, work)
        suite.run("spec.draft_model", run_draft_model, suite.log, plain, engine, work)


if __name__ == "__main__":
    main()
