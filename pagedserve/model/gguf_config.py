"""A Hugging Face config built from a GGUF file's metadata (``{arch}.*`` and ``tokenizer.ggml.*``).

GGUF stores the architecture under ``general.architecture`` and its hyper-parameters under
keys prefixed by that name (``llama.block_count``, ...). We build the matching transformers
config class so the rest of the engine sees one kind of config whatever the file format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from pagedserve.model.gguf_file import GGUFFile, GGUFTensor


@dataclass(frozen=True)
class GGUFArch:
    hf_architecture: str
    config_class: type[PretrainedConfig]
    permuted_qk: bool
    """llama.cpp's converter permutes the q/k rows of ``llama`` models only (for its rotary
    layout); the loader undoes it."""


GGUF_ARCHS = {
    "llama": GGUFArch("LlamaForCausalLM", LlamaConfig, permuted_qk=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", Qwen2Config, permuted_qk=False),
    "qwen3": GGUFArch("Qwen3ForCausalLM", Qwen3Config, permuted_qk=False),
}

_REQUIRED = object()


class GGUFMetadata:
    """Typed access to one GGUF file's key/value metadata; errors name the file and the key."""

    def __init__(self, file: GGUFFile) -> None:
        self.file = file
        self.path = file.path
        self.arch_name: str = self.get("general.architecture")
        if self.arch_name not in GGUF_ARCHS:
            known = ", ".join(GGUF_ARCHS)
            raise ValueError(
                f"{self.path}: GGUF architecture {self.arch_name!r} is not supported (supported: {known})"
            )
        self.arch = GGUF_ARCHS[self.arch_name]

    def has(self, key: str) -> bool:
        return key in self.file.metadata

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """The value of ``key`` (an array of strings as a ``StringArray``: its length only);
        without a default, a missing key is an error."""
        if key not in self.file.metadata:
            if default is _REQUIRED:
                raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return self.file.metadata[key]

    def arch_get(self, key: str, default: Any = _REQUIRED) -> Any:
        """``{arch}.{key}``, e.g. ``llama.block_count``."""
        return self.get(f"{self.arch_name}.{key}", default)

    @property
    def tensors(self) -> list[GGUFTensor]:
        return self.file.tensors

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.file.tensors}


def _check_supported_rope(meta: GGUFMetadata, head_dim: int) -> None:
    """Refuse what our rotary embedding would silently get wrong."""
    scaling = meta.arch_get("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{meta.path}: GGUF rope scaling {scaling!r} is not supported yet")
    if "rope_freqs.weight" in meta.tensor_names():
        raise ValueError(
            f"{meta.path}: tensor 'rope_freqs.weight' (per-frequency rope factors, e.g. "
            f"Llama 3.1) is not supported yet"
        )
    rotary_dim = meta.arch_get("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise ValueError(
            f"{meta.path}: partial rotary embedding ({meta.arch_name}.rope.dimension_count "
            f"{rotary_dim} < head_dim {head_dim}) is not supported"
        )


def _vocab_size(meta: GGUFMetadata) -> int:
    if meta.has("tokenizer.ggml.tokens"):
        return len(meta.get("tokenizer.ggml.tokens"))
    return int(meta.arch_get("vocab_size"))


def _special_token_ids(meta: GGUFMetadata) -> dict[str, int]:
    ids = {}
    for name in ("bos", "eos", "padding"):
        key = f"tokenizer.ggml.{name}_token_id"
        if meta.has(key):
            ids["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(meta.get(key))
    return ids


def hf_config_from_metadata(meta: GGUFMetadata) -> PretrainedConfig:
    num_heads = int(meta.arch_get("attention.head_count"))
    num_kv_heads = meta.arch_get("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise ValueError(
            f"{meta.path}: per-layer {meta.arch_name}.attention.head_count_kv is not supported"
        )
    hidden_size = int(meta.arch_get("embedding_length"))
    head_dim = int(meta.arch_get("attention.key_length", hidden_size // num_heads))
    _check_supported_rope(meta, head_dim)
    # A dict: the base class that config_class is typed as declares none of these fields.
    fields: dict[str, Any] = dict(
        architectures=[meta.arch.hf_architecture],
        vocab_size=_vocab_size(meta),
        hidden_size=hidden_size,
        intermediate_size=int(meta.arch_get("feed_forward_length")),
        num_hidden_layers=int(meta.arch_get("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(num_kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(meta.arch_get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.arch_get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.arch_get("context_length")),
        tie_word_embeddings="output.weight" not in meta.tensor_names(),
        **_special_token_ids(meta),
    )
    return meta.arch.config_class(**fields)


def open_gguf(path: Path) -> GGUFMetadata:
    """Parse ``path``'s header (tens of milliseconds; tensor data is only memory-mapped)."""
    return GGUFMetadata(GGUFFile(path))


def gguf_to_hf_config(path: Path) -> PretrainedConfig:
    """The transformers config equivalent to a GGUF file's metadata."""
    return hf_config_from_metadata(open_gguf(path))
