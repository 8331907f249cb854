"""--speculative-config / LLM(speculative_config=...): vLLM's keys, bad values refused naming
the key, unsupported methods and combinations refused."""

from __future__ import annotations

import argparse

import pytest

from pagedserve.config import EngineConfig, SpeculativeConfig
from pagedserve.entrypoints.cli_args import add_engine_args, engine_config_from_args


def test_json_from_the_command_line():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", '
                              '"num_speculative_tokens": 4, "prompt_lookup_max": 3}'])
    spec = engine_config_from_args(args).scheduler.speculative_config
    assert spec == SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)
    assert engine_config_from_args(parser.parse_args([])).scheduler.speculative_config is None


@pytest.mark.parametrize(("value", "key"), [
    ({"method": "eagle"}, "method"),
    ({"method": "draft_model"}, "model"),
    ({"method": "ngram", "model": "x"}, "model"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"min_acceptance_rate": 1.5}, "min_acceptance_rate"),
    ({"lookahead": 2}, "speculative_config"),
    ("[1, 2]", "speculative_config"),
    ("{not json", "speculative_config"),
])
def test_bad_values_are_refused_naming_the_key(value, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        EngineConfig.from_kwargs(speculative_config=value)


def test_tensor_parallelism_and_a_draft_out_of_process_are_refused():
    with pytest.raises(ValueError, match="^speculative_config:.*tensor_parallel_size"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram"}, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="^speculative_config:.*uni"):
        EngineConfig.from_kwargs(speculative_config={"method": "draft_model", "model": "x"},
                                 distributed_executor_backend="mp")
