"""Config validation: every ``Literal`` field refuses other values, naming the field."""

from __future__ import annotations

import pytest

from pagedserve.config import (
    CompilationConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    choices_of,
)


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
