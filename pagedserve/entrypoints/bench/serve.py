"""Serving benchmark: load a running OpenAI-compatible server over HTTP (like vllm bench serve).

``pagedserve bench serve --port 8000 --num-prompts 200 --request-rate 8`` sends streaming
requests of random prompts (``--input-len`` / ``--output-len`` tokens, ``--range-ratio``
spread; ``ignore_eos`` so each runs to its length) at Poisson arrival times, or all at once
(``--request-rate inf``), at most ``--max-concurrency`` in flight; shows a progress bar; prints
request and token throughput and TTFT / TPOT / ITL / end-to-end latency (mean, median, p99);
and writes the results as JSON and the latencies as a PNG plot.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
from pathlib import Path
from typing import Any

import httpx

from pagedserve.entrypoints.bench.serve_client import ENDPOINT_PATHS, request_body, send_request
from pagedserve.entrypoints.bench.serve_dataset import (
    PROMPT_KINDS,
    PromptKind,
    SampleRequest,
    sample_requests,
)
from pagedserve.entrypoints.bench.serve_metrics import format_summary, parse_percentiles, summarize
from pagedserve.entrypoints.bench.serve_report import write_json, write_plot
from pagedserve.entrypoints.bench.serve_run import run_load
from pagedserve.entrypoints.bench.serve_structured import STRUCTURED_KINDS, structured_fields

USES_ENGINE = False
"""It talks to a server: no engine options."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    _add_server_args(parser.add_argument_group("server"))
    _add_workload_args(parser.add_argument_group("workload"))
    _add_load_args(parser.add_argument_group("load"))
    _add_result_args(parser.add_argument_group("results"))


def _add_server_args(server: argparse._ArgumentGroup) -> None:
    server.add_argument(
        "--base-url", default=None, help="e.g. http://host:8000 (default: from --host/--port)"
    )
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--endpoint",
        choices=list(ENDPOINT_PATHS),
        default="completions",
        help="the API to load (default: completions)",
    )
    server.add_argument(
        "--model", default=None, help="served model name (default: the server's first)"
    )
    server.add_argument(
        "--api-key", default=None, help="sent as a Bearer token (default: $OPENAI_API_KEY)"
    )


def _add_workload_args(work: argparse._ArgumentGroup) -> None:
    work.add_argument("--num-prompts", type=int, default=100)
    work.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    work.add_argument("--output-len", type=int, default=128, help="output tokens")
    work.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed)",
    )
    work.add_argument(
        "--prompt-kind",
        choices=PROMPT_KINDS,
        default=None,
        help="token-ids (completions only) or random text (default: token-ids for completions, text for chat)",
    )
    work.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the output length (default: on)",
    )
    work.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="served LoRA adapters (vLLM's option): each request names one of them, drawn at "
        "random (seeded by --seed), as its model",
    )
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--seed", type=int, default=0)
    work.add_argument(
        "--structured",
        choices=STRUCTURED_KINDS,
        default="none",
        help="constrain every answer: a ten-field JSON schema, any JSON object, or a choice",
    )


def _add_load_args(load: argparse._ArgumentGroup) -> None:
    load.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")


def _add_result_args(out: argparse._ArgumentGroup) -> None:
    out.add_argument("--result-dir", default=".", help="folder of the JSON and PNG files")
    out.add_argument(
        "--result-filename",
        default=None,
        help="JSON file name; the PNG takes its stem (default: bench-serve-ENDPOINT-TIME.json)",
    )
    out.add_argument(
        "--metric-percentiles",
        default="99",
        help="comma-separated, besides the median (default: 99)",
    )
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    percentiles = parse_percentiles(args.metric_percentiles)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompt_kind: PromptKind = args.prompt_kind or ("token-ids" if args.endpoint == "completions" else "text")
    if args.endpoint == "chat" and prompt_kind == "token-ids":
        raise ValueError("prompt_kind: the chat API takes text prompts (--prompt-kind text)")
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as http:
        model = args.model or _first_model(http)
        samples = sample_requests(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.range_ratio,
            prompt_kind,
            args.seed,
            tokenize=lambda text: _tokenize(http, model, text),
            detokenize=lambda ids: _detokenize(http, model, ids),
        )
    sampling = {"temperature": args.temperature, "ignore_eos": args.ignore_eos,
                **structured_fields(args.structured)}
    results, duration = asyncio.run(
        _load(args, base_url + ENDPOINT_PATHS[args.endpoint], headers, model, samples, sampling)
    )
    summary = summarize(results, duration, percentiles)
    print(format_summary(summary, percentiles))
    settings = _settings(args, base_url, model, prompt_kind)
    json_path = _result_path(args)
    write_json(json_path, settings, summary, results)
    png_path = json_path.with_suffix(".png")
    write_plot(png_path, _plot_title(settings, summary), results)
    print(f"results: {json_path}\nlatency plot: {png_path}")
    failed = [r for r in results if not r.success]
    if failed:
        print(f"{len(failed)} requests failed; the first: {failed[0].error}")
    return 0 if summary["completed"] else 1


async def _load(
    args: argparse.Namespace,
    url: str,
    headers: dict[str, str],
    model: str,
    samples: list[SampleRequest],
    sampling: dict[str, Any],
) -> tuple[list, float]:
    in_flight = args.max_concurrency or len(samples)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    async with httpx.AsyncClient(
        headers=headers, timeout=args.request_timeout, limits=limits
    ) as http:

        models = request_models(model, args.lora_modules, len(samples), args.seed)
        next_model = iter(models).__next__

        async def send(sample: SampleRequest):  # noqa: ANN202
            body = request_body(args.endpoint, next_model(), sample, sampling)
            return await send_request(http, url, body, sample.prompt_len)

        return await run_load(
            samples,
            send,
            args.request_rate,
            args.max_concurrency,
            args.seed,
            show_progress=not args.disable_tqdm,
        )


def request_models(model: str, lora_modules: list[str] | None, count: int,
                   seed: int) -> list[str]:
    """The model each of ``count`` requests names, in sending order: ``model``, or without
    it one of ``lora_modules`` drawn at random for each."""
    if not lora_modules:
        return [model] * count
    rng = random.Random(seed)
    return [rng.choice(lora_modules) for _ in range(count)]


def _get_json(http: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    """A setup call to the server; an unreachable or failing server is a ValueError (one line
    from the CLI)."""
    try:
        response = http.request(method, path, **kwargs)
    except httpx.HTTPError as e:
        raise ValueError(f"base_url: cannot reach {http.base_url}{path}: {e}") from e
    if response.status_code != 200:
        raise ValueError(f"{path}: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()


def _first_model(http: httpx.Client) -> str:
    models = _get_json(http, "GET", "/v1/models")["data"]
    if not models:
        raise ValueError("model: the server lists no model")
    return models[0]["id"]


def _tokenize(http: httpx.Client, model: str, text: str) -> list[int]:
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    return _get_json(http, "POST", "/tokenize", json=body)["tokens"]


def _detokenize(http: httpx.Client, model: str, ids: list[int]) -> str:
    return _get_json(http, "POST", "/detokenize", json={"model": model, "tokens": ids})["prompt"]


def _settings(
    args: argparse.Namespace, base_url: str, model: str, prompt_kind: str
) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model": model,
        "num_prompts": args.num_prompts,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "prompt_kind": prompt_kind,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
        "structured": args.structured,
        "lora_modules": args.lora_modules,
    }


def _result_path(args: argparse.Namespace) -> Path:
    folder = Path(args.result_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.result_filename or f"bench-serve-{args.endpoint}-{stamp}.json"
    return folder / name


def _plot_title(settings: dict[str, Any], summary: dict[str, Any]) -> str:
    return (
        f"{settings['model']} ({settings['endpoint']}): {summary['completed']} requests, "
        f"rate {settings['request_rate']}, concurrency {settings['max_concurrency'] or 'any'}, "
        f"in {settings['input_len']} / out {settings['output_len']} tokens; "
        f"{summary['output_throughput']:.1f} output tok/s"
    )
