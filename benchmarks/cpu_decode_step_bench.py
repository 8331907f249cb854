"""The CPU's C decode step on its own: every decoder layer of one step, random weights.

    python benchmarks/cpu_decode_step_bench.py [--requests 64] [--context 256,320]
        [--layers 30] [--dtype bfloat16] [--threads 1] [--reps 15]
        [--source A/cpu_decode.c --source B/cpu_decode.c]

Builds the default model's decoder layers (hidden 576, 9 query heads / 3 KV heads of 64,
intermediate 1,536) with random weights, their copies packed in panels (as the engine makes
them from ``PANEL_MIN_ROWS`` requests on), one paged KV cache per layer with each request's
blocks scattered through it (cpu_attention_bench.py's), contexts uniform in the given range;
then calls ``decode_step`` (``model/cpu_decode.c``) on ``--requests`` rows, ``--reps`` times,
and prints the min and median of a step's time. The embedding and the LM head are not part of
it.

``--source`` (repeatable): build these copies of ``cpu_decode.c``, each with the versions of
the headers beside it (copy ``layers/*.h`` and ``cpu_native/*.h`` there), and alternate them
rep by rep: the machine's speed drifts, so versions are compared within one window.
"""

from __future__ import annotations

import argparse
import ctypes
from collections.abc import Callable

import torch
from cpu_attention_bench import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    add_decode_batch_arguments,
    alternate_timings,
    decode_seq_lens,
    paged_caches,
    print_timings,
    start_timing,
)

from pagedserve.layers.panel_pack import PANEL_MIN_ROWS, panel_pack
from pagedserve.model.cpu_decode import SOURCE, LayerTable, ModelTable, decode_step_of

HIDDEN, INTERMEDIATE, MAX_POSITION = 576, 1536, 2048


def layer_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One layer's weights (scaled so activations stay of order 1) and their panels."""
    qkv_n = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    shapes = {"qkv": (qkv_n, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
              "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}
    w = {name: (torch.randn(shape) * shape[1] ** -0.5).to(dtype)
         for name, shape in shapes.items()}
    w.update({f"{name}_panels": panel_pack(w[name]) for name in shapes})
    w.update(norm=torch.ones(HIDDEN, dtype=dtype))
    return w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_decode_batch_arguments(p, SOURCE.name)
    args = p.parse_args()
    sources = args.source or [SOURCE]
    steps = [decode_step_of(s.resolve()) for s in sources]
    dtype = start_timing(args)
    low, high, seq_lens = decode_seq_lens(args)  # seq_lens int32 [R]
    caches = paged_caches(args.layers, seq_lens, dtype)
    weights = [layer_weights(dtype) for _ in range(args.layers)]
    layers = (LayerTable * args.layers)(*(
        LayerTable(w["norm"].data_ptr(), w["norm"].data_ptr(), w["qkv"].data_ptr(), None, None,
               None, w["o"].data_ptr(), None, w["gate_up"].data_ptr(), None,
               w["down"].data_ptr(), None, cache[0].data_ptr(), cache[1].data_ptr(),
               w["qkv_panels"].data_ptr(), w["o_panels"].data_ptr(),
               w["gate_up_panels"].data_ptr(), w["down_panels"].data_ptr())
        for w, (cache, _) in zip(weights, caches, strict=True)))
    cos_sin = torch.randn(MAX_POSITION, HEAD_DIM).to(dtype)
    model = ModelTable(args.layers, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK,
                   caches[0][0].stride(1), MAX_POSITION, 1e-5, 0.0, HEAD_DIM**-0.5,
                   int(dtype == torch.bfloat16), PANEL_MIN_ROWS, cos_sin.data_ptr(),
                   weights[0]["norm"].data_ptr(), layers)
    # Every layer's block table is its own; the step takes one: the first layer's, whose
    # blocks exist in every cache (each has as many). Each request writes its last slot.
    table = caches[0][1]
    positions = (seq_lens - 1).to(torch.int64)
    slots = (table.gather(1, (positions // BLOCK).view(-1, 1).to(torch.int64)).view(-1)
             .to(torch.int64) * BLOCK + positions % BLOCK)
    embedded = torch.randn(args.requests, HIDDEN).to(dtype)
    hidden = embedded.clone()

    def step(fn: Callable[..., int]) -> None:
        hidden.copy_(embedded)
        status = fn(ctypes.byref(model), hidden.data_ptr(), args.requests,
                    positions.data_ptr(), slots.data_ptr(), table.data_ptr(), table.stride(0),
                    seq_lens.data_ptr(), args.threads)  # fmt: skip
        if status != 0:
            raise RuntimeError(f"decode_step: status {status}")

    times = alternate_timings(steps, step, args.reps)
    print(f"{args.requests} request(s) at context {low}..{high}, {args.layers} layers, "
          f"{args.dtype}, {args.threads} thread(s):")
    print_timings(sources, times, " a step")


if __name__ == "__main__":
    main()
