"""The API process's resident memory while it refuses big prompts, request after request.

``rss_trace`` is what ``test_big_prompt_memory.py`` checks on the shared server. Run as a
script, it starts its own server (the tests' tiny Llama, a longer context) and prints the
trace for a 7.8 MB prompt (refused from its character count, never tokenized) and for the
longest prompt the context's character bound lets through (tokenized in the tokenizer thread,
then refused)::

    TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python \\
        -m tests.reliability.big_prompt_memory --requests 60
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import httpx

from tests.engine.tiny_models import save_checkpoint
from tests.entrypoints.openai.server_utils import ServerProcess
from tests.reliability.reliability_utils import rss_bytes

HUGE_PROMPT = "ab " * 2_600_000
"""7.8 MB: under the 8 MiB body limit."""
SETTLE_S = 0.5


def api_rss_mib(server: ServerProcess) -> float:
    gc.collect()
    time.sleep(SETTLE_S)  # the last response's buffers are freed after it is sent
    return rss_bytes(server.proc.pid) / 2**20


def rss_trace(server: ServerProcess, prompt: str, requests: int, every: int) -> list[float]:
    """API RSS (MiB) before the first request and after each ``every`` of ``requests``
    completions of ``prompt``, each answered 400 (too long for the context)."""
    trace = [api_rss_mib(server)]
    with httpx.Client(timeout=300) as client:
        for i in range(requests):
            r = client.post(f"{server.url}/v1/completions", json={"prompt": prompt})
            assert r.status_code == 400 and "context_length" in r.text, r.text
            if (i + 1) % every == 0:
                trace.append(api_rss_mib(server))
    return trace


def _report(name: str, prompt: str, server: ServerProcess, requests: int) -> None:
    rss_trace(server, prompt, 2, 2)  # warm-up: the allocator's first growth
    trace = rss_trace(server, prompt, requests, 10)
    growth = (trace[-1] - trace[0]) / requests
    print(f"{name} ({len(prompt):,} characters), {requests} requests after 2 warm-up: "
          f"API RSS every 10 requests {[round(m) for m in trace]} MiB "
          f"({growth:+.2f} MiB per request)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-model-len", type=int, default=16384)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder)
        save_checkpoint("llama", model)
        config = json.loads((model / "config.json").read_text())
        config["max_position_embeddings"] = args.max_model_len
        (model / "config.json").write_text(json.dumps(config))
        server = ServerProcess(model, model / "server.log", "--max-model-len",
                               str(args.max_model_len), "--max-num-batched-tokens", "256")
        try:
            server.wait_ready()
            _report("7.8 MB prompt", HUGE_PROMPT, server, args.requests)
            bound = httpx.post(f"{server.url}/v1/completions", json={"prompt": HUGE_PROMPT})
            longest = int(bound.json()["error"]["message"].rsplit("at most ", 1)[1].rstrip(")"))
            _report("longest prompt under the bound", "x " * (longest // 2), server,
                    args.requests)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
