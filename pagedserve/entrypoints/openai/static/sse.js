// Server-sent events read from a fetch() body (EventSource cannot POST or send headers).
// Follows the SSE format: lines end in \n, \r\n or \r; `data:` lines of one event are joined
// with \n; an empty line ends the event; comments and other fields are ignored.

// A line end; a lone \r at the very end of the buffer may be the first half of \r\n, so it
// waits for the next chunk.
const LINE_END = /\r\n|\n|\r(?!$)/;

export class SSEParser {
  constructor() {
    this.buffer = ""; // text after the last complete line
    this.data = []; // data lines of the event being read
  }

  /** Feed decoded text; returns the data of every event that it completed, in order. */
  push(text) {
    this.buffer += text;
    const events = [];
    let match;
    while ((match = LINE_END.exec(this.buffer)) !== null) {
      const line = this.buffer.slice(0, match.index);
      this.buffer = this.buffer.slice(match.index + match[0].length);
      const event = this.line(line);
      if (event !== null) events.push(event);
    }
    return events;
  }

  /** The stream ended: an event without its closing empty line is dropped, as the SSE
   *  format says. */
  end() {
    this.buffer = "";
    this.data = [];
  }

  line(line) {
    if (line === "") {
      if (this.data.length === 0) return null;
      const event = this.data.join("\n");
      this.data = [];
      return event;
    }
    if (line.startsWith(":")) return null;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    return null;
  }
}

/** Yields the data string of each event of a response body (a ReadableStream of bytes).
 *  Aborting the fetch's signal makes the pending read throw an AbortError; a consumer that
 *  stops early (after `[DONE]`) cancels the body, which closes the connection. */
export async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SSEParser();
  let finished = false;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      yield* parser.push(value);
    }
    finished = true;
    parser.end();
  } finally {
    if (!finished) reader.cancel().catch(() => {});
  }
}
