"""Property-based fuzzing from the server's own ``/openapi.json`` (schemathesis): bodies that
fit the schema and bodies that break it, for every operation, a bounded number of cases each.
No answer may be a 5xx, every 4xx is in OpenAI's error shape, no call may hang, and the engine
is alive and idle afterwards. Cases are derandomized: CI runs the same ones every time."""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.entrypoints.openai.server_utils import ServerProcess
from tests.reliability.reliability_utils import wait_idle

CASES_PER_OPERATION = 30
MAX_FUZZ_N = 4
CALL_TIMEOUT_S = 30.0
"""A call slower than this is a hang (the server's context is 64 tokens: any request is short)."""
SKIPPED_PATHS = {"/metrics"}
"""Plain text, nothing to fuzz."""

EDGE_BODIES = [
    {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 3},
    {"prompt": [0], "max_tokens": 1, "echo": True, "logprobs": 20},
    {"prompt": "hi", "max_tokens": 2, "top_k": 10**9, "min_p": 1.0, "repetition_penalty": 2.0},
    {"prompt": "hi", "max_tokens": 4, "n": 128, "temperature": 0},
    {"prompt": "hi", "max_tokens": 2, "logit_bias": {"0": 100, "1": -100}, "min_tokens": 10**6},
    {"prompt": "hi", "max_tokens": 3, "stream": True, "timeout": 1e-9},
]
"""Valid requests at the edges of the schema (the first one once killed the engine: a child
seed past 2**63)."""


def _openai_shaped_4xx(ctx, response, case) -> bool | None:
    """A schemathesis check: a 4xx answer carries ``{"error": {message, type, param, code}}``."""
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
    return None


def _operations(url: str) -> list:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    return [op for op in operations if op.path not in SKIPPED_PATHS]


def _cheap(case):
    """Bound a valid case's cost: at most ``MAX_FUZZ_N`` completions (n = 128 at the full
    context takes seconds on a CPU; ``EDGE_BODIES`` has a short n = 128 request)."""
    if isinstance(case.body, dict) and isinstance(case.body.get("n"), int):
        case.body["n"] = min(case.body["n"], MAX_FUZZ_N)
    return case


def _fuzz(operation, url: str, counts: dict[str, int]) -> None:
    strategy = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE).map(_cheap),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @settings(
        max_examples=CASES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case) -> None:
        start = time.monotonic()
        response = case.call(base_url=url, timeout=CALL_TIMEOUT_S)
        assert time.monotonic() - start < CALL_TIMEOUT_S
        case.validate_response(response, checks=[not_a_server_error, _openai_shaped_4xx])
        key = f"{response.status_code // 100}xx"
        counts[key] = counts.get(key, 0) + 1

    run()


def test_fuzz_from_openapi_schema(main_server: ServerProcess, figures: dict) -> None:
    url = main_server.url
    operations = _operations(url)
    assert {"/v1/completions", "/v1/chat/completions"} <= {op.path for op in operations}
    counts: dict[str, int] = {}
    start = time.monotonic()
    for operation in operations:
        _fuzz(operation, url, counts)
    elapsed = time.monotonic() - start
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    wait_idle(url, timeout=10.0)
    figures["fuzz: operations / cases by answer (no 5xx, no hang)"] = (
        f"{len(operations)} / {counts} in {elapsed:.0f} s"
    )


@pytest.mark.parametrize("body", EDGE_BODIES, ids=[str(i) for i in range(len(EDGE_BODIES))])
def test_edge_values_are_served_or_refused(
    main_server: ServerProcess, model_name: str, body: dict
) -> None:
    url = main_server.url
    response = httpx.post(
        f"{url}/v1/completions", json={"model": model_name, **body}, timeout=CALL_TIMEOUT_S
    )
    assert response.status_code < 500, response.text
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
