"""The runner's LoRA state: which adapter each device slot holds, which slot each request
reads, and the per-token mask every LoRA layer applies (``lora/layers.py``).

Invariant: a slot holding an adapter that a running request uses is never overwritten. The
scheduler admits at most ``max_loras`` distinct adapters among running requests, so a new
request's adapter always finds its slot, an empty one, or one whose adapter no request uses
(the least recently used such slot is taken).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedserve.config import LoRAConfig
from pagedserve.layers.linear import LinearBase
from pagedserve.lora.adapter import LoRAAdapter, load_adapter
from pagedserve.lora.layers import LoRASlice, LoRAWeights
from pagedserve.lora.request import LoRARequest
from pagedserve.platform import platform_for
from pagedserve.worker.staging import host_to_device

logger = logging.getLogger(__name__)

NO_ADAPTER = -1
"""A request (or token) without an adapter: its mask row is all zero."""

# The model's fused linear layers and the adapter modules each is made of, in row order.
_LAYER_SLICES = {
    "qkv_proj": [LoRASlice("q_proj", "q"), LoRASlice("k_proj", "k"), LoRASlice("v_proj", "v")],
    "o_proj": [LoRASlice("o_proj", None)],
    "gate_up_proj": [LoRASlice("gate_proj", 0), LoRASlice("up_proj", 1)],
    "down_proj": [LoRASlice("down_proj", None)],
}
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


def attach_lora_layers(
    model: nn.Module, config: LoRAConfig, token_mask: torch.Tensor
) -> dict[int, list[LoRAWeights]]:
    """Give every decoder linear layer of ``model`` its LoRA slots; decoder layer index ->
    its layers' slots."""
    layers: dict[int, list[LoRAWeights]] = {}
    for name, module in model.named_modules():
        match = _LAYER_NAME.search(name)
        if match is None or not isinstance(module, LinearBase):
            continue
        slices = _LAYER_SLICES.get(match.group(2))
        if slices is None:
            continue
        module.lora = LoRAWeights(module, slices, config.max_loras, config.max_lora_rank,
                                  token_mask)
        layers.setdefault(int(match.group(1)), []).append(module.lora)
    if not layers:
        raise ValueError("enable_lora: the model has no decoder linear layers to adapt")
    return layers


def lora_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The model's dtype, except bf16 where the device has no fast bf16 matmul (a CPU without
    AVX512-BF16 or AMX): fp32 there, where torch's bf16 matmul of these thin shapes is
    emulated and several times slower than fp32's."""
    if dtype == torch.bfloat16 and not platform_for(device).native_bf16():
        return torch.float32
    return dtype


class LoRASlots:
    """Adapter slots on the device, adapters cached on the host, requests' slots."""

    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        config: LoRAConfig,
        max_num_reqs: int,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.hf_config = hf_config
        self.config = config
        self.device = device
        self.token_mask = torch.zeros(max_num_tokens, config.max_loras,
                                      dtype=lora_dtype(dtype, device),
                                      device=device)  # [max_num_tokens, max_loras]
        self.layers = attach_lora_layers(model, config, self.token_mask)
        self.slot_ids = torch.arange(config.max_loras, device=device)  # [max_loras]
        self.adapter_in_slot: list[int | None] = [None] * config.max_loras
        """lora_int_id held by each device slot."""
        self.users = [0] * config.max_loras
        """Requests with a request slot that read each device slot."""
        self.last_used = [0] * config.max_loras
        self.clock = 0
        self.slot_of_request = np.full(max_num_reqs, NO_ADAPTER,
                                       dtype=np.int64)  # [max_num_reqs]
        self.host_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        """lora_int_id -> adapter read from its folder, least recently used first."""
        self.step_uses_adapters = False
        """Whether a token of the step being prepared reads an adapter slot."""

    # ---- requests --------------------------------------------------------------------

    def add_request(self, req_slot: int, lora_request: LoRARequest | None) -> None:
        """Point request slot ``req_slot`` at its adapter's device slot (loading it there)."""
        if lora_request is None:
            self.slot_of_request[req_slot] = NO_ADAPTER
            return
        slot = self._activate(lora_request)
        self.users[slot] += 1
        self.slot_of_request[req_slot] = slot

    def remove_request(self, req_slot: int) -> None:
        slot = int(self.slot_of_request[req_slot])
        if slot != NO_ADAPTER:
            self.users[slot] -= 1
        self.slot_of_request[req_slot] = NO_ADAPTER

    def _activate(self, lora_request: LoRARequest) -> int:
        self.clock += 1
        lora_id = lora_request.lora_int_id
        if lora_id in self.adapter_in_slot:
            slot = self.adapter_in_slot.index(lora_id)
        else:
            free = [s for s in range(self.config.max_loras) if self.users[s] == 0]
            if not free:
                raise RuntimeError(f"max_loras: all {self.config.max_loras} adapter slots are "
                                   f"in use; the scheduler admits no more adapters than that")
            slot = min(free, key=lambda s: (self.adapter_in_slot[s] is not None,
                                            self.last_used[s]))
            self._load_into(slot, self._host_adapter(lora_request))
        self.last_used[slot] = self.clock
        return slot

    def _host_adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        lora_id = lora_request.lora_int_id
        adapter = self.host_cache.pop(lora_id, None)
        if adapter is None or adapter.lora_request.lora_path != lora_request.lora_path:
            adapter = load_adapter(lora_request, self.hf_config, self.config.max_lora_rank)
            logger.info("LoRA adapter %s (id %d) read from %s: rank %d, %.1f MiB",
                        lora_request.lora_name, lora_id, lora_request.lora_path, adapter.rank,
                        adapter.nbytes / 2**20)
        self.host_cache[lora_id] = adapter
        while len(self.host_cache) > self.config.num_cpu_loras:
            self.host_cache.popitem(last=False)
        return adapter

    def _load_into(self, slot: int, adapter: LoRAAdapter) -> None:
        by_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (index, module), w in adapter.modules.items():
            by_layer.setdefault(index, {})[module] = (w.lora_a, w.lora_b)
        for layer_index, layer_slots in self.layers.items():
            for lora in layer_slots:  # a layer the adapter leaves alone: its slot cleared
                lora.set_slot(slot, by_layer.get(layer_index, {}))
        self.adapter_in_slot[slot] = adapter.lora_request.lora_int_id

    # ---- steps -----------------------------------------------------------------------

    def prepare_step(
        self, idx_mapping_np: np.ndarray, query_lens_np: np.ndarray, num_tokens_padded: int
    ) -> None:
        """Fill ``token_mask[:num_tokens_padded]`` for the step: each token's row selects its
        request's slot; padding rows select none. ``idx_mapping_np`` [num_reqs] (batch row ->
        request slot), ``query_lens_np`` [num_reqs] (tokens per batch row)."""
        per_row = self.slot_of_request[idx_mapping_np]  # [num_reqs]
        self.step_uses_adapters = bool((per_row != NO_ADAPTER).any())
        token_slots = np.full(num_tokens_padded, NO_ADAPTER, dtype=np.int64)
        num_tokens = int(query_lens_np.sum())
        token_slots[:num_tokens] = np.repeat(per_row, query_lens_np)  # [num_tokens_padded]
        on_device = host_to_device(token_slots, torch.int64, self.device)
        mask = on_device.unsqueeze(1) == self.slot_ids  # [num_tokens_padded, max_loras]
        self.token_mask[:num_tokens_padded].copy_(mask)


class AdapterFreeForward:
    """A forward that knows no adapters (the CPU's decode step in C) for the steps whose
    tokens use none, the model's own forward for the others: their LoRA deltas are all zero,
    so skipping the layers' slots changes nothing."""

    def __init__(self, fast: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 model: nn.Module, slots: LoRASlots) -> None:
        self.fast = fast
        self.model = model
        self.slots = slots

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        forward = self.model if self.slots.step_uses_adapters else self.fast
        return forward(input_ids, positions)
