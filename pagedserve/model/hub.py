"""Models named as on the Hugging Face hub (``org/name``), found through the hub's cache.

``snapshot_folder("meta-llama/Llama-3.1-8B-Instruct")`` is the local folder of that model:
downloaded into the hub cache when the hub is reachable, else taken from the cache as it is
(``huggingface_hub`` does both: ``HF_HOME`` / ``HF_HUB_CACHE`` say where the cache is, and
``HF_HUB_OFFLINE=1`` skips the network). A name that is neither cached nor reachable is
refused in one line that names the option it came from.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

HUB_FILE_PATTERNS = (
    "*.json",  # config, generation config, tokenizer config, safetensors index
    "*.safetensors",
    "tokenizer*",
    "*.model",  # sentencepiece tokenizers
    "*.tiktoken",
    "*.txt",  # merges
    "*.jinja",  # chat templates kept beside the config
)
"""The files of a hub model this engine reads (not the .bin / .pth / .gguf copies many repos
also hold: downloading those would multiply the bytes)."""

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_repo_id(name: str) -> bool:
    """``org/name`` as the hub spells repository ids (not ``./x``, ``/abs/path``, ``a/b/c``)."""
    return _REPO_ID.fullmatch(name) is not None and ".." not in name


@functools.cache
def snapshot_folder(
    repo_id: str, revision: str | None, download_dir: str | None, field: str = "model"
) -> Path:
    """The local folder of ``repo_id`` at ``revision`` (None: the default branch); cached per
    process, so the several readers of one model (config, weights, tokenizer) ask once."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir,
            allow_patterns=list(HUB_FILE_PATTERNS),
        )
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        at = f" at revision {revision!r}" if revision else ""
        reason = " ".join(str(e).split())
        raise ValueError(
            f"{field}: {repo_id!r}{at} is not a local path and could not be found on the Hugging "
            f"Face hub or in its cache ({reason})"
        ) from e
    except Exception as e:  # the hub's HTTP errors (a private or misspelt repo, a bad revision)
        raise ValueError(f"{field}: {repo_id!r}: {type(e).__name__}: {e}") from e
    return Path(folder)
