"""Read a PEFT LoRA adapter folder into per-(layer, module) tensors (vLLM's ``LoRAModel``).

A folder is what ``peft``'s ``save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``adapter_model.bin``). Only what vLLM serves is accepted:
plain LoRA on the attention and MLP projections of the decoder layers. Anything that would
change the output in a way the engine does not apply (DoRA, biases, per-module alphas, extra
trained modules, embedding adapters) is refused at load, never silently dropped.

``check_adapter`` validates from the config and the safetensors header only, so a request
naming a bad adapter fails before any tensor is read; ``load_adapter`` then reads the tensors
and folds the scaling into ``lora_b``, so the kernels compute ``x @ A^T @ B^T`` and nothing more.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

from pagedserve.lora.request import LoRARequest

LORA_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
"""The linear layers an adapter may target (vLLM's default set for Llama-family models)."""

_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_CONFIG_FILE = "adapter_config.json"
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
"""In order of preference: safetensors reads its header without the data."""
ADAPTER_FILES = (_CONFIG_FILE, *_WEIGHT_FILES)
"""Every file of a folder that the reader may read."""
_TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight"
)
"""``base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight``: layer, parent,
module, A or B; the adapter name (``.default``) is present in some saves and dropped in others."""


@dataclass(frozen=True, eq=False)
class LoRAModuleWeights:
    """One module's low-rank pair: the delta of ``y = x @ W^T`` is ``x @ lora_a^T @ lora_b^T``.

    ``eq=False``: identity equality, since tensors do not compare to a bool."""

    lora_a: torch.Tensor  # [rank, in_features], the checkpoint's dtype
    lora_b: torch.Tensor  # [out_features, rank], already multiplied by the module's scaling


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """An adapter read from its folder, on the CPU, ready to copy into a device slot."""

    lora_request: LoRARequest
    rank: int
    """The largest rank over its modules (``rank_pattern`` may give modules different ones)."""
    modules: dict[tuple[int, str], LoRAModuleWeights]
    """(decoder layer index, module name from ``LORA_MODULES``) -> weights; absent: no delta."""

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors (logged when the adapter is read)."""
        return sum(t.numel() * t.element_size()
                   for w in self.modules.values() for t in (w.lora_a, w.lora_b))


@dataclass(frozen=True)
class _Pair:
    name_a: str
    name_b: str
    rank: int


def _fail(folder: Path, detail: str) -> ValueError:
    return ValueError(f"lora_path: {folder}: {detail}")


def _read_config(folder: Path) -> dict[str, Any]:
    """The adapter's config, refused where it asks for something the engine does not apply."""
    if not folder.is_dir():
        raise ValueError(f"lora_path: {folder} is not a folder")
    path = folder / _CONFIG_FILE
    if not path.is_file():
        raise _fail(folder, f"no {_CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(folder, f"{_CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise _fail(folder, f"{_CONFIG_FILE} must hold a JSON object")
    refusals = [
        ("peft_type", config.get("peft_type", "LORA") != "LORA",
         f"{config.get('peft_type')!r} is not supported, only LORA"),
        ("use_dora", bool(config.get("use_dora")), "DoRA adapters are not supported"),
        ("bias", config.get("bias", "none") not in (None, "none"),
         f"{config.get('bias')!r}: trained biases are not supported, only 'none'"),
        ("lora_bias", bool(config.get("lora_bias")), "biases on lora_B are not supported"),
        ("fan_in_fan_out", bool(config.get("fan_in_fan_out")),
         "transposed (Conv1D-style) weights are not supported"),
        ("modules_to_save", bool(config.get("modules_to_save")),
         f"{config.get('modules_to_save')!r}: fully trained extra modules are not supported"),
        ("alpha_pattern", bool(config.get("alpha_pattern")),
         "per-module alphas are not supported"),
        ("use_qalora", bool(config.get("use_qalora")), "QALoRA adapters are not supported"),
        ("layer_replication", bool(config.get("layer_replication")),
         "adapters over replicated layers are not supported"),
        ("r", isinstance(config.get("r"), bool) or not isinstance(config.get("r"), int)
         or config["r"] < 1, f"expected an int >= 1, got {config.get('r')!r}"),
        ("lora_alpha", isinstance(config.get("lora_alpha"), bool)
         or not isinstance(config.get("lora_alpha"), int | float),
         f"expected a number, got {config.get('lora_alpha')!r}"),
        ("use_rslora", not isinstance(config.get("use_rslora", False), bool),
         f"expected a bool, got {config.get('use_rslora')!r}"),
    ]
    for key, refused, why in refusals:
        if refused:
            raise _fail(folder, f"{key}: {why}")
    return config


def _weights_file(folder: Path) -> Path:
    for name in _WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise _fail(folder, f"no weights file ({' or '.join(_WEIGHT_FILES)})")


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors header; no tensor data is read."""
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (OSError, SafetensorError) as e:
        raise _fail(file.parent, f"cannot read {file.name} ({e})") from e


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:
        raise _fail(file.parent, f"cannot read {file.name} ({e})") from e
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise _fail(file.parent, f"{file.name} does not hold a dict of named tensors")
    return state


def _module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """Module -> (in_features, out_features) of the base model's full (unsharded) layers."""
    # On use: the model package may come to import the lora package.
    from pagedserve.model.llama import head_dim_of, num_kv_heads_of

    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    q_out = hf_config.num_attention_heads * head_dim_of(hf_config)
    kv_out = num_kv_heads_of(hf_config) * head_dim_of(hf_config)
    return {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def _plan(folder: Path, shapes: dict[str, tuple[int, ...]], hf_config: Any,
          max_lora_rank: int) -> dict[tuple[int, str], _Pair]:
    """Pair every tensor with its (layer, module) and check its shape against the base model;
    refuse any tensor that is not a lora_A / lora_B of ``LORA_MODULES``."""
    expected = _module_shapes(hf_config)
    found: dict[tuple[int, str, str], str] = {}
    for name in sorted(shapes):
        m = _TENSOR_NAME.fullmatch(name)
        if m is None or m[3] not in LORA_MODULES or _PARENT[m[3]] != m[2]:
            raise _fail(folder, f"tensor {name}: unsupported (LoRA is served on "
                                f"{', '.join(LORA_MODULES)} of the decoder layers only)")
        layer, module, side = int(m[1]), m[3], m[4]
        if layer >= hf_config.num_hidden_layers:
            raise _fail(folder, f"tensor {name}: layer {layer} is out of range; the base model "
                                f"has {hf_config.num_hidden_layers} layers")
        if (layer, module, side) in found:
            raise _fail(folder, f"tensor {name}: duplicates {found[layer, module, side]}")
        found[layer, module, side] = name
    if not found:
        raise _fail(folder, "the adapter holds no LoRA tensors")
    pairs: dict[tuple[int, str], _Pair] = {}
    for layer, module in sorted({(layer, module) for layer, module, _ in found}):
        name_a, name_b = found.get((layer, module, "A")), found.get((layer, module, "B"))
        if name_a is None or name_b is None:
            raise _fail(folder, f"layer {layer} {module}: has {name_a or name_b} but no "
                                f"lora_{'A' if name_a is None else 'B'}")
        shape_a, shape_b = shapes[name_a], shapes[name_b]
        in_features, out_features = expected[module]
        rank = shape_a[0] if len(shape_a) == 2 else 0
        if rank < 1 or shape_a[1] != in_features:
            raise _fail(folder, f"tensor {name_a}: expected shape [rank, {in_features}], got "
                                f"{list(shape_a)}")
        if shape_b != (out_features, rank):
            raise _fail(folder, f"tensor {name_b}: expected shape [{out_features}, {rank}], got "
                                f"{list(shape_b)}")
        if rank > max_lora_rank:
            raise _fail(folder, f"LoRA rank {rank} is greater than max_lora_rank "
                                f"{max_lora_rank} ({name_a})")
        pairs[layer, module] = _Pair(name_a, name_b, rank)
    return pairs


def check_adapter(lora_request: LoRARequest, hf_config: Any, max_lora_rank: int) -> None:
    """Validate an adapter without reading its tensor data (safetensors: header only), so a
    bad adapter is refused when it is first named instead of when a step needs it."""
    folder = Path(lora_request.lora_path)
    _read_config(folder)
    file = _weights_file(folder)
    if file.suffix == ".bin":  # pickles have no header: the tensors are the only shapes
        shapes = {n: tuple(t.shape) for n, t in _load_bin(file).items()}
    else:
        shapes = _header_shapes(file)
    _plan(folder, shapes, hf_config, max_lora_rank)


def load_adapter(lora_request: LoRARequest, hf_config: Any, max_lora_rank: int) -> LoRAAdapter:
    """``check_adapter``'s checks, then the tensors, with each module's scaling folded into
    ``lora_b`` (``lora_alpha / rank``, or ``/ sqrt(rank)`` with rsLoRA: the rank is the
    module's own, as peft computes it)."""
    folder = Path(lora_request.lora_path)
    config = _read_config(folder)
    file = _weights_file(folder)
    if file.suffix == ".bin":
        tensors = _load_bin(file)
        pairs = _plan(folder, {n: tuple(t.shape) for n, t in tensors.items()}, hf_config,
                      max_lora_rank)
    else:
        pairs = _plan(folder, _header_shapes(file), hf_config, max_lora_rank)
        tensors = safetensors.torch.load_file(file, device="cpu")
    modules: dict[tuple[int, str], LoRAModuleWeights] = {}
    for key, pair in pairs.items():
        root = math.sqrt(pair.rank) if config.get("use_rslora") else pair.rank
        scaling = config["lora_alpha"] / root
        lora_b = tensors[pair.name_b]  # [out_features, rank]
        # the product in fp32: a bf16 rounding of the scaled values, not of each factor
        wide = torch.promote_types(lora_b.dtype, torch.float32)
        lora_b = (lora_b.to(wide) * scaling).to(lora_b.dtype).contiguous()
        modules[key] = LoRAModuleWeights(tensors[pair.name_a].contiguous(), lora_b)
    return LoRAAdapter(lora_request, max(p.rank for p in pairs.values()), modules)
