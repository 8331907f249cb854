"""The web page in headless Chromium against a real server without an API key: a streamed
chat with its counts, the settings in the request, stop generating, and the engine panel."""

from __future__ import annotations

import re
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from playwright.sync_api import Page, expect

from tests.entrypoints.openai.server_utils import ServerProcess, metric_value
from tests.entrypoints.web.chat_page import ChatPage
from tests.entrypoints.web.conftest import wait_until

LONG_ANSWER = 30000
"""max_tokens for an answer that is still streaming when the test presses stop (seconds)."""
ABORT_DEADLINE_S = 2.0


def test_page_loads_everything_from_the_server(page: Page, open_server: ServerProcess) -> None:
    hosts: set[str] = set()
    page.on("request", lambda request: hosts.add(urlparse(request.url).netloc))
    ChatPage(page, open_server.url).open()
    assert hosts == {f"127.0.0.1:{open_server.port}"}
    assert page.locator("#model-name").text_content() == httpx.get(
        f"{open_server.url}/v1/models").json()["data"][0]["id"]
    expect(page.locator("#key-banner")).to_be_hidden()
    schema = httpx.get(f"{open_server.url}/openapi.json").json()
    assert "/" not in schema["paths"], "the page is not part of the API schema"


def test_chat_streams_an_answer_with_its_counts(page: Page, open_server: ServerProcess,
                                                artifacts_dir: Path) -> None:
    chat = ChatPage(page, open_server.url).open()
    chat.settings(max_tokens=24, system="You are terse.")
    with page.expect_request("**/v1/chat/completions") as sent:
        chat.send("Hello there")
    answer = chat.wait_answer_done()
    assert answer.get_attribute("data-finish") == "length"
    assert answer.get_attribute("data-completion-tokens") == "24"
    assert chat.answer_text() != ""
    meta = answer.locator(".meta").text_content()
    # The prompt count is the server's: the chat template over the system prompt and message.
    rendered = httpx.post(f"{open_server.url}/tokenize",
                          json={"messages": sent.value.post_data_json["messages"]}).json()
    # No tok/s when every token arrived with the first chunk (a busy CI machine): there is no
    # decode interval to divide by. test_page_modules checks the figure itself.
    assert re.fullmatch(r"24 tokens (· [\d.]+ tok/s )?· first token [\d.]+ s · [\d.]+ s total · "
                        rf"prompt {rendered['count']} tokens · finish: length", meta), meta
    assert sent.value.post_data_json["messages"][0] == {"role": "system", "content": "You are terse."}

    # A second turn carries the conversation.
    with page.expect_request("**/v1/chat/completions") as second:
        chat.send("And then?")
    chat.wait_answer_done()
    roles = [m["role"] for m in second.value.post_data_json["messages"]]
    assert roles == ["system", "user", "assistant", "user"]
    time.sleep(1.2)  # one more poll of the engine panel: the screenshot shows the counters
    page.screenshot(path=artifacts_dir / "chat.png")


def test_settings_go_into_the_request_and_are_kept(page: Page, open_server: ServerProcess) -> None:
    chat = ChatPage(page, open_server.url).open()
    chat.settings(max_tokens=5, temperature=0.3, top_p=0.5, stop="END\n\\n", ignore_eos=True)
    with page.expect_request("**/v1/chat/completions") as sent:
        chat.send("Hi")
    chat.wait_answer_done()
    body = sent.value.post_data_json
    assert {k: body[k] for k in ("temperature", "top_p", "max_tokens", "stop", "ignore_eos",
                                 "stream", "stream_options", "model")} == {
        "temperature": 0.3, "top_p": 0.5, "max_tokens": 5, "stop": ["END", "\n"],
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        "model": page.locator("#model-name").text_content(),
    }
    assert "authorization" not in sent.value.headers  # no key set, none sent

    page.reload()
    expect(page.locator("#top-p")).to_have_value("0.5")
    expect(page.locator("#stop-sequences")).to_have_value("END\n\\n")
    expect(page.locator("#ignore-eos")).to_be_checked()


@pytest.mark.serial  # aborted within 2 s
def test_stop_generating_aborts_the_request(page: Page, open_server: ServerProcess) -> None:
    url = open_server.url
    chat = ChatPage(page, url).open()
    generated_before = metric_value(url, "pagedserve:generation_tokens_total")
    chat.settings(max_tokens=LONG_ANSWER)
    chat.send("Tell me everything.")

    # Streamed: the text grows while the answer is still open.
    wait_until(lambda: len(chat.answer_text()) > 0, 30, "the first streamed text")
    first = len(chat.answer_text())
    wait_until(lambda: len(chat.answer_text()) > first, 10, "more streamed text")
    # The engine panel follows: one request running, tokens per second, the chart's line.
    expect(chat.metric("running")).to_have_text("1", timeout=5000)
    wait_until(lambda: (chat.metric_value("tokensPerSecond") or 0) > 0, 5, "tokens/s in the panel")
    wait_until(lambda: chat.tokens_chart_line_pixels() > 0, 5, "the tokens/s line in the chart")
    expect(page.locator("#send")).to_be_disabled()

    page.click("#stop")
    took = wait_until(lambda: metric_value(url, "pagedserve:num_requests_running") == 0,
                      ABORT_DEADLINE_S, "the server to abort the request")
    assert took < ABORT_DEADLINE_S
    wait_until(lambda: metric_value(url, "pagedserve:kv_cache_usage_perc") == 0, 1.0,
               "the request's KV blocks to be freed")
    generated = metric_value(url, "pagedserve:generation_tokens_total") - generated_before
    assert 0 < generated < LONG_ANSWER, "the answer ran to max_tokens: stop did not abort it"

    answer = chat.answer()
    expect(answer).to_have_attribute("data-finish", "stopped")
    assert re.match(r"~\d+ tokens · .* · stopped$", answer.locator(".meta").text_content())
    expect(page.locator("#stop")).to_be_hidden()
    expect(page.locator("#send")).to_be_enabled()
    expect(chat.metric("running")).to_have_text("0", timeout=3000)
    text = chat.answer_text()
    time.sleep(0.3)
    assert chat.answer_text() == text, "text kept arriving after stop"

    # The stopped answer stays in the conversation; the next one streams as usual.
    chat.settings(max_tokens=4)
    with page.expect_request("**/v1/chat/completions") as sent:
        chat.send("Short, please.")
    assert chat.wait_answer_done().get_attribute("data-finish") == "length"
    assert sent.value.post_data_json["messages"][1] == {"role": "assistant", "content": text}
