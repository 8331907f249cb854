"""The measurements of ``spec_decode_bench.py``, one engine per process.

``python benchmarks/spec_decode_jobs.py --job NAME [--k K] --target DIR --draft DIR --work DIR``
builds exactly one engine (with the whole memory share), measures, prints each figure as one
``SPEC_RESULT {json}`` line as soon as it has it (so a job cut short still leaves its first
figures) and exits. Jobs:

- ``plain``: the 8B engine without speculation: the batch-1 decode step, end-to-end tok/s of
  the known-output workloads (and of an unbiased request: the bias's own cost), and three
  batch-64 throughput runs.
- ``spec --k K``: the 8B engine with ``ngram``, k = K, the gate's threshold 0 (so every step
  verifies what it is given): the verify step of 1 + K tokens (drafts always rejected), and
  end-to-end tok/s with ngram on the repetitive prompt and with ``IidDrafts`` at p = 0.8. With
  K = 4 (the batch-64 configuration: defaults otherwise, gate included) it first runs the three
  batch-64 throughput runs, then sets the gate's threshold to 0.
- ``draft_step``: the Llama-3.2-1B-shaped draft as a plain engine: its batch-1 decode step.
- ``draft_model``: the 8B engine with the 1B draft model (k = 5, gate 0): its whole
  speculative step at k = 1..5 (the draft's k steps, then the verify step; the drafts of dummy
  weights are rejected, so every step drafts k), and the verify step alone in the same engine.
- ``tiny``: the suite's tiny workload on the fast path with drafts of the CPU reference's own
  tokens (one in five wrong): its greedy tokens equal the CPU run's without speculation.

Known output. Dummy weights give near-ties, so the target's own greedy tokens are not a
reproducible reference (GEMMs of a verify step and GEMVs of a plain step round apart). The
end-to-end workloads therefore ask, through the public ``SamplingParams.logit_bias``, for a
bias of ``KNOWN_BIAS`` on ``KNOWN_TOKEN``: every greedy token is then ``KNOWN_TOKEN`` (the dummy
logits are a few units wide), whatever the step's rounding. A proposer drafting it is accepted
with probability 1, one drafting it with probability p per position is accepted at rate p. The
plain side runs the same biased requests. A step's cost does not depend on the weights' values,
so the timings are those of the model's shape; the bias costs one add per sampled row (the
``plain`` job reports an unbiased request beside it).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from spec_decode_bench import ACCEPTANCE, RESULT_PREFIX

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.bench.common import make_llm
from pagedserve.entrypoints.cli import build_parser
from pagedserve.spec_decode.proposer import DraftRequest, StatelessProposer

KNOWN_TOKEN = 3
KNOWN_BIAS = 100.0
MAX_K = 5
PROMPT_LEN = 1024
RUN_LEN = 64
"""The repetitive prompt ends with this many KNOWN_TOKENs."""
E2E_TOKENS = 256
STEP_TOKENS = 64
"""Tokens per request when a decode step is timed."""
B64 = dict(num_reqs=64, input_len=512, output_len=256, runs=3)


def emit(job: str, figure: str, **values: object) -> None:
    """One figure as a ``SPEC_RESULT`` line, flushed at once."""
    print(RESULT_PREFIX + json.dumps({"job": job, "figure": figure, **values}), flush=True)


def engine_args(argv: list[str]) -> argparse.Namespace:
    parser, _ = build_parser("bench")
    return parser.parse_args(["bench", "latency", *argv])


# ---- proposers ----------------------------------------------------------------------------


class FixedDrafts(StatelessProposer):
    """k drafts of fixed random ids, never the known token (dummy weights reject them too:
    every step verifies k)."""

    def __init__(self, k: int, vocab_size: int) -> None:
        self.drafts = np.random.default_rng(k).integers(10, vocab_size, k).tolist()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.drafts[: r.max_drafts] for r in requests]


class IidDrafts(StatelessProposer):
    """Each draft is ``token`` with probability ``p``, else ``token + 1``, independently per
    position: with a target that always answers ``token``, a run of drafts is accepted up to
    its first wrong one, i.e. at rate p per position."""

    def __init__(self, token: int, p: float, seed: int = 0) -> None:
        self.token = token
        self.p = p
        self.rng = np.random.default_rng(seed)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            right = self.rng.random(r.max_drafts) < self.p  # bool [max_drafts]
            out.append([self.token if ok else self.token + 1 for ok in right.tolist()])
        return out


class NoDrafts(StatelessProposer):
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [[] for _ in requests]


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


# ---- workloads ----------------------------------------------------------------------------


def known_params(max_tokens: int, biased: bool = True) -> SamplingParams:
    """Greedy, ``max_tokens`` tokens; ``biased``: every token is KNOWN_TOKEN."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logit_bias={KNOWN_TOKEN: KNOWN_BIAS} if biased else None)


def prompts(vocab_size: int) -> dict[str, list[int]]:
    """``ngram``: random ids ending in RUN_LEN known tokens (prompt lookup drafts the known
    token from there on); ``iid``: random ids."""
    rng = np.random.default_rng(0)
    head = rng.integers(10, vocab_size, PROMPT_LEN - RUN_LEN).tolist()
    return {"ngram": head + [KNOWN_TOKEN] * RUN_LEN,
            "iid": rng.integers(10, vocab_size, PROMPT_LEN).tolist()}


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    """(drafting steps, drafts, accepted drafts) so far."""
    s = llm.engine_core.get_stats()
    return (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens)


def timed(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start, out.outputs[0].token_ids


def decode_step_s(llm: LLM, prompt: list[int], max_tokens: int = STEP_TOKENS) -> float:
    """Seconds per decode step of one request: (T(max_tokens) - T(1)) over its steps, where a
    step that accepted drafts counts once (the prompt is prefix-cached after the warm-up)."""
    params, first = known_params(max_tokens, biased=False), known_params(1, biased=False)
    timed(llm, prompt, params)  # warm-up
    before = spec_counts(llm)[2]
    t_full, _ = timed(llm, prompt, params)
    accepted = spec_counts(llm)[2] - before
    t_first, _ = timed(llm, prompt, first)
    return (t_full - t_first) / (max_tokens - 1 - accepted)


def e2e(llm: LLM, prompt: list[int], biased: bool = True) -> dict:
    """One request of E2E_TOKENS tokens after a warm-up: decode tok/s ((N - 1) tokens over
    T(N) - T(1)), whole-request tok/s, whether every token was the known one, the drafts'
    acceptance and tokens per drafting step."""
    params = known_params(E2E_TOKENS, biased)
    timed(llm, prompt, params)
    before = spec_counts(llm)
    t_full, tokens = timed(llm, prompt, params)
    steps, drafted, accepted = (a - b for a, b in zip(spec_counts(llm), before, strict=True))
    t_first, _ = timed(llm, prompt, known_params(1, biased))
    return {"decode_tok_per_s": (E2E_TOKENS - 1) / (t_full - t_first),
            "tok_per_s": E2E_TOKENS / t_full, "known_output": set(tokens) == {KNOWN_TOKEN},
            "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else 0.0,
            "tokens_per_drafting_step": 1 + accepted / steps if steps else 1.0}


def batch_throughput(llm: LLM, job: str) -> None:
    """B64's runs: output tok/s of 64 random prompts at once (same prompts in every job)."""
    n, in_len, out_len = B64["num_reqs"], B64["input_len"], B64["output_len"]
    vocab = llm.engine_core.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    warm = [{"prompt_token_ids": [10 + i] * 32} for i in range(n)]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    for run in range(B64["runs"]):
        rng = np.random.default_rng(100 + run)
        batch = [{"prompt_token_ids": rng.integers(10, vocab, in_len).tolist()}
                 for _ in range(n)]
        before = spec_counts(llm)[1]
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        emit(job, "b64", run=run, tok_per_s=n * out_len / elapsed,
             drafted=spec_counts(llm)[1] - before)


# ---- jobs ---------------------------------------------------------------------------------

TARGET_SHARE = "0.85"
DRAFT_MODEL_SHARE = "0.75"
"""The engine with a draft model: the draft's weights, cache and graphs come on top."""


def target_argv(target: str, share: str = TARGET_SHARE) -> list[str]:
    """Every 8B engine's settings (the batch-64 pair differs only by its speculative config)."""
    from suite import COMMON

    return ["--model", target, *COMMON, "--gpu-memory-utilization", share,
            "--max-num-seqs", "256", "--max-model-len", "2048"]


def spec_config(k: int, gate: bool = False, draft: str | None = None) -> str:
    """ngram (or the draft model ``draft``) with k drafts; ``gate`` False: threshold 0."""
    config: dict = {"method": "ngram", "num_speculative_tokens": k}
    if draft is not None:
        config = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    if not gate:
        config["min_acceptance_rate"] = 0.0
    return json.dumps(config)


def job_plain(args: argparse.Namespace) -> None:
    llm = make_llm(engine_args(target_argv(args.target)))
    workloads = prompts(llm.engine_core.vocab_size)
    emit("plain", "step", step_ms=decode_step_s(llm, workloads["iid"]) * 1e3)
    for name, prompt in workloads.items():
        emit("plain", "e2e", workload=name, **e2e(llm, prompt))
    emit("plain", "e2e", workload="iid_unbiased", **e2e(llm, workloads["iid"], biased=False))
    batch_throughput(llm, "plain")


def job_spec(args: argparse.Namespace) -> None:
    """k = 4 is the batch-64 configuration (gate on) until its throughput runs are done."""
    k = args.k
    b64 = k == 4
    argv = [*target_argv(args.target), "--speculative-config", spec_config(k, gate=b64)]
    llm = make_llm(engine_args(argv))
    scheduler = llm.engine_core.scheduler
    if b64:
        batch_throughput(llm, "spec")
        scheduler.draft_gate.min_rate = 0.0
    workloads = prompts(llm.engine_core.vocab_size)
    ngram = scheduler.proposer
    scheduler.proposer = FixedDrafts(k, llm.engine_core.vocab_size)
    emit("spec", "verify_step", k=k, step_ms=decode_step_s(llm, workloads["iid"]) * 1e3)
    scheduler.proposer = ngram
    emit("spec", "e2e", k=k, workload="ngram", **e2e(llm, workloads["ngram"]))
    scheduler.proposer = IidDrafts(KNOWN_TOKEN, ACCEPTANCE)
    emit("spec", "e2e", k=k, workload="iid", p=ACCEPTANCE, **e2e(llm, workloads["iid"]))


def job_draft_step(args: argparse.Namespace) -> None:
    from suite import COMMON

    llm = make_llm(engine_args(["--model", args.draft, *COMMON, "--gpu-memory-utilization",
                                "0.3", "--max-num-seqs", "256", "--max-model-len", "2048"]))
    prompt = prompts(llm.engine_core.vocab_size)["iid"]
    emit("draft_step", "step", step_ms=decode_step_s(llm, prompt) * 1e3)


def job_draft_model(args: argparse.Namespace) -> None:
    argv = [*target_argv(args.target, DRAFT_MODEL_SHARE), "--speculative-config",
            spec_config(MAX_K, draft=args.draft)]
    llm = make_llm(engine_args(argv))
    scheduler = llm.engine_core.scheduler
    draft, vocab = scheduler.proposer, llm.engine_core.vocab_size
    prompt = prompts(vocab)["iid"]
    for k in range(1, MAX_K + 1):
        scheduler.proposer = CappedDrafts(draft, k)
        step = decode_step_s(llm, prompt)
        scheduler.proposer = FixedDrafts(k, vocab)
        verify = decode_step_s(llm, prompt)
        emit("draft_model", "spec_step", k=k, step_ms=step * 1e3, verify_only_ms=verify * 1e3)


def tiny_workload(work: Path) -> tuple[list[dict], dict]:
    from suite import tiny_workload as suite_tiny_workload

    return suite_tiny_workload(work)


def job_tiny(args: argparse.Namespace) -> None:
    tiny_prompts, common = tiny_workload(Path(args.work))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cpu = LLM(**common, device="cpu", enforce_eager=True)
    ref = [o.outputs[0].token_ids for o in cpu.generate(tiny_prompts, params, use_tqdm=False)]
    del cpu
    fast = LLM(**common, speculative_config=spec_config(MAX_K))
    sequences = [p["prompt_token_ids"] + r for p, r in zip(tiny_prompts, ref, strict=True)]
    fast.engine_core.scheduler.proposer = SequenceDrafts(sequences)
    got = [o.outputs[0].token_ids for o in fast.generate(tiny_prompts, params, use_tqdm=False)]
    _, drafted, accepted = spec_counts(fast)
    emit("tiny", "greedy_equal", equal=got == ref, drafts=drafted, accepted=accepted,
         async_scheduling=fast.engine_core.config.scheduler.async_scheduling)


JOBS = {"plain": job_plain, "spec": job_spec, "draft_step": job_draft_step,
        "draft_model": job_draft_model, "tiny": job_tiny}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True, choices=sorted(JOBS))
    parser.add_argument("--k", type=int, default=MAX_K)
    parser.add_argument("--target", help="the 8B-shaped model folder")
    parser.add_argument("--draft", help="the 1B-shaped draft model folder")
    parser.add_argument("--work", default=".", help="a folder for the tiny checkpoint")
    args = parser.parse_args()
    JOBS[args.job](args)


if __name__ == "__main__":
    main()
