"""LoRA adapters in the server: a request's ``model`` picks the adapter on every API (greedy
tokens equal transformers' with the PEFT adapter merged), ``/v1/models`` lists the adapters,
``--allow-runtime-lora-updating`` loads and unloads them, and bad adapters are refused by
name. One server for the module; the no-flag and start-up cases run without one."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoConfig

from pagedserve.config import EngineConfig, LoRAConfig
from pagedserve.engine.async_llm import EngineState
from pagedserve.entrypoints import cli
from pagedserve.entrypoints.openai.app import ServerSettings, build_app
from pagedserve.entrypoints.openai.metrics import ServerMetrics
from pagedserve.entrypoints.openai.serving_models import LoRAModulePath, served_lora_requests
from pagedserve.lora.check import LoRAChecker
from tests.engine.tiny_models import hf_beam_search, hf_greedy, save_checkpoint
from tests.entrypoints.openai.server_utils import (
    MAX_MODEL_LEN,
    REPO_ROOT,
    ServerProcess,
    running_server,
)
from tests.lora.peft_adapters import ADAPTER_CONFIGS, save_adapter

BASE = "tiny"
"""The base model's --served-model-name."""
MAX_TOKENS = 6
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Hello world"}]
ADAPTERS = ADAPTER_CONFIGS
""""all" and "qv" are served from the start, "mlp" loaded later."""

class Models:
    """The base checkpoint's folder, its tokenizer, and each model's transformers side."""

    def __init__(self, root: Path) -> None:
        self.folder, base, self.tokenizer = save_checkpoint("llama", root / "base")
        self.merged: dict[str | None, Any] = {None: base, BASE: base}
        self.paths: dict[str, str] = {}
        for seed, (name, config) in enumerate(ADAPTERS.items()):
            self.paths[name] = str(root / name)
            self.merged[name] = save_adapter(base, root / name, seed, **config)
        config_file = self.folder / "config.json"  # long enough for the server's max_model_len
        hf_config = json.loads(config_file.read_text())
        hf_config["max_position_embeddings"] = MAX_MODEL_LEN
        config_file.write_text(json.dumps(hf_config))

    def greedy(self, model: str | None, prompt_ids: list[int]) -> list[int]:
        return hf_greedy(self.merged[model], prompt_ids, MAX_TOKENS)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return Models(tmp_path_factory.mktemp("serving_lora"))


@pytest.fixture(scope="module")
def lora_server(models: Models, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerProcess]:
    """Two adapters from the start (both forms of --lora-modules), runtime updates on."""
    log = tmp_path_factory.mktemp("lora_server_log") / "server.log"
    qv = json.dumps({"name": "qv", "path": models.paths["qv"], "base_model_name": "tiny-base"})
    with running_server(models.folder, log, "--served-model-name", BASE, "--enable-lora",
                        "--max-loras", "2", "--max-lora-rank", "8",
                        "--lora-modules", f"all={models.paths['all']}", qv,
                        "--allow-runtime-lora-updating") as proc:
        yield proc


@pytest.fixture(scope="module")
def http(lora_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lora_server.url, timeout=120) as client:
        yield client


def _ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]


def _completion(model: str | None, **extra: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    return body if model is None else {**body, "model": model}


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": MESSAGES, "max_completion_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, **extra}


def _events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed response (``[DONE]`` left out)."""
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


# -- requests pick the adapter by model --------------------------------------------------------


def test_adapters_change_the_output(models: Models) -> None:
    """Guards the comparisons below: each adapter's tokens differ from the base model's and
    from each other's."""
    ids = models.tokenizer.encode(PROMPT)
    tokens = {name: tuple(models.greedy(name, ids)) for name in (None, *ADAPTERS)}
    assert len(set(tokens.values())) == len(tokens), tokens


@pytest.mark.parametrize("model", [None, BASE, "all", "qv"])
def test_completion_runs_the_named_adapter(http: httpx.Client, models: Models,
                                           model: str | None) -> None:
    body = _ok(http.post("/v1/completions", json=_completion(model)))
    assert body["model"] == (model or BASE)
    expected = models.greedy(model, models.tokenizer.encode(PROMPT))
    assert body["choices"][0]["token_ids"] == expected


def test_streamed_completion_runs_the_adapter(http: httpx.Client, models: Models) -> None:
    events = _events(http, "/v1/completions", _completion("qv"))
    assert {e["model"] for e in events} == {"qv"}
    streamed = [t for e in events for c in e["choices"] for t in c["token_ids"] or []]
    assert streamed == models.greedy("qv", models.tokenizer.encode(PROMPT))


def test_chat_runs_the_adapter_streamed_or_not(http: httpx.Client, models: Models) -> None:
    body = _ok(http.post("/v1/chat/completions", json=_chat("all")))
    assert body["model"] == "all"
    expected = models.greedy("all", body["prompt_token_ids"])
    assert body["choices"][0]["token_ids"] == expected
    events = _events(http, "/v1/chat/completions", _chat("all"))
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids") or []] == expected


def test_responses_api_runs_the_adapter(http: httpx.Client) -> None:
    """/v1/responses is served by the chat handler: the same text as chat with the adapter,
    which is not the base model's."""
    def chat_text(model: str) -> str:
        return _ok(http.post("/v1/chat/completions", json={
            "model": model, "messages": MESSAGES, "max_completion_tokens": MAX_TOKENS,
            "temperature": 0}))["choices"][0]["message"]["content"]

    response = _ok(http.post("/v1/responses", json={
        "model": "qv", "input": MESSAGES[0]["content"], "max_output_tokens": MAX_TOKENS,
        "temperature": 0}))
    assert response["model"] == "qv"
    assert response["output"][-1]["content"][0]["text"] == chat_text("qv") != chat_text(BASE)


def test_beam_search_runs_the_adapter(http: httpx.Client, models: Models) -> None:
    body = _ok(http.post("/v1/completions", json={
        "model": "all", "prompt": PROMPT, "n": 2, "max_tokens": 3, "use_beam_search": True,
        "ignore_eos": True, "return_token_ids": True}))
    expected = hf_beam_search(models.merged["all"], models.tokenizer.encode(PROMPT), 2, 3)
    assert [c["token_ids"] for c in body["choices"]] == [tokens for tokens, _ in expected]


def test_metrics_name_the_running_adapters(http: httpx.Client) -> None:
    """vLLM's lora_requests_info: while a "qv" request streams, its labels name it."""
    body = {**_completion("qv", max_tokens=MAX_MODEL_LEN // 2), "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(3):  # a few chunks in: steps have run with the request
            next(lines)
        metrics = http.get("/metrics").text
    info = [line for line in metrics.splitlines()
            if line.startswith("pagedserve:lora_requests_info{")]
    assert len(info) == 1, info
    assert 'max_lora="2"' in info[0] and 'running_lora_adapters="qv"' in info[0], info[0]


def test_bench_serve_spreads_requests_over_the_adapters(lora_server: ServerProcess,
                                                       tmp_path: Path) -> None:
    """``pagedserve bench serve --lora-modules`` (vLLM's option): each request names one of
    the adapters as its model, and every one is served."""
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve",
           "--base-url", lora_server.url, "--num-prompts", "12", "--input-len", "6",
           "--output-len", "3", "--lora-modules", "all", "qv", "--result-dir", str(tmp_path),
           "--result-filename", "run.json", "--disable-tqdm"]
    run = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["lora_modules"] == ["all", "qv"]
    assert {r["model"] for r in result["requests"]} == {"all", "qv"}


def test_unknown_model_keeps_its_404(http: httpx.Client) -> None:
    err = _error(http.post("/v1/completions", json=_completion("nope")), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert "`nope`" in err["message"] and "all" in err["message"]
    # /tokenize takes an adapter's name too: the tokenizer is the base model's
    assert _ok(http.post("/tokenize", json={"model": "all", "prompt": "hi"}))["count"] > 0
    assert _error(http.post("/tokenize", json={"model": "nope", "prompt": "hi"}), 404)


# -- /v1/models --------------------------------------------------------------------------------


def test_models_list_the_adapters_after_the_base(http: httpx.Client, models: Models) -> None:
    cards = _ok(http.get("/v1/models"))["data"]
    base, adapters = cards[0], {c["id"]: c for c in cards[1:]}
    assert base["id"] == BASE and base["root"] == str(models.folder) and base["parent"] is None
    assert adapters["all"]["root"] == models.paths["all"] and adapters["all"]["parent"] == BASE
    # base_model_name, given in the JSON form of --lora-modules, is the parent
    assert adapters["qv"]["root"] == models.paths["qv"]
    assert adapters["qv"]["parent"] == "tiny-base"
    for card in adapters.values():
        assert card["object"] == "model" and card["owned_by"] == base["owned_by"]
        assert isinstance(card["created"], int)
    assert [c["id"] for c in cards[:3]] == [BASE, "all", "qv"]


# -- runtime updates ---------------------------------------------------------------------------


def test_load_use_unload_and_load_again(http: httpx.Client, models: Models) -> None:
    """An adapter loaded under a name serves its weights; after an unload the name is a 404;
    loaded again from another folder, the name serves the new weights (a fresh id: the
    engine's slot and cache of the old one are never read)."""
    ids = models.tokenizer.encode(PROMPT)
    load = http.post("/v1/load_lora_adapter",
                     json={"lora_name": "swap", "lora_path": models.paths["qv"]})
    assert load.status_code == 200 and "'swap' added successfully" in load.text
    try:
        assert _ok(http.post("/v1/completions", json=_completion("swap"))
                   )["choices"][0]["token_ids"] == models.greedy("qv", ids)
        card = next(c for c in _ok(http.get("/v1/models"))["data"] if c["id"] == "swap")
        assert card["root"] == models.paths["qv"] and card["parent"] == BASE
        again = http.post("/v1/load_lora_adapter",
                          json={"lora_name": "swap", "lora_path": models.paths["mlp"]})
        assert _error(again, 400)["param"] == "lora_name"
        unload = http.post("/v1/unload_lora_adapter", json={"lora_name": "swap"})
        assert unload.status_code == 200 and "'swap' removed successfully" in unload.text
        gone = _error(http.post("/v1/completions", json=_completion("swap")), 404)
        assert gone["param"] == "model" and gone["code"] == "model_not_found"
        assert "swap" not in [c["id"] for c in _ok(http.get("/v1/models"))["data"]]
        twice = _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "swap"}), 404)
        assert twice["param"] == "lora_name" and "swap" in twice["message"]
        _ok_text(http.post("/v1/load_lora_adapter",
                           json={"lora_name": "swap", "lora_path": models.paths["mlp"]}))
        assert _ok(http.post("/v1/completions", json=_completion("swap"))
                   )["choices"][0]["token_ids"] == models.greedy("mlp", ids)
    finally:
        http.post("/v1/unload_lora_adapter", json={"lora_name": "swap"})


def _ok_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.text


def test_bad_loads_and_unloads_are_refused_by_field(http: httpx.Client, models: Models,
                                                    tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    err = _error(http.post("/v1/load_lora_adapter",
                           json={"lora_name": "bad", "lora_path": str(missing)}), 400)
    assert err["param"] == "lora_path" and str(missing) in err["message"]
    (tmp_path / "adapter_config.json").write_text("{}")
    err = _error(http.post("/v1/load_lora_adapter",
                           json={"lora_name": "bad", "lora_path": str(tmp_path)}), 400)
    assert err["param"] == "lora_path" and err["message"].startswith("lora_path:")
    assert _error(http.post("/v1/completions", json=_completion("bad")), 404)["param"] == "model"
    err = _error(http.post("/v1/load_lora_adapter",
                           json={"lora_name": BASE, "lora_path": models.paths["mlp"]}), 400)
    assert err["param"] == "lora_name"
    err = _error(http.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400)
    assert err["param"] == "lora_path"
    err = _error(http.post("/v1/unload_lora_adapter",
                           json={"lora_name": "all", "lora_int_id": 99}), 400)
    assert err["param"] == "lora_int_id"
    assert "all" in [c["id"] for c in _ok(http.get("/v1/models"))["data"]]


# -- without a server --------------------------------------------------------------------------


def _app(tmp_path: Path, **settings: Any) -> Any:
    """The server's app over an engine that never starts (routes and checks only)."""
    engine = types.SimpleNamespace(config=EngineConfig(), model_path=tmp_path,
                                   state=EngineState.STARTING, input_processor=None)
    return build_app(engine, ServerMetrics(BASE),  # type: ignore[arg-type]
                     ServerSettings(served_model_names=[BASE], model_root=BASE, **settings))


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST in process (no lifespan: the engine is never started)."""
    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.post(path, json=body)

    return asyncio.run(post())


def test_runtime_routes_need_the_flag_and_lora(tmp_path: Path) -> None:
    body = {"lora_name": "a", "lora_path": str(tmp_path)}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        _error(_post(_app(tmp_path), path, body), 404)
    app = _app(tmp_path, allow_runtime_lora_updating=True)  # but no --enable-lora
    err = _error(_post(app, "/v1/load_lora_adapter", body), 400)
    assert err["param"] == "lora_name" and "--enable-lora" in err["message"]


def test_lora_modules_need_enable_lora_and_distinct_names(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """Refused before the server listens or loads anything: one line, exit 2."""
    for argv, needle in (
        (["--lora-modules", "a=/x"], "--lora-modules: serving LoRA adapters needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a=/x", '{"name": "a", "path": "/y"}'],
         "--lora-modules a: the name is given twice"),
        (["--enable-lora", "--lora-modules", "m=/x"], "the base model's served name"),
    ):
        assert cli.main(["serve", "m", "--port", "0", *argv]) == cli.USAGE_ERROR
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err
    with pytest.raises(SystemExit):
        cli.main(["serve", "m", "--lora-modules", "no-equals-sign"])
    assert "expected NAME=PATH or a JSON object" in capsys.readouterr().err


def test_a_bad_module_stops_the_start_naming_it(models: Models) -> None:
    """The start-up check of --lora-modules: ids 1, 2, ... in order; the first bad module is
    named (a missing folder, a rank above --max-lora-rank)."""
    hf_config = AutoConfig.from_pretrained(models.folder)
    checker = LoRAChecker(hf_config, LoRAConfig(enable_lora=True, max_lora_rank=8))
    good = [LoRAModulePath("all", models.paths["all"]), LoRAModulePath("qv", models.paths["qv"])]
    assert [(r.lora_name, r.lora_int_id) for r in served_lora_requests(good, checker)] == [
        ("all", 1), ("qv", 2)]
    with pytest.raises(ValueError, match=r"^--lora-modules gone: lora_path: "):
        served_lora_requests([*good, LoRAModulePath("gone", "/nonexistent")], checker)
    narrow = LoRAChecker(hf_config, LoRAConfig(enable_lora=True, max_lora_rank=4))
    with pytest.raises(ValueError, match=r"^--lora-modules all: .*max_lora_rank"):
        served_lora_requests(good, narrow)
