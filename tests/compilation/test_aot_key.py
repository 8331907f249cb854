"""The saved forward's key: equal for the same model and inputs, different when anything that
changes the trace differs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from pagedserve.compilation.aot_key import forward_key, hash_sources, key_factors
from pagedserve.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from pagedserve.layers.linear import UNQUANTIZED, ColumnParallelLinear, LinearMethod
from pagedserve.layers.quantization.fp8 import Fp8LinearMethod, Fp8OnlineLinearMethod, Fp8Scheme
from tests.compilation.conftest import DEEP_LLAMA


class _Model(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: torch.dtype,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        self.weight = nn.Parameter(torch.zeros(2, dtype=dtype))


INPUTS = (torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))


def _key(model: nn.Module, piece_compiler: str = "inductor", inputs=INPUTS) -> str:
    return forward_key(key_factors(model, piece_compiler, inputs))


def test_same_model_same_key_and_every_factor_changes_it() -> None:
    config = LlamaConfig(**DEEP_LLAMA)
    base = _key(_Model(config, torch.float32))
    assert base == _key(_Model(LlamaConfig(**DEEP_LLAMA), torch.float32))
    deeper = LlamaConfig(**{**DEEP_LLAMA, "num_hidden_layers": 5})
    others = [
        _key(_Model(deeper, torch.float32)),
        _key(_Model(config, torch.bfloat16)),
        _key(_Model(config, torch.float32, TensorParallelGroup(1, 2, "0"))),
        _key(_Model(config, torch.float32), piece_compiler="eager"),
        _key(_Model(config, torch.float32), inputs=(INPUTS[0].long(), INPUTS[1])),
    ]
    assert len({base, *others}) == len(others) + 1


def test_the_checkpoint_folder_is_not_in_the_key() -> None:
    """The same config loaded from two folders (a copy, or two dummy-weight runs from fresh
    temporary folders) traces the same forward."""
    here = LlamaConfig(**DEEP_LLAMA, name_or_path="/models/a")
    there = LlamaConfig(**DEEP_LLAMA, name_or_path="/tmp/copy-of-a")
    assert here.to_dict()["_name_or_path"] != there.to_dict()["_name_or_path"]
    assert _key(_Model(here, torch.float32)) == _key(_Model(there, torch.float32))


def test_the_token_count_is_not_in_the_key() -> None:
    model = _Model(LlamaConfig(**DEEP_LLAMA), torch.float32)
    longer = (torch.zeros(9, dtype=torch.int32), torch.zeros(9, dtype=torch.int64))
    assert _key(model) == _key(model, inputs=longer)


def test_source_hash_follows_the_traced_files(tmp_path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "llama.py").write_text("x = 1\n")
    (tmp_path / "layer.py").write_text("y = 1\n")
    paths = ("model", "layer.py")
    before = hash_sources(tmp_path, paths)
    (tmp_path / "model" / "llama.py").write_text("x = 2\n")
    assert hash_sources(tmp_path, paths) != before


def test_a_model_without_a_config_is_refused() -> None:
    with pytest.raises(ValueError, match="config"):
        key_factors(nn.Linear(2, 2), "eager", INPUTS)


def test_the_linear_method_is_in_the_key() -> None:
    """FP8 weights quantized at load keep the checkpoint's config and first parameter, not
    its graph: the linear layers' method tells them apart."""
    config = LlamaConfig(**DEEP_LLAMA)

    def with_linear(method: LinearMethod) -> str:
        model = _Model(config, torch.float32)
        model.proj = ColumnParallelLinear(16, 16, False, torch.float32, torch.device("cpu"),
                                          linear_method=method)
        return _key(model)

    online = Fp8OnlineLinearMethod("dequantize")
    static = Fp8LinearMethod(Fp8Scheme("fp8", "tensor", "static"), "dequantize")
    assert len({with_linear(UNQUANTIZED), with_linear(online), with_linear(static)}) == 3
