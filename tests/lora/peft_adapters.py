"""Random PEFT LoRA adapters of the tests' tiny models, and transformers' side of each."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIGS: dict[str, dict[str, Any]] = {
    # name: peft.LoraConfig keywords
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"]),
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp": dict(r=2, lora_alpha=4, target_modules=["down_proj", "up_proj"]),
}


def save_adapter(base: Any, folder: Path, seed: int, **config: Any) -> Any:
    """A PEFT adapter of ``base`` with random (non-zero) A and B saved in ``folder``; returns
    the base model with the adapter merged in (transformers' side of a comparison)."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        init_lora_weights=False, **config))
    with torch.no_grad():  # large enough to change the greedy tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()
