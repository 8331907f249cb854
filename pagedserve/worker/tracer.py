"""Tracing one engine step: an observer of the runner's step phases, installed only while a
trace runs (``tracing``); an untraced step runs the runner's own methods and does no tracer work.

While installed, each phase reports its stop to ``tracer.record(stop, **values)`` as it returns.
Values are the runner's own objects (buffer views, host arrays, the metadata), not copies made
for the trace: they are valid only during the call, because the next step overwrites them. A
tracer that keeps them must copy (``RecordingTracer`` does). Stops, in order (the steps of
``docs/architecture.md#one-engine-step``):

  plan      the scheduler's plan applied to the slots (step 1)
  batch     batch order, idx_mapping, uniform decode count, graph descriptor (step 2)
  inputs    query_start_loc, input_ids, positions, seq_lens, logits_indices, is_padding (step 3)
  attn      block tables in batch order and the slot mapping (step 4)
  metadata  the attention metadata shared by every layer (step 5)
  forward   the hidden states the model returned (step 6)
  logits    the rows that became logits (step 7)
  sample    the sampled tokens and last_sampled_tokens after the update (step 7)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from pagedserve.attention.backends.base import AttentionMetadata
    from pagedserve.core.sched_output import SchedulerOutput
    from pagedserve.sample import SamplerOutput
    from pagedserve.worker.input_batch import InputBatch
    from pagedserve.worker.model_runner import ModelRunner


class Tracer(Protocol):
    def record(self, stop: str, **values: Any) -> None: ...


def _record_plan(tracer: Tracer, runner: ModelRunner, result: None,
                 scheduler_output: SchedulerOutput) -> None:
    states, tables = runner.states, runner.block_tables
    tracer.record("plan", req_id_to_index=states.req_id_to_index,
                  num_computed_tokens=states.num_computed_tokens_np,
                  prefill_len=states.prefill_len_np, num_blocks=tables.num_blocks_np,
                  block_table=tables.block_table_np)


def _record_inputs(tracer: Tracer, runner: ModelRunner, batch: InputBatch,
                   scheduler_output: SchedulerOutput) -> None:
    plan, descriptor = batch.plan, batch.descriptor
    tracer.record("batch", req_ids=plan.req_ids, idx_mapping=plan.idx_mapping_np,
                  query_lens=plan.query_lens_np, has_prefill=plan.has_prefill,
                  uniform_decode_len=plan.uniform_decode_len, descriptor=descriptor,
                  execution_mode=batch.mode,
                  capture_sizes=runner.graphs.ladders.ladder(descriptor.mode))
    tracer.record("inputs", query_start_loc=batch.query_start_loc,
                  query_start_loc_buffer=runner.buffers.query_start_loc,
                  input_ids=batch.input_ids, positions=batch.positions,
                  seq_lens=batch.seq_lens, logits_indices=batch.logits_indices,
                  is_padding=batch.is_padding)


def _record_attn(tracer: Tracer, runner: ModelRunner, metadata: AttentionMetadata,
                 batch: InputBatch) -> None:
    tracer.record("attn", block_table=metadata.block_table, slot_mapping=metadata.slot_mapping,
                  block_size=runner.block_size)
    tracer.record("metadata", metadata=metadata, layer_names=runner.layer_names)


def _record_forward(tracer: Tracer, runner: ModelRunner, hidden_states: torch.Tensor,
                    batch: InputBatch, metadata: AttentionMetadata) -> None:
    tracer.record("forward", hidden_states=hidden_states, cudagraph_mode=batch.mode)


def _record_logits(tracer: Tracer, runner: ModelRunner, logits: torch.Tensor,
                   hidden_states: torch.Tensor, logits_indices: torch.Tensor) -> None:
    tracer.record("logits", logits=logits, logits_indices=logits_indices)


def _record_sample(tracer: Tracer, runner: ModelRunner, result: None,
                   idx_mapping: torch.Tensor, sampler_output: SamplerOutput) -> None:
    tracer.record("sample", sampled_token_ids=sampler_output.sampled_token_ids,
                  idx_mapping=idx_mapping, last_sampled_tokens=runner.states.last_sampled_tokens)


PhaseRecorder = Callable[..., None]
"""``(tracer, runner, the phase's result, *the phase's arguments)``: records the phase's stops."""

PHASES: dict[str, PhaseRecorder] = {
    "_apply_plan": _record_plan,
    "_prepare_inputs": _record_inputs,
    "_prepare_attn": _record_attn,
    "_run_model": _record_forward,
    "_compute_logits": _record_logits,
    "_postprocess": _record_sample,
}
"""The runner's step phases, by method name, and what each records after it returns."""


def _observed(phase: Callable[..., Any], record: PhaseRecorder, tracer: Tracer,
              runner: ModelRunner) -> Callable[..., Any]:
    def observed(*args: Any) -> Any:
        result = phase(*args)
        record(tracer, runner, result, *args)
        return result

    return observed


@contextmanager
def tracing(runner: ModelRunner, tracer: Tracer) -> Iterator[Tracer]:
    """Within the block, the runner's step phases report their stops to ``tracer``.

    The observed phases shadow the runner's methods on this one instance; leaving the block
    removes them, so later steps run the class's methods untouched."""
    if any(name in vars(runner) for name in PHASES):
        raise RuntimeError("tracing: this runner is already traced")
    for name, record in PHASES.items():
        setattr(runner, name, _observed(getattr(runner, name), record, tracer, runner))
    try:
        yield tracer
    finally:
        for name in PHASES:
            delattr(runner, name)


def snapshot(value: Any) -> Any:
    """A host copy of ``value`` that later steps cannot change (tensors, arrays, containers,
    dataclasses as dicts of their fields)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(snapshot(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: snapshot(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    return value


class RecordingTracer:
    """Keeps a snapshot of every stop of the last ``execute_model`` / ``sample_tokens`` pair.

    A new step starts at the ``plan`` stop, which clears the previous step's record.
    """

    def __init__(self) -> None:
        self.stops: dict[str, dict[str, Any]] = {}

    def record(self, stop: str, **values: Any) -> None:
        if stop == "plan":
            self.stops = {}
        self.stops[stop] = {k: snapshot(v) for k, v in values.items()}
