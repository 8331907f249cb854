"""GpuBusySampler's busy fraction and energy, with stand-ins for NVML's readers."""

from __future__ import annotations

import itertools
import time

import torch

from pagedserve.entrypoints.bench.gpu_busy import GpuBusySampler, busy_union_us
from pagedserve.entrypoints.bench.throughput import energy_figures


def test_busy_fraction_and_energy_of_a_run() -> None:
    utilization = itertools.cycle([100, 50])  # percent, one per sample
    energy = iter([1000.0, 1450.0])  # the counter before and after, joules
    sampler = GpuBusySampler(torch.device("cpu"), interval_s=0.01,
                             read_utilization=lambda: next(utilization),
                             read_energy_j=lambda: next(energy))
    assert sampler.measure(lambda: time.sleep(0.3) or "done") == "done"
    assert len(sampler.samples) >= 10
    assert 0.70 <= sampler.busy_fraction <= 0.80
    assert sampler.energy_j == 450.0
    assert 450.0 / 0.6 < sampler.mean_power_w <= 450.0 / 0.3
    figures = energy_figures(sampler, num_out=900)
    assert figures["energy_j"] == 450.0 and figures["output_tok_per_j"] == 2.0


def test_no_energy_counter_leaves_the_energy_out() -> None:
    sampler = GpuBusySampler(torch.device("cpu"), interval_s=0.01, read_utilization=lambda: 100)
    sampler.read_energy_j = None  # what nvml_energy_reader gives without NVML
    sampler.measure(lambda: time.sleep(0.05))
    assert sampler.energy_j is None and sampler.mean_power_w is None
    assert energy_figures(sampler, num_out=10) == {}
    assert energy_figures(None, num_out=10) == {}


def test_busy_union_counts_overlapping_kernels_once() -> None:
    assert busy_union_us([(0, 10), (5, 20), (30, 40), (35, 36)]) == 30
