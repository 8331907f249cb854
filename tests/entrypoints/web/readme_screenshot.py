"""Takes the README's screenshot of the web page: the default model (SmolLM2-135M-Instruct)
served on 127.0.0.1, a short chat in headless Chromium, and the window while the last answer
is still streaming (the engine panel busy, the stop button up).

    python -m tests.entrypoints.web.readme_screenshot docs/screenshot-chat.png

Not a test (it takes a minute on a CPU); the browser tests save their own screenshots.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from pagedserve.config import ModelConfig
from tests.entrypoints.openai.server_utils import ServerProcess
from tests.entrypoints.web.chat_page import ChatPage
from tests.entrypoints.web.conftest import CHROMIUM_ARGS, VIEWPORT, find_chromium, wait_until

SYSTEM_PROMPT = "You are a friendly assistant. Answer in a few sentences."
QUESTIONS = ("Hello! What can you help me with?",)
STREAMING = "Give me three tips for writing clear code."
"""Asked last: the screenshot is taken while its answer streams."""
STREAMED_CHARS = 200


def take_screenshot(out: Path, max_tokens: int) -> None:
    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("chromium not found: apt-get install -y chromium")
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(Path(ModelConfig.model), Path(tmp) / "server.log")
        try:
            server.wait_ready()
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport=VIEWPORT)
                chat = ChatPage(page, server.url).open()
                chat.settings(max_tokens=max_tokens, ignore_eos=False, system=SYSTEM_PROMPT,
                              temperature=0.0, top_p=1.0)
                for question in QUESTIONS:
                    chat.send(question)
                    chat.wait_answer_done(timeout_ms=300_000)
                chat.settings(max_tokens=4 * max_tokens, ignore_eos=True, system=SYSTEM_PROMPT,
                              temperature=0.0, top_p=1.0)
                chat.send(STREAMING)
                wait_until(lambda: len(chat.answer_text()) > STREAMED_CHARS, 300, "the poem")
                wait_until(lambda: (chat.metric_value("tokensPerSecond") or 0) > 0, 10, "tokens/s")
                page.locator("#prompt").blur()
                page.screenshot(path=out)
                page.click("#stop")
                browser.close()
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--max-tokens", type=int, default=120)
    args = parser.parse_args()
    take_screenshot(args.out, args.max_tokens)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
