"""Which implementation of the input-preparation ops the runner uses, chosen once at start-up.

CUDA with Triton installed: the Triton kernels of ``pagedserve/kernels/input_prep.py``.
Everything else: the torch reference functions of ``pagedserve/worker/input_prep.py``.
Both sets have the same signatures, so the runner never branches on the device in a step.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.worker import input_prep


@dataclass(frozen=True)
class InputPrepOps:
    name: str
    prepare_prefill_inputs: Callable[..., None]
    prepare_pos_seq_lens: Callable[..., None]
    combine_sampled_tokens: Callable[..., None]
    gather_block_tables: Callable[..., None]
    compute_slot_mappings: Callable[..., None]


def _from_module(name: str, module: object) -> InputPrepOps:
    return InputPrepOps(
        name=name,
        prepare_prefill_inputs=module.prepare_prefill_inputs,
        prepare_pos_seq_lens=module.prepare_pos_seq_lens,
        combine_sampled_tokens=module.combine_sampled_tokens,
        gather_block_tables=module.gather_block_tables,
        compute_slot_mappings=module.compute_slot_mappings,
    )


TORCH_OPS = _from_module("torch", input_prep)


def select_input_prep_ops(device: torch.device) -> InputPrepOps:
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        # Imported here: the module needs triton, which CPU-only installs may lack.
        from pagedserve.kernels import input_prep as triton_input_prep

        return _from_module("triton", triton_input_prep)
    return TORCH_OPS
