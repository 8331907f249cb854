"""Prompt logprobs: for each prompt position computed this step, the logprob of the next prompt
token (and the top-k), for the requests that asked (``SamplingParams.prompt_logprobs``).

Prompt token ``p + 1`` is predicted by the hidden state at position ``p``, so a chunk that
computes positions ``[a, b)`` yields the rows of tokens ``a + 1 .. min(b, num_prompt_tokens - 1)``
(token 0 has no logprob). Row indices come from host-known counts; the target token ids are
gathered from ``all_token_ids`` on the device. Logits are built in chunks of rows so a long
prompt never holds a [prompt_len, vocab] fp32 tensor at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.sample import LogprobsTensors, compute_prompt_logprobs
from pagedserve.worker.async_output import PromptLogprobsSpan
from pagedserve.worker.input_batch import InputBatch
from pagedserve.worker.staging import host_to_device
from pagedserve.worker.states import RequestStates

LOGITS_CHUNK_ROWS = 1024


@dataclass
class PromptLogprobsPlan:
    hidden_rows_np: np.ndarray  # int64 [num_rows]: rows of the step's hidden states
    target_slots_np: np.ndarray  # int64 [num_rows]: slot of each row's request
    target_pos_np: np.ndarray  # int64 [num_rows]: position of the predicted prompt token
    spans: list[PromptLogprobsSpan]

    @property
    def num_logprobs(self) -> int:
        return max(span.num_logprobs for span in self.spans)


def plan_prompt_logprobs(batch: InputBatch, states: RequestStates) -> PromptLogprobsPlan | None:
    """None when no request of the batch needs prompt logprobs this step. A request resumed
    after preemption (it has outputs) already got all of its prompt logprobs."""
    rows, slots, targets, spans = [], [], [], []
    num_rows = 0
    plan = batch.plan
    for i, slot in enumerate(plan.idx_mapping_np.tolist()):
        params = states.sampling_params[slot]
        if params is None or params.prompt_logprobs is None:
            continue
        if states.num_resumed_output_tokens_np[slot] > 0:
            continue
        start = int(plan.num_computed_tokens_np[i])
        end = min(start + int(plan.query_lens_np[i]), int(states.num_prompt_tokens_np[slot]) - 1)
        if end <= start:
            continue
        n = end - start
        rows.append(int(batch.query_start_loc_np[i]) + np.arange(n, dtype=np.int64))
        slots.append(np.full(n, slot, dtype=np.int64))
        targets.append(np.arange(start + 1, end + 1, dtype=np.int64))
        spans.append(PromptLogprobsSpan(plan.req_ids[i], num_rows, num_rows + n,
                                        params.prompt_logprobs))
        num_rows += n
    if not spans:
        return None
    return PromptLogprobsPlan(np.concatenate(rows), np.concatenate(slots),
                              np.concatenate(targets), spans)


def compute_batch_prompt_logprobs(
    plan: PromptLogprobsPlan,
    hidden_states: torch.Tensor,  # [num_tokens_after_padding, hidden_size]
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    all_token_ids: torch.Tensor,  # int32 [max_num_reqs, max_model_len]
) -> LogprobsTensors:
    """One LogprobsTensors for all planned rows, top-k = the largest k asked in the batch."""
    device = hidden_states.device
    hidden_rows = host_to_device(plan.hidden_rows_np, torch.int64, device)  # [num_rows]
    target_ids = all_token_ids[
        host_to_device(plan.target_slots_np, torch.int64, device),
        host_to_device(plan.target_pos_np, torch.int64, device),
    ].long()  # int64 [num_rows]
    parts = []
    for start in range(0, hidden_rows.shape[0], LOGITS_CHUNK_ROWS):
        rows = slice(start, start + LOGITS_CHUNK_ROWS)
        logits = compute_logits(hidden_states[hidden_rows[rows]])  # [chunk, V]
        parts.append(compute_prompt_logprobs(logits, target_ids[rows], plan.num_logprobs))
    return LogprobsTensors(
        token_ids=torch.cat([p.token_ids for p in parts]),
        logprobs=torch.cat([p.logprobs for p in parts]),
        ranks=torch.cat([p.ranks for p in parts]),
    )
