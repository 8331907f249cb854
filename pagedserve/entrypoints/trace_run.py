"""Drive the engine to one step and record that step through the runner's step observer.

A scenario is a list of arrivals: which request enters the engine before which step. The
engine core then runs real steps (its scheduler plans them, its runner executes them); only the
chosen step runs traced (``worker/tracer.py``), the others untraced.

The ``seed`` scenario is a fixed example step, the one docs/trace.md reads: R1 (540-token
prompt) and R2 (129) arrive first and are prefilled in step 1, so in step 2 they decode with
540 and 129 computed tokens while R3 arrives with a 298-token prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedserve.config import default_capture_sizes
from pagedserve.core.sched_output import EngineCoreOutput
from pagedserve.engine.input_processor import PromptType
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.tracer import RecordingTracer, tracing


@dataclass(frozen=True)
class Arrival:
    step: int
    """The request enters the engine just before this step (1-based)."""
    req_id: str
    prompt: PromptType


SEED_STEP = 2
SEED_PROMPT_LENS = (("R1", 540, 1), ("R2", 129, 1), ("R3", 298, 2))
"""(req_id, prompt tokens, arrival step) of the scenario's requests."""
SEED_ENGINE_ARGS: dict[str, Any] = {
    "block_size": 16,
    "max_num_seqs": 1024,  # request slots; handed out from the top, so R1 gets slot 1023
    "max_capture_size": 512,  # the H200's capture sizes: up to 512, steps of 16 above 256
    "cudagraph_capture_sizes": None,
    # Mixed batches pad on the dense ladder too (step 2: 300 tokens -> 304).
    "piecewise_cudagraph_capture_sizes": tuple(default_capture_sizes(512)),
}
"""Engine options the ``seed`` scenario fixes (they override the command line)."""
SEED_MIN_BATCHED_TOKENS = 540 + 129
"""Step 1 prefills R1 and R2 whole, so the token budget must hold both prompts."""


def seed_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The engine options of the ``seed`` scenario: ``kwargs`` with ``SEED_ENGINE_ARGS`` applied."""
    budget = kwargs.get("max_num_batched_tokens")
    if budget is not None and budget < SEED_MIN_BATCHED_TOKENS:
        raise ValueError(f"max_num_batched_tokens: --scenario seed prefills "
                         f"{SEED_MIN_BATCHED_TOKENS} tokens in step 1, got {budget}")
    return {**kwargs, **SEED_ENGINE_ARGS}


def seed_sampling_params(params: SamplingParams) -> SamplingParams:
    """The scenario's requests keep running: no EOS stop, no length cap below the context."""
    return dataclasses.replace(params, ignore_eos=True, max_tokens=None, min_tokens=0)


def seed_arrivals(vocab_size: int, seed: int) -> list[Arrival]:
    """R1, R2 before step 1 and R3 before step 2, with random prompts of the scenario's lengths."""
    rng = np.random.default_rng(seed)
    return [Arrival(step, req_id, rng.integers(0, vocab_size, n).tolist())
            for req_id, n, step in SEED_PROMPT_LENS]


def prompt_arrivals(prompts: list[str]) -> list[Arrival]:
    """Every prompt enters before step 1, as R1, R2, ..."""
    return [Arrival(1, f"R{i}", p) for i, p in enumerate(prompts, start=1)]


@dataclass
class TracedStep:
    step: int
    stops: dict[str, dict[str, Any]]
    """``RecordingTracer.stops`` of the traced step."""
    outputs: list[EngineCoreOutput]
    """What the engine core returned for that step."""


def run_to_step(llm: LLM, arrivals: list[Arrival], params: SamplingParams,
                step: int) -> TracedStep:
    """Run steps 1..``step`` of the engine, adding each arrival before its step; record the
    last one. Raises ValueError when no request is left to run before ``step``."""
    if step < 1:
        raise ValueError(f"step: must be >= 1, got {step}")
    core, runner = llm.engine_core, llm.engine_core.model_runner
    tracer, outputs = RecordingTracer(), []
    for n in range(1, step + 1):
        for arrival in (a for a in arrivals if a.step == n):
            processed = llm.input_processor.process_inputs(arrival.req_id, arrival.prompt, params)
            for request in processed.requests:
                core.add_request(request)
        if not core.has_unfinished_requests():
            raise ValueError(f"step: every request finished after step {n - 1}, so step {step} "
                             "never runs (raise --max-tokens, or pass --ignore-eos)")
        if n == step:
            with tracing(runner, tracer):
                outputs = core.step()
        else:
            outputs = core.step()
    return TracedStep(step, tracer.stops, outputs)
