"""The trace as text: one block per stop, "what the data looks like now" (docs/trace.md).
Long lists are abridged (head ... tail); ``--json`` carries them whole."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

HEAD, TAIL = 6, 3
"""Entries an abridged list keeps at each end."""
MAX_SEGMENTS = 8
"""Per-token tensors are shown request by request up to this many requests."""
WIDTH = 96
"""Wrap width of the attention-metadata fields."""

StopsView = dict[str, dict[str, Any]]

STOP_TITLES = {
    "plan": ("1", "execute_model applies the plan to the request slots"),
    "batch": ("2", "sort the batch, then pick the CUDA graph mode"),
    "inputs": ("3", "prepare_inputs builds the input tensors"),
    "attn": ("4", "block tables and slot mappings"),
    "metadata": ("5", "the attention metadata: one object for every layer"),
    "forward": ("6-12", "the forward context and the model; the hidden states are kept"),
    "logits": ("13", "logits for the rows that sample"),
    "sample": ("14", "the sampler; tokens stay on the device for the next step"),
}


def abridge(values: Sequence[Any], head: int = HEAD, tail: int = TAIL) -> str:
    """``[a, b, c, ..., y, z]``; the whole list when it is short."""
    if len(values) <= head + tail + 1:
        return json.dumps(list(values))
    inner = [json.dumps(v) for v in values[:head]] + ["..."]
    inner += [json.dumps(v) for v in values[-tail:]]
    return "[" + ", ".join(inner) + "]"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _shape(summary: dict[str, Any]) -> str:
    return f"{summary['dtype']} {summary['shape']}"


def _per_request(values: dict[str, Any]) -> str:
    return ", ".join(f"{r}: {v}" for r, v in values.items())


def _runs_as(mode: str) -> str:
    return "eagerly" if mode == "NONE" else f"as a {mode} graph replay"


def _rows(name: str, split: dict[str, Any], stops: StopsView, padding_note: str) -> str:
    """A per-token tensor: its real rows request by request, then its padding rows."""
    real, req_ids = split["real"], stops["batch"]["req_ids"]
    qsl = stops["inputs"]["query_start_loc"]
    shown = abridge(real)
    if len(req_ids) <= MAX_SEGMENTS:
        shown = " | ".join(f"{r} {abridge(real[qsl[i] : qsl[i + 1]])}"
                           for i, r in enumerate(req_ids))
    line = f"{name} {_shape(split)} = {shown}"
    if split["padding"]:
        line += f" | {_count(len(split['padding']), 'padding row')} {abridge(split['padding'])}"
        line += f"  # {padding_note}"
    return line


def format_plan(stops: StopsView) -> list[str]:
    plan = stops["plan"]
    slots = list(plan["req_id_to_index"].values())
    return [
        f"req_id_to_index = {json.dumps(plan['req_id_to_index'])}",
        f"num_computed_tokens_np[{slots}] = {list(plan['num_computed_tokens'].values())}",
        f"prefill_len[{slots}] = {list(plan['prefill_len'].values())}",
        f"block table row lengths = {_per_request(plan['num_blocks'])}",
    ]


def format_batch(stops: StopsView) -> list[str]:
    batch = stops["batch"]
    d, sizes = batch["descriptor"], batch["capture_sizes"]
    return [
        f"req_ids = {json.dumps(batch['req_ids'])}",
        f"idx_mapping_np = {abridge(batch['idx_mapping'])}",
        f"query_lens = {abridge(batch['query_lens'])}",
        f"has_prefill = {batch['has_prefill']};  "
        f"uniform_decode_len = {batch['uniform_decode_len']}",
        f"batch_desc = BatchDescriptor(mode={d['mode']}, num_tokens={d['num_tokens']}, "
        f"num_reqs={d['num_reqs']})",
        f"capture sizes = {abridge(sizes, 4, 3)} ({len(sizes)} sizes)",
        f"this step runs {_runs_as(batch['execution_mode'])}, padded as batch_desc says",
    ]


def format_inputs(stops: StopsView) -> list[str]:
    inputs = stops["inputs"]
    qsl, buffer = inputs["query_start_loc"], inputs["query_start_loc_buffer"]
    pad = inputs["is_padding"]
    return [
        f"query_start_loc int32 [{len(qsl)}] = {abridge(qsl)}  # buffer entries "
        f"{buffer['tail_from']}..{buffer['shape'][0] - 1} hold {buffer['tail_values']}",
        _rows("input_ids", inputs["input_ids"], stops, "never written: stale"),
        _rows("positions", inputs["positions"], stops, "never written: stale"),
        f"seq_lens = {abridge(inputs['seq_lens'])}",
        f"logits_indices = {abridge(inputs['logits_indices'])}",
        f"is_padding {_shape(pad)} = {pad['real_rows']} x False, {pad['padding_rows']} x True",
    ]


def _request_tokens(req_id: str, r: dict[str, Any], block_size: int) -> str:
    last, (p0, p1), (b0, b1) = r["last_token"], r["positions"], r["block_indexes"]
    spans = f"positions {p0}..{p1} -> block indexes {b0}..{b1}; " if p0 != p1 else ""
    return (f"{req_id}, {spans}position {last['position']} -> slot {last['slot']} = "
            f"{last['block_id']} x {block_size} + {last['offset']}: block index "
            f"{last['block_index']}, offset {last['offset']}; that block now holds "
            f"{_count(r['tokens_in_last_block'], 'token')}")


def format_attn(stops: StopsView) -> list[str]:
    attn = stops["attn"]
    bs, tables = attn["block_size"], attn["block_tables"]
    lines = [f"block_tables[0] {_shape(tables)}  # rows in batch order, block size {bs}"]
    lines += [f"  {r}: {_count(len(row), 'block')} = {abridge(row)}"
              for r, row in tables["rows"].items()]
    lines.append(_rows("slot_mapping", attn["slot_mapping"], stops, "PAD_SLOT_ID: no cache write"))
    lines += ["  " + _request_tokens(r, v, bs) for r, v in attn["requests"].items()]
    return lines


def _wrap(items: list[str], first: str, indent: str) -> list[str]:
    """``first`` then the items joined by ", ", greedily packed into lines of WIDTH."""
    lines, line = [], first
    for i, item in enumerate(items):
        piece = item + (", " if i < len(items) - 1 else ")")
        if len(line) + len(piece) > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += piece
    return lines + [line]


def format_metadata(stops: StopsView) -> list[str]:
    metadata = stops["metadata"]
    fields = [f"{k}={_shape(v) if isinstance(v, dict) else v}"
              for k, v in metadata["fields"].items()]
    names = metadata["layers"]["names"]
    shown = f'"{names[0]}": m, ..., "{names[-1]}": m' if len(names) > 1 else f'"{names[0]}": m'
    return _wrap(fields, "m = AttentionMetadata(", "    ") + [
        f"attn_metadata = {{{shown}}}  # {len(names)} layers, one object"]


def format_forward(stops: StopsView) -> list[str]:
    forward = stops["forward"]
    return [f"hidden_states {_shape(forward['hidden_states'])}  # the model ran "
            f"{_runs_as(forward['cudagraph_mode'])}"]


def format_logits(stops: StopsView) -> list[str]:
    logits = stops["logits"]
    return [f"sample_hidden_states = hidden_states[{abridge(logits['logits_indices'])}]",
            f"logits {_shape(logits['logits'])}"]


def format_sample(stops: StopsView) -> list[str]:
    sample = stops["sample"]
    lines = [f"sampled_token_ids = {_per_request(sample['sampled_token_ids'])}",
             f"last_sampled_tokens[{abridge(sample['idx_mapping'])}] = "
             f"{abridge(list(sample['last_sampled_tokens'].values()))}  # inputs of the next step"]
    if "text" in sample:
        texts = {r: json.dumps(t, ensure_ascii=False) for r, t in sample["text"].items()}
        lines.append(f"as text: {_per_request(texts)}")
    return lines


FORMATTERS: dict[str, Callable[[StopsView], list[str]]] = {
    "plan": format_plan, "batch": format_batch, "inputs": format_inputs, "attn": format_attn,
    "metadata": format_metadata, "forward": format_forward, "logits": format_logits,
    "sample": format_sample,
}


def format_header(trace: dict[str, Any]) -> list[str]:
    e = trace["engine"]
    lines = [f"pagedserve trace: step {trace['step']} ({trace['scenario']}) of {e['model']} on "
             f"{e['device']} ({e['dtype']}), block size {e['block_size']}, "
             f"{e['max_num_seqs']} request slots, {e['num_kv_blocks']} KV blocks"]
    for r in trace["requests"]:
        prompt = f": {json.dumps(r['prompt'])}" if "prompt" in r else ""
        lines.append(f"  {r['req_id']} arrives before step {r['arrives_at_step']} with "
                     f"{_count(r['num_prompt_tokens'], 'prompt token')}{prompt}")
    return lines


def format_trace(trace: dict[str, Any]) -> str:
    """The whole trace (``entrypoints.trace.build_trace``'s dict) as text."""
    stops = trace["stops"]
    lines = format_header(trace)
    for stop in stops:
        number, title = STOP_TITLES[stop]
        lines += ["", f"{number} {stop}: {title}"]
        lines += ["  " + line for line in FORMATTERS[stop](stops)]
    if "batch" not in stops:
        lines += ["", "2-14: no tokens were scheduled in this step; the model did not run"]
    elif "sample" not in stops:
        lines += ["", "13-14: every request is still inside its prefill; nothing was sampled"]
    return "\n".join(lines) + "\n"
