"""Run a model over a paged KV cache without the runner or the scheduler (tests only).

``PagedHarness`` owns one KV cache per attention layer, hands out blocks in a shuffled order
(so block tables are not contiguous) and builds each step's ``AttentionMetadata`` by hand.
``greedy_generate`` drives it: prompts prefill (optionally in chunks, so later chunks attend
over a cached prefix and finished prompts decode in the same batch as unfinished ones), then
each sequence decodes greedily.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedserve.attention.backends.base import PAD_SLOT_ID, AttentionMetadata
from pagedserve.attention.backends.torch_ref import TorchRefBackend
from pagedserve.attention.forward_context import ForwardContext, set_forward_context
from pagedserve.attention.layer import attention_layers, bind_kv_caches


@dataclass
class PagedSequence:
    token_ids: list[int]
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)
    """One fp32 [vocab] row per computed position, in position order."""

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


class PagedHarness:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, seed: int = 0) -> None:
        param = next(model.parameters())
        self.model = model
        self.block_size = block_size
        self.device = param.device
        self.kv_caches = {
            name: torch.zeros(
                layer.kv_cache_shape(num_blocks, block_size), dtype=param.dtype, device=param.device
            )
            for name, layer in attention_layers(model).items()
        }
        bind_kv_caches(model, self.kv_caches, TorchRefBackend())
        self.free_blocks = list(range(1, num_blocks))  # block 0 stays unused, like a null block
        random.Random(seed).shuffle(self.free_blocks)

    def _allocate(self, seq: PagedSequence, num_tokens: int) -> None:
        while len(seq.block_ids) * self.block_size < num_tokens:
            if not self.free_blocks:
                raise ValueError("PagedHarness: out of KV blocks")
            seq.block_ids.append(self.free_blocks.pop())

    def build_step(
        self, batch: list[tuple[PagedSequence, int]], num_padding: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids, positions and metadata for ``batch`` = [(sequence, new tokens)]."""
        input_ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, n in batch:
            first, end = seq.num_computed, seq.num_computed + n
            self._allocate(seq, end)
            input_ids += seq.token_ids[first:end]
            positions += list(range(first, end))
            slots += [
                seq.block_ids[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(first, end)
            ]
            starts.append(starts[-1] + n)
            seq_lens.append(end)
        num_actual = len(input_ids)
        input_ids += [0] * num_padding
        positions += [0] * num_padding
        slots += [PAD_SLOT_ID] * num_padding
        width = max(len(seq.block_ids) for seq, _ in batch)
        table = [seq.block_ids + [0] * (width - len(seq.block_ids)) for seq, _ in batch]
        to = dict(device=self.device)
        metadata = AttentionMetadata(
            num_reqs=len(batch),
            num_actual_tokens=num_actual,
            max_query_len=max(n for _, n in batch),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, **to),  # [num_reqs + 1]
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **to),  # [num_reqs]
            block_table=torch.tensor(table, dtype=torch.int32, **to),  # [num_reqs, width]
            slot_mapping=torch.tensor(slots, dtype=torch.int64, **to),  # [num_tokens_padded]
            query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, **to)  # [num_tokens_padded]
        pos = torch.tensor(positions, dtype=torch.int64, **to)  # [num_tokens_padded]
        return ids, pos, metadata

    @torch.no_grad()
    def step(self, batch: list[tuple[PagedSequence, int]], num_padding: int = 0) -> torch.Tensor:
        """Run one forward; returns fp32 logits [num real tokens, vocab] and advances the batch."""
        input_ids, positions, metadata = self.build_step(batch, num_padding)
        names = list(self.kv_caches)
        ctx = ForwardContext(
            attn_metadata=dict.fromkeys(names, metadata),
            slot_mapping=dict.fromkeys(names, metadata.slot_mapping),
            num_tokens=input_ids.shape[0],
            attn_layers=attention_layers(self.model),
        )
        with set_forward_context(ctx):
            hidden = self.model(input_ids, positions)
        logits = self.model.compute_logits(hidden[: metadata.num_actual_tokens]).float()
        for seq, n in batch:
            seq.num_computed += n
        return logits


def greedy_generate(
    model: nn.Module,
    prompts: list[list[int]],
    num_steps: int,
    block_size: int = 4,
    prefill_chunk: int | None = None,
    num_padding: int = 0,
    num_blocks: int = 256,
) -> list[PagedSequence]:
    """Greedy decode ``num_steps`` tokens for each prompt through the paged cache.

    Each returned sequence holds the generated tokens and the logits of every position it
    computed (prompt positions included).
    """
    harness = PagedHarness(model, num_blocks, block_size)
    seqs = [PagedSequence(list(p), len(p)) for p in prompts]
    while True:
        batch = []
        for seq in seqs:
            if len(seq.generated) < num_steps:
                remaining = len(seq.token_ids) - seq.num_computed
                batch.append((seq, min(remaining, prefill_chunk or remaining)))
        if not batch:
            return seqs
        logits = harness.step(batch, num_padding)
        for (seq, _), rows in zip(batch, logits.split([n for _, n in batch]), strict=True):
            seq.logits.extend(rows)
            if seq.num_computed == len(seq.token_ids):  # reached the end: sample the next token
                seq.token_ids.append(int(rows[-1].argmax()))
