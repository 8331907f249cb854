"""The API process does not keep memory per huge prompt: 7.8 MB prompts, refused from their
character count, leave its resident memory where the first few left it."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.server_utils import ServerProcess
from tests.reliability.big_prompt_memory import HUGE_PROMPT, rss_trace

pytestmark = pytest.mark.serial  # resident memory of the API process

WARMUP_REQUESTS = 10
REQUESTS = 30
MAX_GROWTH_MIB = 200.0
"""For all ``REQUESTS`` together (under 7 MiB each): the allocator keeps some freed pages, so the
resident size moves by tens of MiB between samples without growing with the count."""


def test_huge_prompts_leave_no_memory_behind(main_server: ServerProcess, figures: dict) -> None:
    rss_trace(main_server, HUGE_PROMPT, WARMUP_REQUESTS, WARMUP_REQUESTS)
    trace = rss_trace(main_server, HUGE_PROMPT, REQUESTS, 10)
    figures["7.8 MB prompts: API RSS after warm-up, then every 10 requests"] = (
        f"{[round(m) for m in trace]} MiB ({WARMUP_REQUESTS} warm-up requests, then {REQUESTS})"
    )
    assert trace[-1] - trace[0] < MAX_GROWTH_MIB, trace
