"""Reading PEFT adapter folders: tensors and scaling as peft applies them, and every refusal.

Adapters are saved by peft itself from a tiny random Llama whose shapes tell the modules
apart (head_dim != hidden / heads, grouped KV heads, intermediate != hidden), so a shape
computed from the wrong config field fails.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.lora import adapter as adapter_module
from pagedserve.lora.adapter import LORA_MODULES, LoRAAdapter, check_adapter, load_adapter
from pagedserve.lora.request import LoRARequest

HF_CONFIG = LlamaConfig(
    vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)
SHAPES = {  # module -> (in_features, out_features)
    "q_proj": (32, 64), "k_proj": (32, 32), "v_proj": (32, 32), "o_proj": (64, 32),
    "gate_proj": (32, 48), "up_proj": (32, 48), "down_proj": (48, 32),
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
PREFIX = "base_model.model.model.layers"
Q0_B = f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"


def save_adapter(folder: Path, hf_config: LlamaConfig = HF_CONFIG, safe: bool = True,
                 **lora: Any) -> tuple[PeftModel, Path]:
    """peft's own save of an adapter with non-zero A and B on every module of LORA_MODULES."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(hf_config).eval()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_MODULES),
                        init_lora_weights=False, **lora)
    model = get_peft_model(base, config)
    model.save_pretrained(folder, safe_serialization=safe)
    return model, folder


def request(folder: Path) -> LoRARequest:
    return LoRARequest("sql", 1, str(folder))


def peft_modules(model: PeftModel) -> dict[tuple[int, str], Any]:
    """(layer, module) -> peft's lora.Linear."""
    layers = model.base_model.model.model.layers
    return {(i, name): getattr(layer.self_attn if name in ATTENTION else layer.mlp, name)
            for i, layer in enumerate(layers) for name in LORA_MODULES}


def assert_matches_peft(adapter: LoRAAdapter, model: PeftModel) -> None:
    """Every module present, A as saved, B times peft's own scaling for that module."""
    expected = peft_modules(model)
    assert set(adapter.modules) == set(expected)
    for key, module in expected.items():
        weights, (in_features, out_features) = adapter.modules[key], SHAPES[key[1]]
        rank = module.r["default"]
        assert weights.lora_a.shape == (rank, in_features)
        assert weights.lora_b.shape == (out_features, rank)
        torch.testing.assert_close(weights.lora_a, module.lora_A["default"].weight)
        torch.testing.assert_close(
            weights.lora_b, module.lora_B["default"].weight * module.scaling["default"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[PeftModel, Path]:
    return save_adapter(tmp_path_factory.mktemp("adapter"))


@pytest.fixture
def copy(saved: tuple[PeftModel, Path], tmp_path: Path) -> Path:
    """A private copy of the saved adapter, to break."""
    return Path(shutil.copytree(saved[1], tmp_path / "adapter"))


def edit_config(folder: Path, **changes: Any) -> None:
    """Set keys (a value of ... deletes the key)."""
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            del config[key]
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def edit_tensors(folder: Path, **changes: torch.Tensor | None) -> None:
    """Set tensors by name (None deletes one); names with dots are passed via ``**{...}``."""
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    for name, tensor in changes.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, path)


def test_load_matches_peft(saved: tuple[PeftModel, Path]) -> None:
    model, folder = saved
    adapter = load_adapter(request(folder), HF_CONFIG, max_lora_rank=8)
    assert adapter.rank == 4 and adapter.lora_request == request(folder)
    assert len(adapter.modules) == 2 * len(LORA_MODULES)
    assert_matches_peft(adapter, model)
    q = peft_modules(model)[1, "q_proj"]
    assert q.scaling["default"] == 2.0  # lora_alpha / r
    assert adapter.nbytes == sum(
        4 * (SHAPES[m][0] + SHAPES[m][1]) * 4 for _, m in adapter.modules)  # fp32, r = 4

    # the delta peft adds to the base layer's output is x @ A^T @ B^T with our tensors
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))  # [tokens, hidden]
    with torch.no_grad():
        delta = q(x) - q.base_layer(x)  # [tokens, 64]
    ours = adapter.modules[1, "q_proj"]
    torch.testing.assert_close(x @ ours.lora_a.T @ ours.lora_b.T, delta)
    assert delta.abs().max() > 1e-3  # a real delta, not two zeros


def test_rslora_and_per_module_ranks(tmp_path: Path) -> None:
    """rsLoRA divides by sqrt(rank), each module by its own rank (rank_pattern)."""
    model, folder = save_adapter(tmp_path, use_rslora=True, rank_pattern={"down_proj": 2})
    adapter = load_adapter(request(folder), HF_CONFIG, max_lora_rank=4)
    assert adapter.rank == 4
    assert adapter.modules[0, "down_proj"].lora_a.shape == (2, 48)
    modules = peft_modules(model)
    assert modules[0, "q_proj"].scaling["default"] == pytest.approx(8 / 2)
    assert modules[0, "down_proj"].scaling["default"] == pytest.approx(8 / math.sqrt(2))
    assert_matches_peft(adapter, model)


def test_bin_weights(tmp_path: Path) -> None:
    model, folder = save_adapter(tmp_path, safe=False)
    assert (folder / "adapter_model.bin").exists()
    assert not (folder / "adapter_model.safetensors").exists()
    check_adapter(request(folder), HF_CONFIG, max_lora_rank=4)
    assert_matches_peft(load_adapter(request(folder), HF_CONFIG, max_lora_rank=4), model)


def test_adapter_name_in_tensor_names_and_dtype_kept(saved: tuple[PeftModel, Path],
                                                     copy: Path) -> None:
    """``.lora_A.default.weight`` names load too; bf16 stays bf16, scaled in fp32."""
    path = copy / "adapter_model.safetensors"
    tensors = load_file(path)
    save_file({n.replace(".weight", ".default.weight"): t.bfloat16() for n, t in tensors.items()},
              path)
    adapter = load_adapter(request(copy), HF_CONFIG, max_lora_rank=4)
    weights = adapter.modules[0, "q_proj"]
    assert weights.lora_a.dtype == weights.lora_b.dtype == torch.bfloat16
    torch.testing.assert_close(weights.lora_b, (tensors[Q0_B].bfloat16().float() * 2).bfloat16())
    assert adapter.nbytes == load_adapter(request(saved[1]), HF_CONFIG, 4).nbytes // 2


def test_config_without_head_dim_or_kv_heads(tmp_path: Path) -> None:
    """head_dim falls back to hidden / heads and KV heads to the attention heads."""
    hf_config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48,
                            num_hidden_layers=1, num_attention_heads=4)
    _, folder = save_adapter(tmp_path, hf_config=hf_config)
    bare = SimpleNamespace(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, head_dim=None)
    check_adapter(request(folder), bare, max_lora_rank=4)
    assert load_adapter(request(folder), bare, max_lora_rank=4).modules[0, "k_proj"] \
        .lora_b.shape == (32, 4)
    o_proj_a = "o_proj.lora_A.weight: expected shape [rank, 64]"  # 4 heads of 16
    with pytest.raises(ValueError, match=re.escape(o_proj_a)):
        check_adapter(request(folder), HF_CONFIG, max_lora_rank=4)


def test_check_reads_no_tensor_data(saved: tuple[PeftModel, Path], copy: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tensor data read")

    monkeypatch.setattr(adapter_module.safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(adapter_module.torch, "load", refuse)
    check_adapter(request(saved[1]), HF_CONFIG, max_lora_rank=4)
    edit_tensors(copy, **{Q0_B: torch.zeros(65, 4)})
    with pytest.raises(ValueError, match=re.escape(f"{Q0_B}: expected shape [64, 4], got [65, 4]")):
        check_adapter(request(copy), HF_CONFIG, max_lora_rank=4)


def test_rank_above_max_lora_rank(saved: tuple[PeftModel, Path]) -> None:
    for check in (check_adapter, load_adapter):
        with pytest.raises(ValueError, match="LoRA rank 4 is greater than max_lora_rank 2"):
            check(request(saved[1]), HF_CONFIG, 2)


@pytest.mark.parametrize(("changes", "match"), [
    ({"peft_type": "PREFIX_TUNING"}, "peft_type: 'PREFIX_TUNING' is not supported"),
    ({"use_dora": True}, "use_dora: DoRA"),
    ({"bias": "lora_only"}, "bias: 'lora_only'"),
    ({"lora_bias": True}, "lora_bias:"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out:"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save: \['lm_head'\]"),
    ({"alpha_pattern": {"q_proj": 16}}, "alpha_pattern: per-module alphas are not supported"),
    ({"use_qalora": True}, "use_qalora:"),
    ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication:"),
    ({"r": ...}, "r: expected an int >= 1, got None"),
    ({"r": 0}, "r: expected an int >= 1, got 0"),
    ({"r": True}, "r: expected an int >= 1, got True"),
    ({"lora_alpha": ...}, "lora_alpha: expected a number, got None"),
    ({"lora_alpha": "8"}, "lora_alpha: expected a number, got '8'"),
    ({"use_rslora": "yes"}, "use_rslora: expected a bool"),
])
def test_config_refusals(copy: Path, changes: dict[str, Any], match: str) -> None:
    edit_config(copy, **changes)
    for check in (check_adapter, load_adapter):
        with pytest.raises(ValueError, match=f"^lora_path: {re.escape(str(copy))}: {match}"):
            check(request(copy), HF_CONFIG, 8)


def test_config_accepted_variants(saved: tuple[PeftModel, Path], copy: Path) -> None:
    """Keys at their harmless values, float alpha, and no peft_type / bias at all."""
    edit_config(copy, peft_type=..., bias=..., lora_alpha=8.0, modules_to_save=[],
                alpha_pattern={}, layers_to_transform=[0, 1])
    assert_matches_peft(load_adapter(request(copy), HF_CONFIG, 4), saved[0])


@pytest.mark.parametrize(("text", "match"), [
    ("[1, 2]", "adapter_config.json must hold a JSON object"),
    ("{'r': 4", "adapter_config.json is not valid JSON"),
])
def test_config_file_refusals(copy: Path, text: str, match: str) -> None:
    (copy / "adapter_config.json").write_text(text)
    with pytest.raises(ValueError, match=f"^lora_path: .*{match}"):
        check_adapter(request(copy), HF_CONFIG, 8)


def test_missing_files(copy: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^lora_path: .*nowhere is not a folder"):
        check_adapter(request(tmp_path / "nowhere"), HF_CONFIG, 8)
    (copy / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="^lora_path: .*no weights file"):
        load_adapter(request(copy), HF_CONFIG, 8)
    (copy / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="^lora_path: .*no adapter_config.json"):
        check_adapter(request(copy), HF_CONFIG, 8)


A0 = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(("changes", "match"), [
    ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)},
     "tensor base_model.model.lm_head.lora_A.weight: unsupported"),
    ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 32)},
     "tensor base_model.model.model.embed_tokens.lora_embedding_A: unsupported"),
    ({f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector": torch.zeros(64)},
     f"tensor {PREFIX}.0.self_attn.q_proj.lora_magnitude_vector: unsupported"),
    ({f"{PREFIX}.0.mlp.q_proj.lora_A.weight": torch.zeros(4, 32)},  # wrong parent
     f"tensor {PREFIX}.0.mlp.q_proj.lora_A.weight: unsupported"),
    ({f"{PREFIX}.0.self_attn.q_proj.lora_B.bias": torch.zeros(64)},
     f"tensor {PREFIX}.0.self_attn.q_proj.lora_B.bias: unsupported"),
    ({f"{PREFIX}.2.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)},
     f"tensor {PREFIX}.2.self_attn.q_proj.lora_A.weight: layer 2 is out of range"),
    ({f"{PREFIX}.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 32)},
     f"tensor {PREFIX}.0.self_attn.q_proj.lora_A.weight: duplicates"),
    ({Q0_B: None}, f"layer 0 q_proj: has {A0} but no lora_B"),
    ({A0: None}, f"layer 0 q_proj: has {Q0_B} but no lora_A"),
    ({A0: torch.zeros(4, 33)}, f"tensor {A0}: expected shape [rank, 32], got [4, 33]"),
    ({A0: torch.zeros(4)}, f"tensor {A0}: expected shape [rank, 32], got [4]"),
    ({A0: torch.zeros(3, 32)}, f"tensor {Q0_B}: expected shape [64, 3], got [64, 4]"),
    ({Q0_B: torch.zeros(64, 4, 1)}, f"tensor {Q0_B}: expected shape [64, 4], got [64, 4, 1]"),
])
def test_tensor_refusals(copy: Path, changes: dict[str, torch.Tensor | None], match: str) -> None:
    edit_tensors(copy, **changes)
    for check in (check_adapter, load_adapter):
        with pytest.raises(ValueError, match=f"^lora_path: .*: {re.escape(match)}"):
            check(request(copy), HF_CONFIG, 8)


def test_no_lora_tensors(copy: Path) -> None:
    save_file({}, copy / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="holds no LoRA tensors"):
        load_adapter(request(copy), HF_CONFIG, 8)
