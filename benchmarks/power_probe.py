"""Is the card at its power limit while it decodes? Power, SM clock and energy of a step's parts.

    python benchmarks/power_probe.py --out DIR [--seconds 4] [--block-size 16]
        [--workloads attention decode ...]

Each workload is a CUDA graph replayed back to back for SECONDS while a thread reads NVML
every 20 ms (power draw, SM clock, throttle reasons); the energy counter is read at the start
and end of the second half of the run (after the power limiter has settled), which gives the
joules per replay. Workloads, Llama-3-8B shape, bf16, 32 layers (``overlap_probe.py``'s
stack: random weights, no LM head, norms or rotary):
  read: the same caches read by a kernel that only reads (the floor for reading those bytes);
  attention: the batch-256 decode attention alone (engine split-KV launch, context 1500,
             50.3 GB of KV); attention_tma / attention_swapped: the same by the probes'
             persistent kernels (decode_tma.py, decode_swapped.py);
  gemm_256 / gemm_8192: the four linear layers of the 32 layers at 256 / 8,192 rows;
  decode: the decode step's layer stack (both of the above at 256 rows, as a step runs them);
          decode_tma / decode_swapped: with those attentions;
  joint_p256: the decode step with a 256-token prefill chunk in the same GEMMs (its decode
              attention on the varlen kernel, as overlap_probe.py's joint step).
Writes ``power_probe.json``. What it means: BENCHMARKS.md, session 12.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pynvml
import torch
import torch.nn.functional as F
from decode_batch import BLOCK, DECODE_BATCH, HEAD_DIM, HIDDEN, KV_HEADS, LAYERS
from decode_swapped import launch_swapped
from decode_tma import launch_tma
from fusion_probe import _read_kernel
from graph_timing import capture_graph, timed_ms
from overlap_probe import LayerLaunch, Stack

from pagedserve.attention.backends.triton import SPLIT_KV_LAUNCH
from pagedserve.entrypoints.bench.gpu_busy import nvml_energy_reader, nvml_handle
from pagedserve.kernels.paged_attention import DEFAULT_LAUNCH
from pagedserve.kernels.paged_attention_split import paged_attention_split_kv

SAMPLE_S = 0.02
THROTTLE_SW_POWER_CAP = 0x4  # nvmlClocksThrottleReasonSwPowerCap


def _clock_reasons(handle: object) -> int:
    """The bit mask of why the clocks are below their maximum (renamed in newer NVML)."""
    query = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    return (query or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)(handle)


class NvmlSampler:
    """Power (W), SM clock (MHz) and the power-cap throttle flag, sampled in a thread."""

    def __init__(self) -> None:
        device = torch.cuda.current_device()
        self.handle = nvml_handle(device)
        self.read_energy_j = nvml_energy_reader(device)
        if self.handle is None or self.read_energy_j is None:
            raise RuntimeError("power_probe: NVML (nvidia-ml-py) cannot read this card's power")
        self.samples: list[tuple[float, float, float, bool]] = []  # (t, W, MHz, capped)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            watts = pynvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3
            mhz = pynvml.nvmlDeviceGetClockInfo(self.handle, pynvml.NVML_CLOCK_SM)
            reasons = _clock_reasons(self.handle)
            self.samples.append((time.perf_counter(), watts, mhz,
                                 bool(reasons & THROTTLE_SW_POWER_CAP)))

    def __enter__(self) -> NvmlSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(name: str, graph: torch.cuda.CUDAGraph, seconds: float) -> dict:
    """Replay ``graph`` back to back for ``seconds``; figures over the second half."""
    times: list[float] = []
    half_at = time.perf_counter() + seconds / 2
    end_at = half_at + seconds / 2
    with NvmlSampler() as nvml:
        energy_start, replays_start = None, 0
        while (now := time.perf_counter()) < end_at:
            if energy_start is None and now >= half_at:
                torch.cuda.synchronize()
                energy_start, replays_start, t_start = nvml.read_energy_j(), len(times), now
            times.append(timed_ms(graph.replay))
        energy = nvml.read_energy_j() - energy_start
        settled = [s for s in nvml.samples if s[0] >= t_start]
    n = len(times) - replays_start
    half = sorted(times[replays_start:])
    row = {
        "replays": len(times), "first_ms": times[0], "median_ms": half[len(half) // 2],
        "mean_power_w": sum(s[1] for s in settled) / len(settled),
        "mean_sm_clock_mhz": sum(s[2] for s in settled) / len(settled),
        "power_capped_share": sum(s[3] for s in settled) / len(settled),
        "joules_per_replay": energy / n,
    }
    print(f"{name}: {row['median_ms']:.2f} ms per replay (first {row['first_ms']:.2f}), "
          f"{row['mean_power_w']:.0f} W, SM {row['mean_sm_clock_mhz']:.0f} MHz, power-capped "
          f"{row['power_capped_share']:.0%} of samples, {row['joules_per_replay']:.2f} J per replay",
          flush=True)
    return row


def attention_layer(stack: Stack, kind: str) -> LayerLaunch:
    """One layer's decode attention: ``engine`` (the engine's split-KV kernel and launch for
    this batch, one segment per request), or by the probes' persistent kernels: ``tma``
    (decode_tma.py, one program per (request, kv head), 4 warps, 3 stages, a cache block per
    copy) or ``swapped`` (decode_swapped.py, 2 programs per SM, 64-key tiles, 4 warps, 3
    stages: session 10's fastest)."""
    decode = stack.decode
    if kind == "engine":
        return lambda out, q, layer: paged_attention_split_kv(
            q, decode.caches[layer], decode.block_table, decode.query_start_loc,
            decode.seq_lens, DECODE_BATCH, HEAD_DIM**-0.5, out, 1, SPLIT_KV_LAUNCH)
    if kind == "tma":
        descriptors = decode.descriptors()
        return lambda out, q, layer: launch_tma(
            out, q, decode.caches[layer], decode.block_table, decode.seq_lens,
            DECODE_BATCH * KV_HEADS, 4, 3, 1, descriptors[layer])
    return lambda out, q, layer: launch_swapped(
        out, q, decode.caches[layer], decode.block_table, decode.seq_lens, 264, 64, 4, 3)


def attention_alone(stack: Stack, launch_layer: LayerLaunch) -> Callable[[], None]:
    decode = stack.decode
    return lambda: [launch_layer(decode.out, decode.q, layer) for layer in range(LAYERS)]


def read_caches(stack: Stack) -> Callable[[], None]:
    """The 32 layers' KV caches (all their blocks) read by fusion_probe.py's read-only kernel
    (2 programs per SM, 16 KB per load: its fastest, 4.50-4.54 TB/s in session 11)."""
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    partial = torch.empty(programs, dtype=torch.float32, device="cuda")
    flat = [cache.view(-1) for cache in stack.decode.caches]
    if any(x.numel() % 8192 for x in flat):  # the kernel's loads are unmasked
        raise ValueError("read_caches: a cache's size is not a multiple of 8192 elements")
    return lambda: [_read_kernel[(programs,)](x, partial, x.numel(), G=programs, BLOCK=8192,
                                              num_warps=8) for x in flat]


def workloads(stack: Stack) -> dict[str, Callable[[], object]]:
    x_d = torch.randn(DECODE_BATCH, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.1
    x_p = torch.randn(256, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.1
    engine, tma, swapped = (attention_layer(stack, k) for k in ("engine", "tma", "swapped"))

    def gemms(rows: int) -> Callable[[], object]:
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")  # [rows, k]
                  for k in {w.shape[1] for w in stack.layers[0]}}
        def run() -> None:
            for layer in stack.layers:
                for w in layer:  # [out, in]
                    F.linear(inputs[w.shape[1]], w)
        return run

    return {
        "read": read_caches(stack),
        "attention": attention_alone(stack, engine),
        "attention_tma": attention_alone(stack, tma),
        "attention_swapped": attention_alone(stack, swapped),
        "gemm_256": gemms(256),
        "gemm_8192": gemms(8192),
        "decode": stack.persistent_branch(x_d, engine),
        "decode_tma": stack.persistent_branch(x_d, tma),
        "decode_swapped": stack.persistent_branch(x_d, swapped),
        "joint_p256": stack.joint(torch.cat([x_d, x_p]), stack.prefill_meta(256)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--block-size", type=int, default=BLOCK, help="the cache's tokens per block")
    parser.add_argument("--workloads", nargs="*", help="names to run (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    stack = Stack(DEFAULT_LAUNCH, args.block_size)
    report = {"block_size": args.block_size}
    for name, fn in workloads(stack).items():
        if args.workloads and name not in args.workloads:
            continue
        graph = capture_graph(fn)
        report[name] = measure(name, graph, args.seconds)
        del graph
        time.sleep(1.0)  # let the card cool back towards idle between workloads
        (args.out / "power_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
