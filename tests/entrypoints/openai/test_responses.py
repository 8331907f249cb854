"""``usage.prompt_tokens_details.cached_tokens`` (full and streamed) and the prefix-cache hit
rate on ``/metrics``."""

from __future__ import annotations

import json
import re

import httpx

from tests.entrypoints.openai.server_utils import API_KEY, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BLOCK_SIZE = 16  # the server's default --block-size
LONG_PROMPT = " ".join(f"word{i}" for i in range(120))


def _streamed_usage(response: httpx.Response) -> dict:
    events = [line[len("data: "):] for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return json.loads(events[-1])["usage"]


def test_repeated_prompt_reports_cached_tokens(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        def complete(**fields: object) -> httpx.Response:
            r = http.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 1,
                                                   "temperature": 0, **fields})
            assert r.status_code == 200, r.text
            return r

        complete(seed=1)  # fills the cache (the shared server may have seen it: no check)
        usage = complete().json()["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < usage["prompt_tokens"] and cached % BLOCK_SIZE == 0
        streamed = _streamed_usage(complete(stream=True, stream_options={"include_usage": True}))
        assert streamed["prompt_tokens_details"]["cached_tokens"] == cached
        chat = {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 1}
        for _ in range(2):
            r = http.post("/v1/chat/completions", json=chat)
        chat_cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert chat_cached > 0 and chat_cached % BLOCK_SIZE == 0
        r = http.post("/v1/chat/completions", json={
            **chat, "stream": True, "stream_options": {"include_usage": True}})
        assert _streamed_usage(r)["prompt_tokens_details"]["cached_tokens"] == chat_cached
        metrics = http.get("/metrics").text
    match = re.search(r"^pagedserve:prefix_cache_hit_rate\{[^}]*\} (\S+)$", metrics, re.M)
    assert match is not None and 0.0 < float(match.group(1)) <= 1.0
