"""The tokenizer (and chat template) of a model: a Hugging Face folder's tokenizer files, or the
vocabulary and template stored in a GGUF file's metadata.

Both paths read local files only; no Hugging Face cache or network is needed. A tokenizer
converted from GGUF metadata is kept in a disk cache (``gguf_tokenizer_cache``) so the next
start-up loads it instead of converting the vocabulary again.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from transformers import AutoTokenizer, PreTrainedTokenizerBase, TokenizersBackend
from transformers.models.auto import TOKENIZER_MAPPING

from pagedserve.config import ModelConfig
from pagedserve.model.gguf_config import GGUF_ARCHS
from pagedserve.model.gguf_file import GGUFFile
from pagedserve.model.gguf_tokenizer_cache import TokenizerCache, cache_key
from pagedserve.model.resolve import locate

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
"""Files that make ``AutoTokenizer`` pick its class from the folder rather than the model."""


def _gguf_tokenizer_class(gguf_file: Path) -> type[PreTrainedTokenizerBase] | None:
    """The class ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` picks for a GGUF file
    with no tokenizer files beside it: the one registered for the file's config class
    (``Qwen2Tokenizer`` for qwen2/qwen3), else ``TokenizersBackend``. None when the folder
    holds tokenizer files or the architecture is not ours (``AutoTokenizer`` then decides).
    Raises ValueError naming the file when it is not a readable GGUF file.

    Why not ``AutoTokenizer`` itself: for llama/qwen2/qwen3 files it first builds the model's
    config through transformers' old GGUF reader, parsing the whole vocabulary once more; the
    class's own GGUF path uses a fast reader (docs/cpu.md#start-up-on-the-host).
    """
    if any((gguf_file.parent / name).exists() for name in TOKENIZER_FILES):
        return None
    arch = GGUFFile(gguf_file).metadata.get("general.architecture")  # ValueError if unreadable
    if arch not in GGUF_ARCHS:
        return None
    # transformers annotates the mapping's values as (slow, fast) pairs; since v5 they are the
    # tokenizer class itself.
    registered = cast(
        "type[PreTrainedTokenizerBase] | None",
        TOKENIZER_MAPPING.get(GGUF_ARCHS[arch].config_class, None),
    )
    return registered or TokenizersBackend


def _gguf_chat_template(gguf_file: Path) -> str | None:
    template = GGUFFile(gguf_file).metadata.get("tokenizer.chat_template")
    return None if template is None else str(template)


def _convert_gguf_tokenizer(
    gguf_file: Path, tokenizer_class: type[PreTrainedTokenizerBase] | type[AutoTokenizer]
) -> PreTrainedTokenizerBase:
    """Build the tokenizer from ``tokenizer.ggml.*``. transformers (in current versions) also
    takes the chat template from ``tokenizer.chat_template``; we read it ourselves if not."""
    try:
        tokenizer = tokenizer_class.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"tokenizer: cannot build a tokenizer from {gguf_file}: {e}") from e
    if tokenizer.chat_template is None:
        tokenizer.chat_template = _gguf_chat_template(gguf_file)
    return tokenizer


def tokenizer_from_gguf(
    gguf_file: Path, cache: TokenizerCache | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer stored in a GGUF file's metadata, from ``cache`` (default: the user's
    cache folder) when it holds this file's conversion; converted and cached otherwise.

    Tokenizer files beside the GGUF file win (``AutoTokenizer`` reads them; not cached).
    """
    tokenizer_class = _gguf_tokenizer_class(gguf_file)
    if tokenizer_class is None:
        return _convert_gguf_tokenizer(gguf_file, AutoTokenizer)
    cache = cache if cache is not None else TokenizerCache()
    key = cache_key(gguf_file, tokenizer_class)
    tokenizer = cache.load(key, tokenizer_class)
    if tokenizer is None:
        tokenizer = _convert_gguf_tokenizer(gguf_file, tokenizer_class)
        cache.store(key, tokenizer)
    return tokenizer


def tokenizer_from_folder(folder: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"tokenizer: no usable tokenizer files in {folder}: {e}") from e


def get_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerBase:
    """``model_config.tokenizer`` (a folder, ``.gguf`` file or hub name) if set, else the
    model's own."""
    if model_config.tokenizer:
        revision = model_config.tokenizer_revision or model_config.revision
        folder, gguf_file = locate(model_config.tokenizer, "tokenizer", revision,
                                   model_config.download_dir)
    else:
        folder, gguf_file = locate(model_config.model, "model", model_config.revision,
                                   model_config.download_dir)
    if gguf_file is not None:
        return tokenizer_from_gguf(gguf_file)
    return tokenizer_from_folder(folder)
