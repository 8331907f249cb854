"""The page's JavaScript modules in Chromium, without a server: Playwright answers the
page's requests from the package's ``static/`` folder. Parsing that a real server rarely
exercises: Prometheus label values with spaces, braces and quotes, SSE events cut anywhere."""

from __future__ import annotations

import mimetypes
from collections.abc import Iterator

import pytest
from playwright.sync_api import BrowserContext, Page, Route

from pagedserve.entrypoints.openai.web import STATIC_DIR

ORIGIN = "http://pagedserve.test"


def _serve_static(route: Route) -> None:
    path = route.request.url.removeprefix(ORIGIN)
    if path == "/":
        route.fulfill(body="<!doctype html><title>modules</title>", content_type="text/html")
        return
    file = STATIC_DIR / path.removeprefix("/static/")
    if not path.startswith("/static/") or not file.is_file():
        route.fulfill(status=404)
        return
    route.fulfill(body=file.read_bytes(), content_type=mimetypes.guess_type(file.name)[0])


@pytest.fixture
def modules_page(context: BrowserContext, page: Page) -> Iterator[Page]:
    context.route(f"{ORIGIN}/**", _serve_static)
    page.goto(f"{ORIGIN}/")
    yield page


def run_module(page: Page, module: str, body: str, arg: object = None) -> object:
    """Runs ``body`` (an async function body with the module as ``m`` and ``arg``) in the page."""
    return page.evaluate(
        f"async (arg) => {{ const m = await import('/static/{module}'); {body} }}", arg)


PROMETHEUS_TEXT = r"""# HELP pagedserve:num_requests_running Requests in the running batch.
# TYPE pagedserve:num_requests_running gauge
pagedserve:num_requests_running{model_name="a b} \"c\""} 2.0
pagedserve:num_requests_running{model_name="other\\model"} 1.0
pagedserve:num_requests_waiting{model_name="m"} 3 1700000000000
pagedserve:kv_cache_usage_perc{model_name="m"} 0.25
pagedserve:generation_tokens_total{model_name="m"} 1.5e+03
pagedserve:generation_tokens_created{model_name="m"} 1.7e+09
pagedserve:prefix_cache_queries_total{model_name="m"} 200.0
pagedserve:prefix_cache_hits_total{model_name="m"} 50.0
pagedserve:num_preemptions_total 4
pagedserve:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 7.0
broken{model_name="unterminated} 1
"""


def test_prometheus_text_is_parsed(modules_page: Page) -> None:
    result = run_module(modules_page, "prometheus.js", """
        const totals = m.parsePrometheus(arg);
        const previous = { totals: new Map([["pagedserve:generation_tokens_total", 1000]]), time: 10 };
        return { totals: Object.fromEntries(totals),
                 snapshot: m.engineSnapshot(totals, 12, previous),
                 restarted: m.engineSnapshot(totals, 12, { totals: new Map([
                     ["pagedserve:generation_tokens_total", 5000]]), time: 10 }).tokensPerSecond,
                 first: m.engineSnapshot(totals, 12, null).tokensPerSecond,
                 inf: m.parseSample('x_bucket{le="+Inf"} +Inf').value,
                 labels: m.parseSample(arg.split("\\n")[2]).labels };
    """, PROMETHEUS_TEXT)
    assert result["totals"]["pagedserve:num_requests_running"] == 3  # two models add up
    assert "broken" not in result["totals"]
    assert result["labels"] == {"model_name": 'a b} "c"'}
    assert result["snapshot"] == {
        "running": 3, "waiting": 3, "kvUsage": 0.25, "prefixHitRate": 0.25, "preemptions": 4,
        "promptTokens": 0, "generationTokens": 1500, "tokensPerSecond": 250,
    }
    assert result["restarted"] == 750  # the counter restarted from 0: all 1500 are new
    assert result["first"] is None
    assert result["inf"] == float("inf")


def test_sse_events_survive_any_chunking(modules_page: Page) -> None:
    stream = 'data: {"a": 1}\r\n\r\n: a comment\n\ndata: line one\ndata:line two\n\nid: 7\ndata: [DONE]\n\ndata: cut'
    result = run_module(modules_page, "sse.js", """
        const splits = [];
        for (let size = 1; size <= arg.length; size += 1) {
          const parser = new m.SSEParser();
          const events = [];
          for (let i = 0; i < arg.length; i += size) events.push(...parser.push(arg.slice(i, i + size)));
          parser.end();
          splits.push(events);
        }
        return splits;
    """, stream)
    expected = ['{"a": 1}', "line one\nline two", "[DONE]"]  # the unterminated event is dropped
    assert all(events == expected for events in result), result


def test_sse_events_from_a_response_body(modules_page: Page) -> None:
    result = run_module(modules_page, "sse.js", """
        const bytes = new TextEncoder().encode("data: h\\u00e9llo\\n\\ndata: [DONE]\\n\\n");
        const body = new ReadableStream({ start(c) {  // a multi-byte character cut in two
          c.enqueue(bytes.slice(0, 8)); c.enqueue(bytes.slice(8)); c.close(); } });
        const events = [];
        for await (const data of m.sseEvents(body)) events.push(data);
        return events;
    """)
    assert result == ["héllo", "[DONE]"]


def test_stop_sequences_and_chart_scale(modules_page: Page) -> None:
    stops = run_module(modules_page, "settings.js", "return m.parseStops(arg);",
                       "END\n\\n\n\nback\\\\slash\\t")
    assert stops == ["END", "\n", "back\\slash\t"]
    maxima = run_module(modules_page, "chart.js", "return arg.map(m.niceMax);", [3, 4, 5, 30, 280])
    assert maxima == [4, 4, 8, 40, 400]  # four grid steps of 1, 2 or 5 x 10^k


def test_answer_stats(modules_page: Page) -> None:
    result = run_module(modules_page, "chat.js", """
        const base = { text: "abc", pieces: 3, start: 0, firstAt: 500, lastAt: 2500, end: 2600 };
        const done = { ...base, stopped: false, finishReason: "length",
                       usage: { prompt_tokens: 9, completion_tokens: 5 } };
        const stopped = { ...base, stopped: true, finishReason: null, usage: null };
        return [m.formatStats(m.answerStats(done)), m.formatStats(m.answerStats(stopped))];
    """)
    assert result == [
        "5 tokens · 2.0 tok/s · first token 0.50 s · 2.60 s total · prompt 9 tokens · finish: length",
        "~3 tokens · 1.0 tok/s · first token 0.50 s · 2.60 s total · stopped",
    ]
