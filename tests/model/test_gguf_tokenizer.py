"""The tokenizer built from a GGUF file's metadata: the same class, vocabulary, special tokens and
chat template as ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``, which we skip because
it parses the whole file a second time through transformers' slow reader; and its disk cache:
the same tokenizer back, rebuilt when stale or corrupt, skipped when it cannot be written."""

from __future__ import annotations

import os
import time
from pathlib import Path

import gguf
import pytest
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagedserve.model import tokenizer as tokenizer_module
from pagedserve.model.gguf_tokenizer_cache import (
    ABANDONED_AFTER_S,
    KEY_FILE,
    MAX_ENTRIES,
    TokenizerCache,
)
from pagedserve.model.tokenizer import tokenizer_from_gguf

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i s", "Ġ is", "a t"]
TEXTS = ["the cat is here", "  the\n\nthe  ", "naïve café", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test here caches under its own folder, never the user's ``~/.cache``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def write_tokenizer_gguf(
    path: Path, arch: str, pre: str, add_bos: bool = False, template: str = CHAT_TEMPLATE
) -> None:
    """A metadata-only GGUF (no tensors) with a tiny byte-level BPE vocabulary."""
    byte_tokens = list(bytes_to_unicode().values())  # 256 single-character byte tokens
    merged = ["Ġt", "he", "Ġthe", "is", "Ġis", "at"]
    tokens = byte_tokens + merged + SPECIAL
    types = [1] * (len(byte_tokens) + len(merged)) + [3] * len(SPECIAL)  # 3: control token
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("arch", "pre"), [("llama", "smollm"), ("qwen2", "qwen2")])
def test_gguf_tokenizer_matches_auto_tokenizer(tmp_path: Path, arch: str, pre: str) -> None:
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, arch, pre)
    ours = tokenizer_from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        theirs.bos_token,
        theirs.eos_token,
        theirs.pad_token,
    )
    assert ours.chat_template == theirs.chat_template == CHAT_TEMPLATE
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids)


def test_tokenizer_files_beside_the_gguf_go_through_auto_tokenizer(tmp_path: Path) -> None:
    """A folder with its own tokenizer files: ``AutoTokenizer`` picks the class from them."""
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, "llama", "smollm")
    tokenizer_from_gguf(path).save_pretrained(tmp_path)  # writes tokenizer_config.json beside it
    ours = tokenizer_from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert type(ours) is type(theirs)
    assert ours("the cat").input_ids == theirs("the cat").input_ids


def test_unreadable_gguf_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")  # truncated after the version
    with pytest.raises(ValueError, match=r"broken\.gguf"):
        tokenizer_from_gguf(path)


def assert_same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert {i: t.__getstate__() for i, t in ours.added_tokens_decoder.items()} == {
        i: t.__getstate__() for i, t in theirs.added_tokens_decoder.items()
    }
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
    assert ours.chat_template == theirs.chat_template
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )


def _no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("converted the GGUF vocabulary although the cache holds it")

    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", fail)


@pytest.mark.parametrize(
    ("arch", "pre", "add_bos"), [("llama", "smollm", True), ("qwen2", "qwen2", False)]
)
def test_cached_tokenizer_is_the_converted_one(
    tmp_path: Path, cache_home: Path, monkeypatch: pytest.MonkeyPatch, arch, pre, add_bos
) -> None:
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, arch, pre, add_bos=add_bos)
    converted = tokenizer_from_gguf(path)
    assert len(list((cache_home / "pagedserve" / "tokenizers").glob(f"*/{KEY_FILE}"))) == 1
    assert (converted("the cat").input_ids[0] == converted.bos_token_id) == add_bos
    _no_conversion(monkeypatch)
    assert_same_tokenizer(tokenizer_from_gguf(path), converted)


def test_a_changed_gguf_file_is_converted_again(tmp_path: Path) -> None:
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, "llama", "smollm")
    assert tokenizer_from_gguf(path).chat_template == CHAT_TEMPLATE
    write_tokenizer_gguf(path, "llama", "smollm", template="{{ messages[0]['content'] }}")
    assert tokenizer_from_gguf(path).chat_template == "{{ messages[0]['content'] }}"


@pytest.mark.parametrize("damage", ["garbage tokenizer.json", "no tokenizer.json", "bad key"])
def test_a_corrupt_entry_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage):
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, "qwen2", "qwen2")
    converted = tokenizer_from_gguf(path)
    (entry,) = [p.parent for p in TokenizerCache().root.glob(f"*/{KEY_FILE}")]
    if damage == "garbage tokenizer.json":
        (entry / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": [1, 2')
    elif damage == "no tokenizer.json":
        (entry / "tokenizer.json").unlink()
    else:
        (entry / KEY_FILE).write_text("{not json")
    assert_same_tokenizer(tokenizer_from_gguf(path), converted)
    _no_conversion(monkeypatch)  # the rebuilt entry is whole again
    assert_same_tokenizer(tokenizer_from_gguf(path), converted)


def test_an_unwritable_cache_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, "llama", "smollm")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    cache = TokenizerCache(blocker / "tokenizers")
    first, second = tokenizer_from_gguf(path, cache), tokenizer_from_gguf(path, cache)
    assert_same_tokenizer(first, second)
    assert blocker.is_file()


def test_the_cache_keeps_the_most_recent_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    paths = [tmp_path / f"tok{i}.gguf" for i in range(MAX_ENTRIES + 2)]
    for p in paths:
        write_tokenizer_gguf(p, "qwen2", "qwen2")
        tokenizer_from_gguf(p)
    assert len(list(TokenizerCache().root.glob(f"*/{KEY_FILE}"))) == MAX_ENTRIES
    _no_conversion(monkeypatch)
    tokenizer_from_gguf(paths[-1])  # the newest is still there


def test_abandoned_temporary_entries_are_removed(tmp_path: Path) -> None:
    """A ``.tmp-*`` folder older than an hour is a writer that died; a recent one may be live."""
    root = TokenizerCache().root
    old, recent = root / ".tmp-dead", root / ".tmp-live"
    for folder in (old, recent):
        folder.mkdir(parents=True)
    os.utime(old, (time.time() - 2 * ABANDONED_AFTER_S,) * 2)
    path = tmp_path / "tok.gguf"
    write_tokenizer_gguf(path, "qwen2", "qwen2")
    tokenizer_from_gguf(path)
    assert not old.exists() and recent.exists()
