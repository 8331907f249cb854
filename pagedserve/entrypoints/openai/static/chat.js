// One streamed answer from POST v1/chat/completions, and its token counts and speed.

import { ApiError, postJson } from "./api.js";
import { sseEvents } from "./sse.js";

/** Streams the answer to `messages`. `fields` are the request's sampling fields; `onUpdate`
 *  gets the answer after each new piece of text. Aborting `signal` (the stop button) closes the
 *  connection, and the server aborts the request; the answer then has `stopped` set.
 *  Throws ApiError for an HTTP error or an error event in the stream. */
export async function streamChat({ messages, model, fields, signal, onUpdate }) {
  const answer = {
    text: "",
    finishReason: null,
    usage: null, // { prompt_tokens, completion_tokens }, sent last (stream_options)
    pieces: 0, // text chunks received: about one per token
    start: performance.now(),
    firstAt: null, // when the first text arrived (ms)
    lastAt: null,
    end: null,
    stopped: false,
  };
  const body = {
    ...fields,
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  if (model) body.model = model;
  try {
    const response = await postJson("v1/chat/completions", body, signal);
    for await (const data of sseEvents(response.body)) {
      if (data === "[DONE]") break;
      if (applyChunk(answer, JSON.parse(data))) onUpdate(answer);
    }
  } catch (err) {
    if (err.name !== "AbortError") throw err;
    answer.stopped = true;
  }
  answer.end = performance.now();
  return answer;
}

/** Adds one chunk to the answer; true if it brought new text. */
function applyChunk(answer, chunk) {
  if (chunk.error) throw new ApiError(500, chunk.error.message || "the stream failed");
  if (chunk.usage) answer.usage = chunk.usage;
  let grew = false;
  for (const choice of chunk.choices || []) {
    if (choice.index !== 0) continue; // the page asks for n = 1
    const piece = choice.delta ? choice.delta.content : null;
    if (piece) {
      const now = performance.now();
      if (answer.firstAt === null) answer.firstAt = now;
      answer.lastAt = now;
      answer.text += piece;
      answer.pieces += 1;
      grew = true;
    }
    if (choice.finish_reason) answer.finishReason = choice.finish_reason;
  }
  return grew;
}

/** Counts and speed of a finished (or stopped) answer. Without the usage chunk (stopped), the
 *  token count is the number of text chunks, an estimate (`exact` false). */
export function answerStats(answer) {
  const exact = answer.usage !== null;
  const completionTokens = exact ? answer.usage.completion_tokens : answer.pieces;
  const decodeSeconds = answer.firstAt === null ? 0 : (answer.lastAt - answer.firstAt) / 1000;
  return {
    exact,
    completionTokens,
    promptTokens: exact ? answer.usage.prompt_tokens : null,
    // Tokens after the first one, over the time they took (the first one waited for prefill).
    tokensPerSecond: completionTokens > 1 && decodeSeconds > 0 ? (completionTokens - 1) / decodeSeconds : null,
    timeToFirstToken: answer.firstAt === null ? null : (answer.firstAt - answer.start) / 1000,
    seconds: (answer.end - answer.start) / 1000,
    finish: answer.stopped ? "stopped" : answer.finishReason || "unknown",
  };
}

/** One line for under the answer, e.g. "64 tokens · 31.2 tok/s · first token 0.18 s · ...". */
export function formatStats(stats) {
  const parts = [`${stats.exact ? "" : "~"}${stats.completionTokens} tokens`];
  if (stats.tokensPerSecond !== null) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (stats.timeToFirstToken !== null) parts.push(`first token ${stats.timeToFirstToken.toFixed(2)} s`);
  parts.push(`${stats.seconds.toFixed(2)} s total`);
  if (stats.promptTokens !== null) parts.push(`prompt ${stats.promptTokens} tokens`);
  parts.push(stats.finish === "stopped" ? "stopped" : `finish: ${stats.finish}`);
  return parts.join(" · ");
}
