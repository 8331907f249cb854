"""Block hashes for prefix caching: a SHA-256 chain over the full blocks of a token sequence.

A block's hash covers its parent's hash, its own token ids and optional extra keys (a cache salt,
a LoRA adapter), so equal hashes mean equal whole prefixes, not just equal blocks.

Why SHA-256 and not Python's ``hash`` of a tuple: the tuple hash of ints is stable across
processes, but it has 64 bits and no collision resistance, so a crafted prompt could collide with
another user's prefix and be served that user's KV cache (vLLM moved to SHA-256 for this reason).
One SHA-256 over a block of token ids costs about a microsecond, nothing next to a forward pass.
The hash is returned as a Python int (256 bits) so it can key dicts and fill
``Request.block_hashes``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from pagedserve.core.request import Request

BlockHash = int
"""256-bit integer: SHA-256 digest of (parent hash, token ids, extra keys)."""

_HASH_BYTES = 32
NONE_HASH: BlockHash = int.from_bytes(hashlib.sha256(b"pagedserve:root").digest(), "big")
"""Parent hash of a sequence's first block."""


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[int | str, ...] = (),
) -> BlockHash:
    """Hash one block. ``extra_keys`` (ints or strings) separate blocks with equal tokens that
    must not share KV, e.g. different LoRA adapters."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    try:
        # Fixed little-endian int64 layout: the same bytes on every machine.
        tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as e:
        raise ValueError(f"token_ids: every token id must fit in int64 ({e})") from None
    h = hashlib.sha256(parent.to_bytes(_HASH_BYTES, "big"))
    h.update(tokens)
    if extra_keys:
        h.update(repr(tuple(extra_keys)).encode())
    return int.from_bytes(h.digest(), "big")


def first_block_keys(request: Request) -> tuple[int | str, ...]:
    """The extra keys of a request's first block: its cache salt and its adapter (KV computed
    with one adapter is not another's, nor the base model's)."""
    keys: tuple[int | str, ...] = ()
    if request.cache_salt is not None:
        keys += ("cache_salt", request.cache_salt)
    if request.lora_request is not None:
        keys += ("lora", request.lora_request.lora_int_id)
    return keys


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of ``request.all_token_ids``.

    Tokens are only ever appended, so hashes computed earlier stay valid; each call hashes only
    the blocks that became full since the last one. Returns ``request.block_hashes``.
    """
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    parent = hashes[-1] if hashes else None
    salt = first_block_keys(request)
    for i in range(len(hashes), num_full_blocks):
        block_tokens = request.all_token_ids[i * block_size : (i + 1) * block_size]
        # The chain carries the first block's salt into every later hash.
        parent = hash_block_tokens(parent, block_tokens, salt if i == 0 else ())
        hashes.append(parent)
    return hashes
