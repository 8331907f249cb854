"""Config validation: every ``Literal`` field refuses other values, and every bool, int, float
and str field other types, naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    choices_of,
)
from pagedserve.platform import platform_for, resolve_kv_cache_dtype


@pytest.mark.parametrize(
    ("cls", "name", "allowed"),
    [
        (ModelConfig, "load_format", ("auto", "safetensors", "gguf", "dummy")),
        (SchedulerConfig, "policy", ("fcfs", "priority")),
        (ParallelConfig, "distributed_executor_backend", ("uni", "mp", "ray")),
        (CompilationConfig, "mode", ("auto", "compile", "none")),
        (CompilationConfig, "piece_compiler", ("inductor", "eager")),
        (CompilationConfig, "one_token_step", ("gemv", "compiled")),
    ],
)
def test_literal_fields_accept_their_values_only(cls: type, name: str, allowed: tuple) -> None:
    assert choices_of(cls, name) == allowed
    for value in allowed:
        assert getattr(cls(**{name: value}), name) == value
    with pytest.raises(ValueError, match=f"^{name}: 'bogus' is not one of {', '.join(allowed)}$"):
        cls(**{name: "bogus"})


def test_none_only_where_the_type_allows_it() -> None:
    assert ParallelConfig(distributed_executor_backend=None).distributed_executor_backend is None
    with pytest.raises(ValueError, match="^mode: None is not one of"):
        CompilationConfig(mode=None)


@pytest.mark.parametrize("kwargs,field", [
    ({"enforce_eager": "yes"}, "enforce_eager"),
    ({"budget_step_graph": 1}, "budget_step_graph"),
    ({"max_num_seqs": 8.0}, "max_num_seqs"),
    ({"max_model_len": "4k"}, "max_model_len"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization"),
    ({"seed": True}, "seed"),
    ({"model": 3}, "model"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        EngineConfig.from_kwargs(**kwargs)


def test_any_integer_or_real_fills_int_and_float_fields() -> None:
    config = EngineConfig.from_kwargs(max_num_seqs=np.int64(8), gpu_memory_utilization=1,
                                      budget_step_graph=None, max_model_len=None)
    assert config.scheduler.max_num_seqs == 8 and config.cache.gpu_memory_utilization == 1


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu"])
def test_an_unknown_device_is_refused_naming_the_field(device: str) -> None:
    with pytest.raises(ValueError, match="^device: "):
        EngineConfig.from_kwargs(device=device)


def test_a_numbered_cuda_device_is_a_device() -> None:
    assert EngineConfig.from_kwargs(device="cuda:1").device == "cuda:1"


@pytest.mark.parametrize(
    ("fields", "on_cpu", "on_cuda"),
    [
        ({}, (False, False), (True, True)),  # auto: compiled with graphs on CUDA, eager on CPU
        ({"mode": "compile"}, (True, False), (True, True)),
        ({"mode": "none"}, (False, False), (False, False)),
        ({"enforce_eager": True}, (False, False), (False, False)),
    ],
)
def test_compile_and_graphs_follow_the_platform(
    fields: dict, on_cpu: tuple[bool, bool], on_cuda: tuple[bool, bool]
) -> None:
    config = CompilationConfig(**fields)
    for device, expected in (("cpu", on_cpu), ("cuda", on_cuda)):
        target = platform_for(device)
        assert (config.uses_compile(target), config.uses_cuda_graphs(target)) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_cache_dtype_auto_is_the_models_dtype(dtype: torch.dtype) -> None:
    cpu = torch.device("cpu")
    assert resolve_kv_cache_dtype(CacheConfig(kv_cache_dtype="auto").kv_cache_dtype, dtype,
                                  cpu) is dtype
    assert EngineConfig.from_kwargs().cache.kv_cache_dtype == "auto"  # auto by default


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3"])
def test_fp8_kv_cache_dtypes_are_e4m3(value: str) -> None:
    config = EngineConfig.from_kwargs(kv_cache_dtype=value)
    resolved = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, torch.bfloat16,
                                      torch.device("cpu"))
    assert resolved is torch.float8_e4m3fn


@pytest.mark.parametrize("value", ["fp8_e5m2", "bfloat16", "banana", ""])
def test_other_kv_cache_dtypes_are_refused_naming_the_field(value: str) -> None:
    with pytest.raises(ValueError, match=f"^kv_cache_dtype: {value!r} is not supported; "
                                         "supported: auto, fp8, fp8_e4m3$"):
        EngineConfig.from_kwargs(kv_cache_dtype=value)
