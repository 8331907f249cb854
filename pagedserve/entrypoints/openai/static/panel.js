// The live engine panel: polls GET /metrics and GET /health (both open, no API key) once a
// second, shows the numbers, and charts them over the last minutes.

import { TimeChart } from "./chart.js";
import { engineSnapshot, parsePrometheus } from "./prometheus.js";

const WINDOW_SECONDS = 300;
// Below 1%, two decimals: a running request on a large KV cache is not "0.0%".
const percent = (fraction) => `${(fraction * 100).toFixed(fraction > 0 && fraction < 0.01 ? 2 : 1)}%`;
const integer = (value) => Math.round(value).toLocaleString("en-US");

/** How each `data-metric` element shows its snapshot field. */
const FORMATS = {
  running: integer,
  waiting: integer,
  kvUsage: percent,
  prefixHitRate: (rate) => (rate === null ? "—" : percent(rate)),
  tokensPerSecond: (rate) => (rate === null ? "—" : rate.toFixed(1)),
  preemptions: integer,
  generationTokens: integer,
  promptTokens: integer,
};

export class EnginePanel {
  /** root: the element holding `[data-metric]` fields and the two canvases;
   *  onStatus(state, detail): "ready" | "starting" | "dead" | "offline", from /health. */
  constructor(root, onStatus, intervalMs = 1000) {
    this.root = root;
    this.onStatus = onStatus;
    this.intervalMs = intervalMs;
    this.previous = null; // { totals, time } of the last scrape
    this.throughput = new TimeChart(root.querySelector("#chart-throughput"), {
      series: [{ key: "tokensPerSecond", axis: "left", color: "--series-tokens", fill: true }],
      windowSeconds: WINDOW_SECONDS,
    });
    this.load = new TimeChart(root.querySelector("#chart-load"), {
      series: [
        { key: "running", axis: "left", color: "--series-running" },
        { key: "waiting", axis: "left", color: "--series-waiting" },
        { key: "kvUsage", axis: "right", color: "--series-kv", fill: true },
      ],
      windowSeconds: WINDOW_SECONDS,
      rightMax: 1,
      rightFormat: (fraction) => `${Math.round(fraction * 100)}%`,
    });
  }

  start() {
    const tick = async () => {
      await Promise.all([this.pollMetrics(), this.pollHealth()]);
      setTimeout(tick, this.intervalMs);
    };
    tick();
  }

  async pollMetrics() {
    let text;
    try {
      const response = await fetch("metrics", { cache: "no-store" });
      if (!response.ok) return;
      text = await response.text();
    } catch {
      return; // the server is unreachable: pollHealth reports it
    }
    const time = performance.now() / 1000;
    const totals = parsePrometheus(text);
    const snapshot = engineSnapshot(totals, time, this.previous);
    this.previous = { totals, time };
    this.render(snapshot);
    this.throughput.push(time, snapshot);
    this.load.push(time, snapshot);
  }

  render(snapshot) {
    for (const el of this.root.querySelectorAll("[data-metric]")) {
      const key = el.dataset.metric;
      el.textContent = FORMATS[key](snapshot[key]);
      el.dataset.value = snapshot[key] === null ? "" : String(snapshot[key]);
    }
    this.root.dataset.updated = String(Date.now());
  }

  async pollHealth() {
    try {
      const response = await fetch("health", { cache: "no-store" });
      if (response.ok) return this.onStatus("ready", "");
      let detail = "";
      let code = "";
      try {
        const body = await response.json();
        detail = body.error.message;
        code = body.error.code;
      } catch {
        // not OpenAI's error shape
      }
      this.onStatus(code === "engine_starting" ? "starting" : "dead", detail);
    } catch {
      this.onStatus("offline", "the server does not answer");
    }
  }
}
