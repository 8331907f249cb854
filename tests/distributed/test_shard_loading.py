"""Each rank's shard of a checkpoint (or of the dummy weights) is its slice of the TP=1
model: the shards of both ranks put back together give the TP=1 parameters exactly.

Loading needs no process group (only the collectives do), so both ranks' shards are built
here, in one process."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import ModelConfig
from pagedserve.distributed.parallel_state import TensorParallelGroup
from pagedserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.layers.vocab_embedding import VocabParallelEmbedding
from pagedserve.model.loader import check_tensor_parallel_size, load_model
from tests.distributed.tiny_tp import ARCHS, VOCAB_SIZE

CPU = torch.device("cpu")
TP = 2


def _load(folder, load_format: str, rank: int, size: int):  # noqa: ANN001, ANN202
    config = ModelConfig(str(folder), dtype="float32", load_format=load_format, seed=3)
    group = TensorParallelGroup(rank, size, "never-called")  # loading makes no collective call
    return load_model(config, CPU, torch.float32, group)[0]


def _qkv_parts(layer: QKVParallelLinear, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return t.split([layer.q_size, layer.kv_size, layer.kv_size], dim=0)


def _reassemble(
    module: torch.nn.Module, shards: list[torch.Tensor], rank_modules: list
) -> torch.Tensor:
    """The TP=1 tensor that ``shards`` (one per rank, of a parameter of ``module``) slice."""
    if isinstance(module, QKVParallelLinear):
        parts = [_qkv_parts(m, s) for m, s in zip(rank_modules, shards, strict=True)]
        replicas = rank_modules[0].kv_replicas
        for rank in range(len(parts)):  # replicated KV heads: identical on their ranks
            for kv in (1, 2):
                torch.testing.assert_close(parts[rank][kv], parts[rank - rank % replicas][kv])
        q = torch.cat([p[0] for p in parts])
        k = torch.cat([p[1] for p in parts[::replicas]])
        v = torch.cat([p[2] for p in parts[::replicas]])
        return torch.cat([q, k, v])
    if isinstance(module, MergedColumnParallelLinear):
        pairs = zip(rank_modules, shards, strict=True)
        halves = [s.split(m.sizes_per_rank, dim=0) for m, s in pairs]
        return torch.cat([torch.cat([h[i] for h in halves]) for i in range(len(halves[0]))])
    if isinstance(module, RowParallelLinear) and shards[0].dim() == 2:
        return torch.cat(shards, dim=1)
    if isinstance(module, VocabParallelEmbedding):
        full = torch.cat(shards)  # [padded vocab, hidden]
        assert torch.all(full[VOCAB_SIZE:] == 0)  # the padding rows are zero
        return full[:VOCAB_SIZE]
    for shard in shards[1:]:  # norms, biases of row-parallel layers: whole on every rank
        torch.testing.assert_close(shard, shards[0], rtol=0, atol=0)
    return shards[0]


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rank_shards_reassemble_to_the_tp1_model(arch, load_format, checkpoint) -> None:
    whole = _load(checkpoint(arch), load_format, 0, 1)
    ranks = [_load(checkpoint(arch), load_format, r, TP) for r in range(TP)]
    modules = [dict(m.named_modules()) for m in ranks]
    rank_params = [dict(m.named_parameters()) for m in ranks]
    for name, param in whole.named_parameters():
        owner = name.rsplit(".", 1)[0]
        module = dict(whole.named_modules())[owner]
        rebuilt = _reassemble(module, [p[name] for p in rank_params], [m[owner] for m in modules])
        expected = param[:VOCAB_SIZE] if isinstance(module, VocabParallelEmbedding) else param
        torch.testing.assert_close(rebuilt, expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("tp_size", "problem"),
    [(3, "num_attention_heads 4"), (8, "num_attention_heads 4"), (5, "intermediate_size 96")],
)
def test_sizes_that_do_not_split_are_refused(tp_size, problem, checkpoint) -> None:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(checkpoint("qwen2"))
    with pytest.raises(ValueError, match=f"tensor_parallel_size: {tp_size} .*{problem}"):
        check_tensor_parallel_size(hf_config, tp_size, "qwen2")


def test_fewer_kv_heads_than_ranks_are_replicated(checkpoint) -> None:
    """Llama's single KV head at TP=4: every rank holds it (no error)."""
    from transformers import AutoConfig

    check_tensor_parallel_size(AutoConfig.from_pretrained(checkpoint("llama")), 4, "llama")
