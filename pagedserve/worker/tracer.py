"""The runner's trace hook: after each stop of a step, ``tracer.record(stop, **values)``.

Values are the runner's own objects (buffer views, host arrays, the metadata), not copies made
for the trace: they are valid only during the call, because the next step overwrites them. A
tracer that keeps them must copy (``RecordingTracer`` does). Stops, in order:

  plan      the scheduler's plan applied to the slots (stop 1)
  batch     batch order, idx_mapping, uniform decode count, graph descriptor (stop 2)
  inputs    query_start_loc, input_ids, positions, seq_lens, logits_indices, is_padding (stop 3)
  attn      block tables in batch order and the slot mapping (stop 4)
  metadata  the attention metadata shared by every layer (stop 5)
  forward   the hidden states the model returned (stops 6-12)
  logits    the rows that became logits (stop 13)
  sample    the sampled tokens and last_sampled_tokens after the update (stop 14)
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Protocol

import numpy as np
import torch


class Tracer(Protocol):
    def record(self, stop: str, **values: Any) -> None: ...


class NullTracer:
    """The default: records nothing, costs one method call per stop."""

    def record(self, stop: str, **values: Any) -> None:
        return None


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
