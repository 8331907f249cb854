// A small time-series chart on a <canvas>, drawn by hand: the last `windowSeconds` of a few
// series, each on the left axis (auto-scaled) or the right one (a fixed 0..rightMax). While
// the history is shorter, the time axis spans whole minutes of it (at least one), so a new
// page shows a readable chart at once.

export const PAD = { left: 38, right: 38, top: 10, bottom: 20 }; // CSS pixels around the plot

export class TimeChart {
  /** series: [{ key, axis: "left" | "right", color: a CSS custom property, fill: bool }] */
  constructor(canvas, { series, windowSeconds, leftMin = GRID_ROWS, rightMax = 1, rightFormat = String }) {
    this.canvas = canvas;
    this.series = series;
    this.windowSeconds = windowSeconds;
    this.leftMin = leftMin; // the left axis goes at least this high
    this.rightMax = rightMax;
    this.rightFormat = rightFormat;
    this.points = []; // [{ time (s), values: { key: number | null } }], oldest first
    new ResizeObserver(() => this.draw()).observe(canvas);
  }

  push(time, values) {
    this.points.push({ time, values });
    while (this.points.length && this.points[0].time < time - this.windowSeconds) this.points.shift();
    this.draw();
  }

  draw() {
    const { ctx, width, height } = this.resize();
    if (!ctx) return;
    const style = getComputedStyle(this.canvas);
    const color = (name) => style.getPropertyValue(name).trim() || "#888";
    const plot = { x: PAD.left, y: PAD.top, w: width - PAD.left - PAD.right, h: height - PAD.top - PAD.bottom };
    const now = this.points.length ? this.points[this.points.length - 1].time : 0;
    const span = this.span(now);
    const leftMax = niceMax(Math.max(this.leftMin, this.maxOf("left")));
    ctx.clearRect(0, 0, width, height);
    ctx.font = `10px ${style.fontFamily}`;
    this.drawGrid(ctx, plot, span, leftMax, color("--chart-grid"), color("--muted"));
    for (const s of this.series) {
      const max = s.axis === "left" ? leftMax : this.rightMax;
      this.drawSeries(ctx, plot, s, { span, now, max }, color(s.color));
    }
  }

  /** Seconds shown on the time axis: the history so far in whole minutes, within
   *  1 minute .. windowSeconds. */
  span(now) {
    const history = this.points.length ? now - this.points[0].time : 0;
    return Math.min(this.windowSeconds, Math.max(60, Math.ceil(history / 60) * 60));
  }

  /** Matches the canvas's pixel size to its CSS size (sharp on high-DPI screens). */
  resize() {
    const rect = this.canvas.getBoundingClientRect();
    if (rect.width === 0 || rect.height === 0) return {};
    const ratio = window.devicePixelRatio || 1;
    const w = Math.round(rect.width * ratio);
    const h = Math.round(rect.height * ratio);
    if (this.canvas.width !== w || this.canvas.height !== h) {
      this.canvas.width = w;
      this.canvas.height = h;
    }
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    return { ctx, width: rect.width, height: rect.height };
  }

  maxOf(axis) {
    let max = 0;
    for (const s of this.series.filter((s) => s.axis === axis)) {
      for (const p of this.points) max = Math.max(max, p.values[s.key] ?? 0);
    }
    return max;
  }

  drawGrid(ctx, plot, span, leftMax, gridColor, textColor) {
    ctx.strokeStyle = gridColor;
    ctx.fillStyle = textColor;
    ctx.lineWidth = 1;
    const rows = GRID_ROWS;
    for (let i = 0; i <= rows; i += 1) {
      const y = Math.round(plot.y + plot.h - (plot.h * i) / rows) + 0.5;
      ctx.beginPath();
      ctx.moveTo(plot.x, y);
      ctx.lineTo(plot.x + plot.w, y);
      ctx.stroke();
      ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      ctx.fillText(formatNumber((leftMax * i) / rows), plot.x - 4, y);
      if (this.series.some((s) => s.axis === "right")) {
        ctx.textAlign = "left";
        ctx.fillText(this.rightFormat((this.rightMax * i) / rows), plot.x + plot.w + 4, y);
      }
    }
    ctx.textBaseline = "top";
    ctx.textAlign = "center";
    const tick = span <= 60 ? 15 : 60; // seconds between time labels
    for (let t = 0; t <= span; t += tick) {
      const x = plot.x + plot.w - (plot.w * t) / span;
      const label = t === 0 ? "now" : t % 60 === 0 ? `-${t / 60}m` : `-${t}s`;
      ctx.fillText(label, x, plot.y + plot.h + 5);
    }
  }

  drawSeries(ctx, plot, series, { span, now, max }, color) {
    const xOf = (time) => plot.x + plot.w - (plot.w * (now - time)) / span;
    const yOf = (value) => plot.y + plot.h - (plot.h * Math.min(value, max)) / (max || 1);
    const base = plot.y + plot.h;
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = 1.75;
    ctx.lineJoin = "round";
    for (const segment of segments(this.points, series.key)) {
      ctx.beginPath();
      segment.forEach((p, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, xOf(p.time), yOf(p.value)));
      ctx.stroke();
      if (series.fill && segment.length > 1) {
        ctx.lineTo(xOf(segment[segment.length - 1].time), base);
        ctx.lineTo(xOf(segment[0].time), base);
        ctx.closePath();
        ctx.globalAlpha = 0.15;
        ctx.fill();
        ctx.globalAlpha = 1;
      }
    }
  }
}

/** The runs of consecutive points where `key` has a value ([{ time, value }] each): a missing
 *  value (null) breaks the line. */
function segments(points, key) {
  const runs = [];
  let run = [];
  for (const p of points) {
    const value = p.values[key];
    if (value === null || value === undefined) {
      if (run.length) runs.push(run);
      run = [];
    } else {
      run.push({ time: p.time, value });
    }
  }
  if (run.length) runs.push(run);
  return runs;
}

const GRID_ROWS = 4;

/** The top of an axis showing `value`: GRID_ROWS grid steps, each step 1, 2 or 5 x 10^k. */
export function niceMax(value) {
  const rough = Math.max(value, 1e-9) / GRID_ROWS;
  const magnitude = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 5, 10].find((m) => m * magnitude >= rough) * magnitude;
  return step * GRID_ROWS;
}

export function formatNumber(value) {
  if (value >= 1000) return `${+(value / 1000).toFixed(1)}k`;
  return `${+value.toFixed(value < 10 ? 1 : 0)}`;
}
