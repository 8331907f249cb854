// The Prometheus text format of GET /metrics, and the engine numbers the page shows.

/** Metric names the engine exports (counters also get the client library's `_total`). */
export const METRICS = {
  running: "pagedserve:num_requests_running",
  waiting: "pagedserve:num_requests_waiting",
  kvUsage: "pagedserve:kv_cache_usage_perc",
  prefixQueries: "pagedserve:prefix_cache_queries",
  prefixHits: "pagedserve:prefix_cache_hits",
  preemptions: "pagedserve:num_preemptions",
  promptTokens: "pagedserve:prompt_tokens",
  generationTokens: "pagedserve:generation_tokens",
};

const SPECIAL_VALUES = { "+Inf": Infinity, "-Inf": -Infinity, NaN: NaN };

/** One sample line `name{label="value",...} value [timestamp]`, or null if it is not one. */
export function parseSample(line) {
  const name = /^[a-zA-Z_:][a-zA-Z0-9_:]*/.exec(line);
  if (!name) return null;
  let pos = name[0].length;
  const labels = {};
  if (line[pos] === "{") {
    pos = parseLabels(line, pos + 1, labels);
    if (pos < 0) return null;
  }
  const fields = line.slice(pos).trim().split(/\s+/);
  if (fields.length < 1 || fields.length > 2 || fields[0] === "") return null;
  const value = fields[0] in SPECIAL_VALUES ? SPECIAL_VALUES[fields[0]] : Number(fields[0]);
  if (Number.isNaN(value) && fields[0] !== "NaN") return null;
  return { name: name[0], labels, value };
}

/** Reads `a="x",b="y"}` from `pos` into `labels`; the position after `}`, or -1 if malformed. */
function parseLabels(line, pos, labels) {
  const labelName = /\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"/y;
  for (;;) {
    while (line[pos] === " " || line[pos] === ",") pos += 1;
    if (line[pos] === "}") return pos + 1;
    labelName.lastIndex = pos;
    const match = labelName.exec(line);
    if (!match) return -1;
    pos = labelName.lastIndex;
    let value = "";
    for (; pos < line.length && line[pos] !== '"'; pos += 1) {
      if (line[pos] === "\\") {
        pos += 1;
        value += line[pos] === "n" ? "\n" : line[pos];
      } else {
        value += line[pos];
      }
    }
    if (pos >= line.length) return -1; // unterminated value
    labels[match[1]] = value;
    pos += 1;
  }
}

/** Map of metric name -> sum of its samples over all label sets (several models add up). */
export function parsePrometheus(text) {
  const totals = new Map();
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (line === "" || line.startsWith("#")) continue;
    const sample = parseSample(line);
    if (sample) totals.set(sample.name, (totals.get(sample.name) ?? 0) + sample.value);
  }
  return totals;
}

/** A counter's value: `name_total` (prometheus_client's name) or plain `name`; 0 if absent. */
export function counter(totals, name) {
  return totals.get(`${name}_total`) ?? totals.get(name) ?? 0;
}

/** Growth of a counter between two scrapes; a counter that went down restarted from 0. */
function increase(before, after) {
  return after >= before ? after - before : after;
}

/** The engine's numbers from one scrape, with rates against the previous one.
 *  `previous` is `{ totals, time }` of the last scrape or null; times are in seconds. */
export function engineSnapshot(totals, time, previous) {
  const gen = counter(totals, METRICS.generationTokens);
  const queries = counter(totals, METRICS.prefixQueries);
  const hits = counter(totals, METRICS.prefixHits);
  let tokensPerSecond = null;
  if (previous && time > previous.time) {
    const before = counter(previous.totals, METRICS.generationTokens);
    tokensPerSecond = increase(before, gen) / (time - previous.time);
  }
  return {
    running: totals.get(METRICS.running) ?? 0,
    waiting: totals.get(METRICS.waiting) ?? 0,
    kvUsage: totals.get(METRICS.kvUsage) ?? 0, // fraction 0..1
    prefixHitRate: queries > 0 ? hits / queries : null, // since the server started
    preemptions: counter(totals, METRICS.preemptions),
    promptTokens: counter(totals, METRICS.promptTokens),
    generationTokens: gen,
    tokensPerSecond,
  };
}
