"""The web page against a server started with ``--api-key``: the page and its files are
served without the key, the page asks for it, keeps it, and sends it as a Bearer token."""

from __future__ import annotations

from pathlib import Path

import httpx
from playwright.sync_api import Page, expect

from pagedserve.entrypoints.openai.web import STATIC_DIR
from tests.entrypoints.openai.server_utils import API_KEY, ServerProcess
from tests.entrypoints.web.chat_page import ChatPage
from tests.entrypoints.web.conftest import PageErrors

UNAUTHORIZED = "status of 401"
"""Chromium's console error for each 401 answer the test provokes on purpose."""


def test_page_and_files_need_no_key(key_server: ServerProcess) -> None:
    page = httpx.get(f"{key_server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for file in sorted(STATIC_DIR.iterdir()):
        served = httpx.get(f"{key_server.url}/static/{file.name}")
        assert served.status_code == 200, file.name
        assert served.content == file.read_bytes()
    assert httpx.get(f"{key_server.url}/static/missing.js").status_code == 404
    assert httpx.get(f"{key_server.url}/v1/models").status_code == 401


def test_page_asks_for_the_key_and_sends_it(page: Page, page_errors: PageErrors,
                                            key_server: ServerProcess, web_model_dir: Path) -> None:
    page_errors.expected.append(UNAUTHORIZED)
    chat = ChatPage(page, key_server.url).open()
    banner = page.locator("#key-banner")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text("needs an API key")
    expect(page.locator("#model-name")).to_have_text("API key needed")
    expect(page.locator("#api-key")).to_have_attribute("aria-invalid", "true")

    # Without the key, a message gets the server's 401 message.
    chat.settings(max_tokens=4)
    chat.send("Hello")
    expect(chat.answer()).to_have_class("message error")
    expect(chat.answer().locator(".content")).to_contain_text("API key")

    # A wrong key is refused, the right one accepted.
    page.fill("#api-key", "wrong-key")
    page.click("#key-form button")
    expect(banner).to_contain_text("refused this API key")
    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    expect(banner).to_be_hidden()
    expect(page.locator("#model-name")).to_have_text(str(web_model_dir))

    with page.expect_request("**/v1/chat/completions") as sent:
        chat.send("Hello again")
    assert chat.wait_answer_done().get_attribute("data-finish") == "length"
    assert sent.value.headers["authorization"] == f"Bearer {API_KEY}"

    # The key stays in this browser: after a reload the page works at once.
    page.reload()
    expect(page.locator("#api-key")).to_have_value(API_KEY)
    expect(page.locator("#model-name")).to_have_text(str(web_model_dir))
    expect(banner).to_be_hidden()
