"""The recorded stops of one step, as plain data: "what the data looks like now" per stop.

Input: ``RecordingTracer.stops`` (host snapshots of the runner's own buffers, taken at each
stop). Output: a JSON-able dict with one entry per stop, in the runner's order. Every value is
read from those snapshots; nothing is recomputed beside the runner. The one interpretation
made here is decoding a cache slot into its block: ``slot = block_id * block_size + offset``
(the runner's slot mapping), and the block's index is where that id sits in the request's
block-table row (the runner's gathered table).

Per-token tensors are split at the step's real token count (``query_start_loc[num_reqs]``):
``real`` rows belong to requests, ``padding`` rows only pad up to the graph's capture size.
Lists are complete here; the text formatter abridges them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

Stops = dict[str, dict[str, Any]]
TokenDecoder = Callable[[int], str]


def _array(value: torch.Tensor | np.ndarray) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _dtype(value: torch.Tensor | np.ndarray) -> str:
    return str(value.dtype).removeprefix("torch.")


def tensor_summary(value: torch.Tensor | np.ndarray) -> dict[str, Any]:
    """dtype and shape, for tensors too large to list."""
    return {"dtype": _dtype(value), "shape": list(value.shape)}


def split_rows(value: torch.Tensor | np.ndarray, num_tokens: int) -> dict[str, Any]:
    """A per-token tensor: its dtype and shape, then its real rows and its padding rows."""
    values = _array(value).tolist()
    return {**tensor_summary(value), "real": values[:num_tokens], "padding": values[num_tokens:]}


def _require(stops: Stops, stop: str) -> dict[str, Any]:
    if stop not in stops:
        raise ValueError(f"trace: the runner recorded no {stop!r} stop (got {list(stops)})")
    return stops[stop]


# ---- plan: the plan applied to the slots ----------------------------------------------------


def plan_view(plan: dict[str, Any]) -> dict[str, Any]:
    """Every live request's slot and the per-slot host mirrors read at those slots."""
    slots: dict[str, int] = plan["req_id_to_index"]
    num_computed, prefill_len = plan["num_computed_tokens"], plan["prefill_len"]
    num_blocks, block_table = plan["num_blocks"], plan["block_table"]
    return {
        "req_id_to_index": dict(slots),
        "num_computed_tokens": {r: int(num_computed[s]) for r, s in slots.items()},
        "prefill_len": {r: int(prefill_len[s]) for r, s in slots.items()},
        "num_blocks": {r: int(num_blocks[s]) for r, s in slots.items()},
        "block_ids": {r: block_table[s, : num_blocks[s]].tolist() for r, s in slots.items()},
    }


# ---- batch: batch order and graph descriptor ----------------------------------------------


def batch_view(batch: dict[str, Any]) -> dict[str, Any]:
    return {
        "req_ids": list(batch["req_ids"]),
        "idx_mapping": _array(batch["idx_mapping"]).tolist(),
        "query_lens": _array(batch["query_lens"]).tolist(),
        "has_prefill": bool(batch["has_prefill"]),
        "uniform_decode_len": batch["uniform_decode_len"],
        "descriptor": dict(batch["descriptor"]),
        "execution_mode": batch["execution_mode"],
        "capture_sizes": list(batch["capture_sizes"]),
    }


# ---- inputs: the input buffers --------------------------------------------------------------


def num_real_tokens(inputs: dict[str, Any], num_reqs: int) -> int:
    """The step's real token count, from the runner's query_start_loc."""
    return int(inputs["query_start_loc"][num_reqs])


def inputs_view(inputs: dict[str, Any], num_reqs: int) -> dict[str, Any]:
    num_tokens = num_real_tokens(inputs, num_reqs)
    buffer = _array(inputs["query_start_loc_buffer"])
    is_padding = _array(inputs["is_padding"])
    padding_rows = np.flatnonzero(is_padding)
    return {
        "query_start_loc": _array(inputs["query_start_loc"]).tolist(),
        "query_start_loc_buffer": {
            **tensor_summary(buffer),
            "tail_from": num_reqs + 1,
            "tail_values": np.unique(buffer[num_reqs + 1 :]).tolist(),
        },
        "input_ids": split_rows(inputs["input_ids"], num_tokens),
        "positions": split_rows(inputs["positions"], num_tokens),
        "seq_lens": _array(inputs["seq_lens"]).tolist(),
        "logits_indices": _array(inputs["logits_indices"]).tolist(),
        "is_padding": {
            **tensor_summary(is_padding),
            "real_rows": int((~is_padding).sum()),
            "padding_rows": int(padding_rows.size),
            "first_padding_row": int(padding_rows[0]) if padding_rows.size else None,
        },
    }


# ---- attn: block tables and slot mapping ---------------------------------------------------


def _block_index(row: np.ndarray, block_id: int) -> int | None:
    """Where ``block_id`` sits in a block-table row; None if it is not there (a runner bug)."""
    hits = np.flatnonzero(row == block_id)
    return int(hits[0]) if hits.size else None


def _locate(slot: int, row: np.ndarray, block_size: int) -> dict[str, Any]:
    block_id, offset = divmod(slot, block_size)
    return {"slot": slot, "block_id": block_id, "block_index": _block_index(row, block_id),
            "offset": offset}


def request_tokens_view(
    rows: range, positions: np.ndarray, slot_mapping: np.ndarray, table_row: np.ndarray,
    block_size: int,
) -> dict[str, Any]:
    """Where one request's tokens of this step land in the cache: the block indexes they span,
    and the block, offset and fill of its last token (the one that becomes logits)."""
    first = _locate(int(slot_mapping[rows.start]), table_row, block_size)
    last = _locate(int(slot_mapping[rows.stop - 1]), table_row, block_size)
    return {
        "rows": [rows.start, rows.stop - 1],
        "positions": [int(positions[rows.start]), int(positions[rows.stop - 1])],
        "block_indexes": [first["block_index"], last["block_index"]],
        "last_token": {"row": rows.stop - 1, "position": int(positions[rows.stop - 1]), **last},
        "tokens_in_last_block": last["offset"] + 1,
    }


def attn_view(attn: dict[str, Any], inputs: dict[str, Any], plan: dict[str, Any],
              req_ids: list[str]) -> dict[str, Any]:
    block_table, block_size = _array(attn["block_table"]), int(attn["block_size"])
    slot_mapping = _array(attn["slot_mapping"])
    positions, query_start_loc = _array(inputs["positions"]), _array(inputs["query_start_loc"])
    slots, num_blocks = plan["req_id_to_index"], plan["num_blocks"]
    table_rows = {r: block_table[i, : num_blocks[slots[r]]] for i, r in enumerate(req_ids)}
    requests = {
        r: request_tokens_view(range(int(query_start_loc[i]), int(query_start_loc[i + 1])),
                               positions, slot_mapping, table_rows[r], block_size)
        for i, r in enumerate(req_ids)
    }
    return {
        "block_size": block_size,
        "block_tables": {**tensor_summary(block_table),
                         "rows": {r: row.tolist() for r, row in table_rows.items()}},
        "slot_mapping": split_rows(slot_mapping, num_real_tokens(inputs, len(req_ids))),
        "requests": requests,
    }


# ---- metadata, forward, logits, sample------------------------------------------------------------


def metadata_view(stop: dict[str, Any]) -> dict[str, Any]:
    """Scalars as they are; small tensors (up to num_reqs + 1 entries) listed; the others by
    dtype and shape."""
    metadata = stop["metadata"]
    small = int(metadata["num_reqs"]) + 1
    fields: dict[str, Any] = {}
    for name, value in metadata.items():
        if isinstance(value, torch.Tensor):
            listed = value.dim() == 1 and value.numel() <= small
            fields[name] = value.tolist() if listed else tensor_summary(value)
        else:
            fields[name] = value
    names = list(stop["layer_names"])
    return {"fields": fields, "layers": {"count": len(names), "names": names}}


def forward_view(forward: dict[str, Any]) -> dict[str, Any]:
    return {"hidden_states": tensor_summary(forward["hidden_states"]),
            "cudagraph_mode": forward["cudagraph_mode"]}


def logits_view(logits: dict[str, Any]) -> dict[str, Any]:
    return {"logits": tensor_summary(logits["logits"]),
            "logits_indices": _array(logits["logits_indices"]).tolist()}


def sample_view(sample: dict[str, Any], plan: dict[str, Any],
                decode: TokenDecoder | None) -> dict[str, Any]:
    """Sampled tokens by request, and last_sampled_tokens read back at the same slots."""
    slot_to_req = {s: r for r, s in plan["req_id_to_index"].items()}
    idx_mapping = _array(sample["idx_mapping"]).tolist()
    sampled = _array(sample["sampled_token_ids"]).tolist()
    last = _array(sample["last_sampled_tokens"])
    req_ids = [slot_to_req[s] for s in idx_mapping]
    view: dict[str, Any] = {
        "idx_mapping": idx_mapping,
        "sampled_token_ids": dict(zip(req_ids, sampled, strict=True)),
        "last_sampled_tokens": {r: int(last[s]) for r, s in zip(req_ids, idx_mapping, strict=True)},
    }
    if decode is not None:
        view["text"] = {r: decode(t) for r, t in zip(req_ids, sampled, strict=True)}
    return view


def build_stops_view(stops: Stops, decode: TokenDecoder | None = None) -> dict[str, Any]:
    """One entry per recorded stop, in order. A step with no tokens stops after ``plan``; a
    step whose requests all stay inside their prefill has no ``logits`` or ``sample``."""
    plan = _require(stops, "plan")
    view: dict[str, Any] = {"plan": plan_view(plan)}
    if "batch" not in stops:
        return view
    batch = batch_view(stops["batch"])
    req_ids = batch["req_ids"]
    inputs = _require(stops, "inputs")
    view["batch"] = batch
    view["inputs"] = inputs_view(inputs, len(req_ids))
    view["attn"] = attn_view(_require(stops, "attn"), inputs, plan, req_ids)
    view["metadata"] = metadata_view(_require(stops, "metadata"))
    view["forward"] = forward_view(_require(stops, "forward"))
    if "logits" in stops:
        view["logits"] = logits_view(stops["logits"])
    if "sample" in stops:
        view["sample"] = sample_view(stops["sample"], plan, decode)
    return view
