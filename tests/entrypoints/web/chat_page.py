"""The web page as the tests use it: its controls by role, and what it shows."""

from __future__ import annotations

import re

from playwright.sync_api import Locator, Page, expect

ANY = re.compile(".+")
LOADING = "…"
"""The model name's placeholder until the page has asked ``/v1/models``."""

# Counts the pixels of a chart series' colour (a CSS custom property in hex) above the plot's
# zero line (chart.js PAD). Fill is translucent, so only the line's opaque pixels count.
_LINE_PIXELS_JS = """async ([id, colorProperty]) => {
  const { PAD } = await import("/static/chart.js");
  const canvas = document.getElementById(id);
  const hex = getComputedStyle(canvas).getPropertyValue(colorProperty).trim();
  const rgb = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  const ratio = window.devicePixelRatio || 1;
  const { data, width, height } = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
  const floor = height - (PAD.bottom + 4) * ratio;
  let count = 0;
  for (let y = 0; y < floor; y += 1) {
    for (let x = 0; x < width; x += 1) {
      const i = (y * width + x) * 4;
      const distance = Math.abs(data[i] - rgb[0]) + Math.abs(data[i + 1] - rgb[1]) + Math.abs(data[i + 2] - rgb[2]);
      if (data[i + 3] > 200 && distance < 60) count += 1;
    }
  }
  return count;
}"""


class ChatPage:
    def __init__(self, page: Page, url: str) -> None:
        self.page = page
        self.url = url

    def open(self) -> ChatPage:
        """Loads the page and waits until it knows the engine is ready and has asked for the
        model (its name, or "API key needed")."""
        self.page.goto(self.url + "/")
        expect(self.page.locator("#status")).to_have_attribute("data-state", "ready")
        expect(self.page.locator("#model-name")).not_to_have_text(LOADING)
        return self

    def settings(self, *, max_tokens: int, ignore_eos: bool = True, system: str = "",
                 temperature: float = 0.7, top_p: float = 0.95, stop: str = "") -> None:
        self.page.fill("#system-prompt", system)
        self.page.fill("#temperature", str(temperature))
        self.page.fill("#top-p", str(top_p))
        self.page.fill("#max-tokens", str(max_tokens))
        self.page.fill("#stop-sequences", stop)
        self.page.set_checked("#ignore-eos", ignore_eos)

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def answer(self) -> Locator:
        """The last answer (or error) of the conversation."""
        return self.page.locator(".message.assistant, .message.error").last

    def answer_text(self) -> str:
        return self.answer().locator(".content").text_content() or ""

    def wait_answer_done(self, timeout_ms: float = 60_000) -> Locator:
        answer = self.answer()
        expect(answer).to_have_attribute("data-finish", ANY, timeout=timeout_ms)
        return answer

    def metric(self, key: str) -> Locator:
        """One number of the engine panel (``data-metric`` key, e.g. ``running``)."""
        return self.page.locator(f'[data-metric="{key}"]')

    def metric_value(self, key: str) -> float | None:
        raw = self.metric(key).get_attribute("data-value")
        return None if raw in (None, "") else float(raw)

    def tokens_chart_line_pixels(self) -> int:
        """Pixels of the tokens/s line drawn above the chart's zero line."""
        return self.page.evaluate(_LINE_PIXELS_JS, ["chart-throughput", "--series-tokens"])
