"""The ``pagedserve`` command: options generated from the configs, errors as one line, the
default model naming Paris within 15 s, and the chat REPL."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.entrypoints import cli
from pagedserve.entrypoints.cli_args import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    sampling_params_from_args,
)
from pagedserve.sampling_params import SamplingParams

PAGEDSERVE = Path(sys.executable).parent / "pagedserve"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(PAGEDSERVE), *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def _parser() -> argparse.ArgumentParser:
    parser = cli.CliParser(prog="test")
    add_engine_args(parser)
    add_sampling_args(parser)
    return parser


def test_option_defaults_come_from_the_dataclasses():
    args = _parser().parse_args([])
    assert engine_config_from_args(args) == EngineConfig()
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        for f in dataclasses.fields(cls):
            assert getattr(args, f.name) == f.default, f.name
    params = sampling_params_from_args(args)
    assert params.max_tokens == SamplingParams().max_tokens
    assert params.temperature == SamplingParams().temperature


def test_options_parse_into_configs():
    args = _parser().parse_args(
        [
            "--max-num-seqs",
            "4",
            "--no-enable-prefix-caching",
            "--cudagraph-capture-sizes",
            "1",
            "8",
            "--load-format",
            "dummy",
            "--stop",
            "a",
            "bc",
            "--ignore-eos",
            "--temperature",
            "0",
        ]
    )
    config = engine_config_from_args(args)
    assert config.scheduler.max_num_seqs == 4 and not config.cache.enable_prefix_caching
    assert config.compilation.cudagraph_capture_sizes == (1, 8)
    assert config.model.load_format == "dummy"
    params = sampling_params_from_args(args)
    assert params.stop == ["a", "bc"] and params.ignore_eos and params.greedy


def test_seed_seeds_the_engine_and_request_seed_the_request():
    """``--seed`` is the engine's; as every request's seed it would give all of them one noise
    stream. A request is seeded only by ``--request-seed``."""
    args = _parser().parse_args(["--seed", "7"])
    assert engine_config_from_args(args).model.seed == 7
    assert sampling_params_from_args(args).seed is None
    args = _parser().parse_args(["--seed", "7", "--request-seed", "3"])
    assert engine_config_from_args(args).model.seed == 7
    assert sampling_params_from_args(args).seed == 3


@pytest.fixture(scope="module")
def tiny_generate_argv(tmp_path_factory):
    """``generate`` options for a tiny random model, sampled at a high temperature."""
    from tests.engine.tiny_models import save_checkpoint

    folder, _, _ = save_checkpoint("llama", tmp_path_factory.mktemp("tiny"))
    return ["generate", "Hello", "--model", str(folder), "--dtype", "float32",
            "--max-model-len", "64", "--num-gpu-blocks-override", "8", "--max-tokens", "12",
            "--ignore-eos", "--temperature", "3"]  # fmt: skip


def test_generate_seed_is_reproducible_run_to_run(tiny_generate_argv, capsys):
    texts = []
    for seed in ("1", "1", "2"):
        assert cli.main([*tiny_generate_argv, "--seed", seed]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_request_seed_fixes_the_tokens_whatever_the_engine_seed(tiny_generate_argv, capsys):
    texts = []
    for seed in ("1", "2"):
        assert cli.main([*tiny_generate_argv, "--seed", seed, "--request-seed", "5"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]


def test_help_lists_the_commands():
    text = cli.build_parser()[0].format_help()
    for command in ("generate", "chat", "serve", "bench", "trace"):
        assert command in text


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "hi", "--no-such-option"], "unrecognized arguments"),
        (["generate", "hi", "--max-num-seqs", "many"], "invalid int value"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--block-size", "3"], "block_size"),
        (["generate", "hi", "--request-seed", "-1"], "seed must be in [0, 2**63)"),
        (["generate", "hi", "--load-format", "zip"], "invalid choice"),
        (["generate", "hi", "--kv-cache-dtype", "fp8_e5m2"],
         "kv_cache_dtype: 'fp8_e5m2' is not supported; supported: auto, fp8, fp8_e4m3"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle):
    result = _run(*argv)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", sorted(cli.PLUGIN_COMMANDS))
def test_missing_plugin_command_is_one_line(command):
    module = cli.PLUGIN_COMMANDS[command][0]
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} exists: the command is provided")
    result = _run(command)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"pagedserve {command}: not available in this build (module {module} is missing)"
    ]


@pytest.fixture(scope="module")
def paris_run():
    """One run of the README's main command: (result, seconds from start to end)."""
    start = time.perf_counter()
    result = _run(
        "generate", "The capital of France is", "--max-tokens", "16", "--temperature", "0"
    )
    return result, time.perf_counter() - start


@pytest.mark.serial  # shares paris_run with the next test
def test_generate_names_paris(paris_run):
    result, _ = paris_run
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.serial  # wall time of the README's command
def test_generate_within_15_seconds(paris_run):
    """The README's first command, start to end under 15 s on a 2-core CPU (with the bytecode
    that scripts/install.sh compiles)."""
    result, elapsed = paris_run
    assert result.returncode == 0, result.stderr
    assert elapsed < 15.0, f"took {elapsed:.1f} s"


class _RecordingLLM:
    """Stands in for ``LLM`` in the REPL: records each prompt and replies with a fixed text."""

    def __init__(self, input_processor):
        self.input_processor = input_processor
        self.prompts: list[str] = []

    def stream(self, prompt, params):
        from pagedserve.outputs import CompletionOutput, RequestOutput

        self.prompts.append(prompt["prompt"])
        reply = f"reply{len(self.prompts)}"
        yield RequestOutput(
            "r", prompt["prompt"], [], [CompletionOutput(0, reply, [1], None, None, "stop")], True
        )


def test_chat_repl_keeps_the_history(capsys):
    from pagedserve.engine.input_processor import InputProcessor
    from tests.engine.tiny_models import make_tokenizer

    tokenizer = make_tokenizer()
    llm = _RecordingLLM(InputProcessor(tokenizer, 512, len(tokenizer), tokenizer.eos_token_id))
    cli.run_chat(llm, SamplingParams(), stdin=io.StringIO("first\n\nsecond\n/exit\nnever\n"))
    assert len(llm.prompts) == 2
    assert "first" in llm.prompts[1] and "reply1" in llm.prompts[1] and "second" in llm.prompts[1]
    assert capsys.readouterr().out == "reply1\nreply2\n"


class _InterruptedLLM(_RecordingLLM):
    """The first reply is cut by Ctrl-C after one piece; the stream is closed (aborted)."""

    def __init__(self, input_processor):
        super().__init__(input_processor)
        self.closed = 0

    def stream(self, prompt, params):
        from pagedserve.outputs import CompletionOutput, RequestOutput

        self.prompts.append(prompt["prompt"])
        try:
            yield RequestOutput("r", prompt["prompt"], [],
                                [CompletionOutput(0, "part", [1], None, None, None)], False)
            if len(self.prompts) == 1:
                raise KeyboardInterrupt
            yield RequestOutput("r", prompt["prompt"], [],
                                [CompletionOutput(0, "whole", [1], None, None, "stop")], True)
        finally:
            self.closed += 1


def test_chat_ctrl_c_stops_the_reply_not_the_session(capsys):
    from pagedserve.engine.input_processor import InputProcessor
    from tests.engine.tiny_models import make_tokenizer

    tokenizer = make_tokenizer()
    llm = _InterruptedLLM(InputProcessor(tokenizer, 512, len(tokenizer), tokenizer.eos_token_id))
    cli.run_chat(llm, SamplingParams(), stdin=io.StringIO("first\nsecond\n/exit\n"))
    assert len(llm.prompts) == 2 and llm.closed == 2
    # The session went on, with the interrupted reply in its history as far as it went.
    assert "first" in llm.prompts[1] and "part" in llm.prompts[1] and "second" in llm.prompts[1]
    captured = capsys.readouterr()
    assert captured.out == "part\npartwhole\n"
    assert "reply stopped" in captured.err


def test_unsupported_architecture_is_one_line_before_serving(tmp_path, capsys):
    import json

    from tests.engine.tiny_models import save_checkpoint

    folder, _, _ = save_checkpoint("llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # the checkpoint writer's progress bar
    assert cli.main(["serve", str(folder), "--port", "0"]) == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "serving" not in err
    assert err.startswith("pagedserve serve: error: ") and "'FooForCausalLM' is not supported" in err


def test_serve_logs_at_info_by_default_and_generate_does_not():
    for command, level in (("serve", "info"), ("generate", "warning"), ("chat", "warning")):
        parser, _ = cli.build_parser(command)
        argv = [command, "x"] if command == "generate" else [command]
        assert parser.parse_args(argv).log_level == level


def test_prompt_taken_by_a_list_option_is_explained(capsys) -> None:
    """``--stop "." "prompt"``: argparse gives the prompt to --stop; the one-line error says
    why and what to do."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--stop", ".", "The capital of France is"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "required: prompt" in err and "put the prompt first" in err
