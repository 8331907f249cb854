"""Fixtures for the web page's browser tests: headless Chromium (Debian's ``chromium``
package) driven by Playwright, and real ``pagedserve serve`` processes with a tiny model.

Playwright drives the system Chromium (``executable_path``); it never downloads a browser.
The page sends a Content-Security-Policy without ``'unsafe-eval'``, so tests wait with locators
and Python-side polling (``wait_until``), not ``page.wait_for_function`` (which evals strings).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, Playwright, sync_playwright

from tests.engine.tiny_models import make_model, make_tokenizer
from tests.entrypoints.openai.server_utils import API_KEY, ServerProcess

WEB_MAX_MODEL_LEN = 32768

CHROMIUM_NAMES = ("chromium", "chromium-browser")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Polls ``condition`` until it holds; the seconds it took. Fails the test after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


# -- browser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    """Per module: Playwright's sync API keeps an event loop of its own, which must not outlive
    these tests into others that run asyncio."""
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    path = find_chromium()
    if path is None:
        pytest.skip("Chromium not found: install Debian's package (apt-get install -y chromium)")
    browser = playwright.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
    yield browser
    browser.close()


class PageErrors:
    """Uncaught exceptions and console errors of the test's page, checked when the test ends."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.expected: list[str] = []
        """Substrings of console errors the test causes on purpose (a 401 it provokes)."""

    def watch(self, page: Page) -> None:
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))
        page.on("console", lambda msg: msg.type == "error" and self.errors.append(msg.text))

    def unexpected(self) -> list[str]:
        return [e for e in self.errors if not any(s in e for s in self.expected)]


@pytest.fixture
def context(browser: Browser) -> Iterator[BrowserContext]:
    """A fresh browser profile per test (empty localStorage)."""
    context = browser.new_context(viewport=VIEWPORT)
    yield context
    context.close()


@pytest.fixture
def page_errors() -> PageErrors:
    return PageErrors()


@pytest.fixture
def page(context: BrowserContext, page_errors: PageErrors) -> Iterator[Page]:
    page = context.new_page()
    page_errors.watch(page)
    yield page
    assert page_errors.unexpected() == [], "the page logged errors"


@pytest.fixture(scope="session")
def artifacts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: $ARTIFACTS_DIR (CI keeps it) or a pytest temporary folder."""
    if os.environ.get("ARTIFACTS_DIR"):
        folder = Path(os.environ["ARTIFACTS_DIR"]) / "web"
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return tmp_path_factory.mktemp("web_artifacts")


# -- servers ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def web_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine tests' tiny Llama, allowed ``WEB_MAX_MODEL_LEN`` positions (rotary
    embeddings work at any position): an answer of tens of thousands of tokens streams for
    many seconds, time for a test to watch the panel and press stop however fast the engine
    is (3,000 tokens once ended before the stop button was pressed)."""
    folder = tmp_path_factory.mktemp("tiny_llama_web")
    tokenizer = make_tokenizer()
    model = make_model("llama", len(tokenizer), tokenizer.eos_token_id)
    model.config.max_position_embeddings = WEB_MAX_MODEL_LEN
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def start_server(model_dir: Path, log_dir: Path, *args: str) -> ServerProcess:
    # The page's long answers need the whole context (the last --max-model-len wins).
    server = ServerProcess(
        model_dir, log_dir / "server.log", "--max-model-len", str(WEB_MAX_MODEL_LEN), *args
    )
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def open_server(web_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server without an API key (one per test module: two at once would share 2 CPUs)."""
    server = start_server(web_model_dir, tmp_path_factory.mktemp("open_server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def key_server(web_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server started with ``--api-key API_KEY``."""
    server = start_server(web_model_dir, tmp_path_factory.mktemp("key_server"), "--api-key", API_KEY)
    yield server
    server.stop()
