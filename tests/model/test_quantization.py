"""Reading a checkpoint's quantization_config: the FP8 schemes it names, the linear method
the model is built with, and every other quantization refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from pagedserve.config import ModelConfig
from pagedserve.layers.linear import UNQUANTIZED
from pagedserve.layers.quantization.fp8 import (
    Fp8LinearMethod,
    Fp8OnlineLinearMethod,
    Fp8Scheme,
)
from pagedserve.model.quantization import checkpoint_scheme, linear_method_for
from pagedserve.model.resolve import CheckpointError, resolve_model
from tests.model.fp8_checkpoints import FORMATS, MODELOPT, TENSOR_STATIC, TOKEN_DYNAMIC

CPU = torch.device("cpu")


def _config(quantization_config: dict[str, Any] | None) -> LlamaConfig:
    config = LlamaConfig(architectures=["LlamaForCausalLM"])
    if quantization_config is not None:
        config.quantization_config = quantization_config
    return config


def _ct(weights: dict[str, Any], activations: dict[str, Any] | None, **top) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], **top}


FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("compressed-tensors-channel", Fp8Scheme("compressed-tensors", "channel", "dynamic")),
        ("compressed-tensors-tensor", Fp8Scheme("compressed-tensors", "tensor", "static")),
        ("fp8-static", Fp8Scheme("fp8", "tensor", "static")),
        ("fp8-dynamic", Fp8Scheme("fp8", "tensor", "dynamic")),
        ("modelopt", Fp8Scheme("modelopt", "tensor", "static")),
    ],
)
def test_fp8_formats_read_into_their_scheme(fmt: str, expected: Fp8Scheme) -> None:
    assert checkpoint_scheme(_config(FORMATS[fmt].quantization_config)) == expected


def test_weight_only_compressed_tensors_runs_dynamic_activations() -> None:
    scheme = checkpoint_scheme(_config(_ct(FP8_WEIGHTS, None)))
    assert scheme == Fp8Scheme("compressed-tensors", "channel", "dynamic")


def test_modelopt_config_beside_config_json(tmp_path: Path) -> None:
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": MODELOPT}))
    assert checkpoint_scheme(_config(None), tmp_path) == Fp8Scheme("modelopt", "tensor",
                                                                    "static")
    assert checkpoint_scheme(_config(None)) is None
    _config(None).save_pretrained(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {**MODELOPT, "quant_algo": "W4A8_AWQ"}}))
    with pytest.raises(CheckpointError, match="hf_quant_config.json: .*quant_algo 'W4A8_AWQ'"):
        resolve_model(str(tmp_path), load_format="dummy")


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]},
         r"weight_block_size \[128, 128\]: block-wise FP8"),
        ({"quant_method": "fp8", "activation_scheme": "sometimes"},
         "activation_scheme 'sometimes'"),
        ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]},
         r"ignored_layers \['model.layers.0.mlp.down_proj'\]"),
        ({**MODELOPT, "quant_algo": "NVFP4"}, "quant_algo 'NVFP4'"),
        (_ct({**FP8_WEIGHTS, "type": "int"}, None), "config_groups.group_0.weights 'int8'"),
        (_ct({**FP8_WEIGHTS, "strategy": "block"}, TOKEN_DYNAMIC),
         "weights.strategy 'block'"),
        (_ct(FP8_WEIGHTS, {**TENSOR_STATIC, "strategy": "token"}),
         "input_activations.strategy 'token'"),
        (_ct(FP8_WEIGHTS, None, format="pack-quantized"), "format 'pack-quantized'"),
        (_ct(FP8_WEIGHTS, None, ignore=["lm_head", "re:.*mlp.down_proj"]),
         "ignore"),
    ],
)
def test_unsupported_quantization_is_refused_by_name(tmp_path: Path, config: dict,
                                                     named: str) -> None:
    _config(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=named) as err:
        resolve_model(str(tmp_path), load_format="dummy")
    assert str(tmp_path / "config.json") in str(err.value)


def test_linear_method_choice() -> None:
    scheme = Fp8Scheme("modelopt", "tensor", "static")
    assert linear_method_for(None, None, False, CPU) is UNQUANTIZED
    assert linear_method_for(None, scheme, False, CPU) == Fp8LinearMethod(scheme, "dequantize")
    assert linear_method_for("fp8", scheme, False, CPU) == Fp8LinearMethod(scheme,
                                                                           "dequantize")
    online = Fp8OnlineLinearMethod("dequantize")
    assert linear_method_for("fp8", None, False, CPU) == online
    assert linear_method_for(None, scheme, True, CPU) == online  # dummy weights


def test_quantization_field_names_itself() -> None:
    assert ModelConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization: 'awq' is not one of fp8"):
        ModelConfig(quantization="awq")
