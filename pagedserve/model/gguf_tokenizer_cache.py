"""A disk cache of tokenizers converted from GGUF metadata.

Why: building a tokenizer from a GGUF file walks its whole vocabulary and merge table through
transformers' converter on every start-up; loading the converted ``tokenizer.json`` back is a
fraction of that (docs/cpu.md#start-up-on-the-host).

Where: ``$XDG_CACHE_HOME/pagedserve/tokenizers`` (default ``~/.cache/pagedserve/tokenizers``),
one folder per GGUF file (named by a hash of its resolved path) holding what
``save_pretrained`` writes plus ``pagedserve-key.json``: the key and the sha256 of every file
written. An entry is used only when that key still matches the file (path, size, mtime) and the
transformers / tokenizers versions that converted it, and every file is there unchanged (a
missing ``tokenizer.json`` would otherwise load as a tokenizer without a vocabulary). A stale,
corrupt or unreadable entry is rebuilt from the GGUF file; a cache that cannot be written is
skipped. The cache is never a reason for start-up to fail.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import tokenizers
import transformers
from transformers import PreTrainedTokenizerBase

from pagedserve.platform import default_cache_dir

logger = logging.getLogger(__name__)

CACHE_FORMAT = 2
"""Bumped when what an entry holds changes; older entries are then rebuilt."""
KEY_FILE = "pagedserve-key.json"
MAX_ENTRIES = 8
"""Entries kept (most recently used first); tests and scratch GGUF files come and go."""
ABANDONED_AFTER_S = 3600.0
"""A half-written entry (``.tmp-*``, from a process that died while writing) older than this
is removed."""


def cache_key(gguf_file: Path, tokenizer_class: type[PreTrainedTokenizerBase]) -> dict[str, Any]:
    """What an entry must match to be used: the file's identity and the converter's version."""
    stat = gguf_file.stat()
    return {
        "format": CACHE_FORMAT,
        "gguf_file": str(gguf_file.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "tokenizer_class": f"{tokenizer_class.__module__}.{tokenizer_class.__qualname__}",
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def _record_added_tokens(folder: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Write the added (special) tokens into the saved ``tokenizer_config.json``, as
    transformers 4 did (transformers 5 leaves them out for tokenizers-backed classes).

    Why: without them ``from_pretrained`` takes its legacy path and parses the whole
    ``tokenizer.json`` in Python to find them, which costs more than the tokenizers library
    reading the same file. The tokens are the ones
    ``tokenizer.json`` holds, so loading adds nothing new."""
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    config["added_tokens_decoder"] = {
        str(token_id): token.__getstate__()
        for token_id, token in tokenizer.added_tokens_decoder.items()
    }
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))


class CorruptEntry(ValueError):
    """A cache entry whose files do not match the hashes it recorded."""


def _file_hashes(folder: Path) -> dict[str, str]:
    """File name -> sha256 of every file in ``folder`` except the key file."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != KEY_FILE
    }


class TokenizerCache:
    """Converted GGUF tokenizers under ``root`` (``default_cache_dir() / "tokenizers"``)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else default_cache_dir() / "tokenizers"

    def entry_dir(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(key["gguf_file"].encode()).hexdigest()[:32]
        return self.root / digest

    def load(
        self, key: dict[str, Any], tokenizer_class: type[PreTrainedTokenizerBase]
    ) -> PreTrainedTokenizerBase | None:
        """The cached tokenizer for ``key``, or None (no entry, a stale one, a corrupt one)."""
        entry = self.entry_dir(key)
        try:
            recorded = json.loads((entry / KEY_FILE).read_text())
            if recorded["key"] != key:
                return None  # stale: the file or the converter changed; store() replaces it
            if _file_hashes(entry) != recorded["files"]:
                raise CorruptEntry("its files differ from the ones written")
            tokenizer = tokenizer_class.from_pretrained(entry)
            os.utime(entry)  # most recently used (pruning keeps the newest)
            return tokenizer
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - any failure to read an entry means: rebuild it
            logger.warning("tokenizer cache: ignoring the unreadable entry %s (%s)", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
            return None

    def store(self, key: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> None:
        """Write the entry for ``key`` (replacing an old one). The entry appears whole or not at
        all: it is written to a temporary folder and renamed. Failures are logged, not raised."""
        entry = self.entry_dir(key)
        tmp: Path | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
            tokenizer.save_pretrained(tmp)
            _record_added_tokens(tmp, tokenizer)
            recorded = {"key": key, "files": _file_hashes(tmp)}
            (tmp / KEY_FILE).write_text(json.dumps(recorded, indent=1))  # last: it is complete
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(tmp, entry)  # fails if another process just wrote it: theirs stays
            tmp = None
        except Exception as e:  # noqa: BLE001 - the cache is optional: never fail start-up
            logger.info("tokenizer cache: not written to %s (%s)", entry, e)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        self.prune()

    def prune(self) -> None:
        """Keep the ``MAX_ENTRIES`` most recently used entries; drop abandoned temporaries."""
        try:
            children = [(p.stat().st_mtime, p) for p in self.root.iterdir() if p.is_dir()]
        except OSError:
            return
        entries = sorted((c for c in children if not c[1].name.startswith(".")), reverse=True)
        abandoned = [
            c for c in children
            if c[1].name.startswith(".tmp-") and time.time() - c[0] > ABANDONED_AFTER_S
        ]  # fmt: skip
        for _, path in entries[MAX_ENTRIES:] + abandoned:
            shutil.rmtree(path, ignore_errors=True)
