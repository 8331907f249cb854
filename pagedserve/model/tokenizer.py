"""The tokenizer (and chat template) of a model: a Hugging Face folder's tokenizer files, or the
vocabulary and template stored in a GGUF file's metadata.

Both paths read local files only; no Hugging Face cache or network is needed.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedserve.config import ModelConfig
from pagedserve.model.gguf_config import open_gguf
from pagedserve.model.resolve import ResolvedModel, locate


def _gguf_chat_template(gguf_file: Path) -> str | None:
    meta = open_gguf(gguf_file)
    if not meta.has("tokenizer.chat_template"):
        return None
    return str(meta.get("tokenizer.chat_template"))


def tokenizer_from_gguf(gguf_file: Path) -> PreTrainedTokenizerBase:
    """transformers builds the tokenizer from ``tokenizer.ggml.*`` and (in current versions)
    takes the chat template from ``tokenizer.chat_template``; we read the template ourselves
    only when it did not (reading a GGUF's metadata costs seconds)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"tokenizer: cannot build a tokenizer from {gguf_file}: {e}") from e
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _gguf_chat_template(gguf_file)
    return tokenizer


def tokenizer_from_folder(folder: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"tokenizer: no usable tokenizer files in {folder}: {e}") from e


def load_tokenizer(resolved: ResolvedModel) -> PreTrainedTokenizerBase:
    """The tokenizer of a resolved model (GGUF metadata, else the folder's tokenizer files)."""
    if resolved.gguf_file is not None:
        return tokenizer_from_gguf(resolved.gguf_file)
    return tokenizer_from_folder(resolved.path)


def get_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerBase:
    """``model_config.tokenizer`` (a folder or ``.gguf`` file) if set, else the model's own."""
    folder, gguf_file = locate(model_config.tokenizer or model_config.model)
    if gguf_file is not None:
        return tokenizer_from_gguf(gguf_file)
    return tokenizer_from_folder(folder)
