"""The tokenizer built from a GGUF file's metadata: the same class, vocabulary, special tokens and
chat template as ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``, which we skip because
it parses the whole file a second time through transformers' slow reader."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pagedserve.model.tokenizer import tokenizer_from_gguf

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i s", "Ġ is", "a t"]
TEXTS = ["the cat is here", "  the\n\nthe  ", "naïve café", "<|im_start|>user\nhi<|im_end|>"]


def write_tokenizer_gguf(path: Path, arch: str, pre: str) -> None:
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
    writer.add_chat_template(CHAT_TEMPLATE)
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
