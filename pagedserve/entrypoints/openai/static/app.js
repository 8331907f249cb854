// The page: wires the chat, the settings, the API key and the engine panel together.

import { getApiKey, listModels, setApiKey } from "./api.js";
import { answerStats, formatStats, streamChat } from "./chat.js";
import { EnginePanel } from "./panel.js";
import { persistSettings, requestFields, restoreSettings, systemPrompt } from "./settings.js";

const $ = (id) => document.getElementById(id);
const PROBE_RETRY_MS = 2000;

const state = {
  history: [], // the conversation so far: [{ role, content }] without the system prompt
  model: null, // the served model's id, once /v1/models answered
  controller: null, // AbortController of the answer being streamed
};

// -- the server: its model, and whether it wants an API key -----------------------------------

/** Asks /v1/models; a 401 means the key is missing or wrong. Retries while the engine starts. */
async function probeServer() {
  try {
    const models = await listModels();
    state.model = models.length ? models[0].id : null;
    $("model-name").textContent = state.model || "no model";
    if (models.length && models[0].max_model_len) $("max-tokens").max = models[0].max_model_len;
    showKeyNeeded(false);
  } catch (err) {
    if (err.isAuth) {
      $("model-name").textContent = "API key needed";
      showKeyNeeded(true);
    } else {
      setTimeout(probeServer, PROBE_RETRY_MS);
    }
  }
}

function showKeyNeeded(needed) {
  $("key-message").textContent = getApiKey()
    ? "The server refused this API key: check it and save it again."
    : "This server needs an API key (its --api-key): enter it above.";
  $("key-banner").hidden = !needed;
  $("api-key").setAttribute("aria-invalid", String(needed));
  if (needed) $("api-key").focus();
}

function saveKey(event) {
  event.preventDefault();
  setApiKey($("api-key").value.trim());
  probeServer();
}

function showStatus(status, detail) {
  const labels = { ready: "ready", starting: "loading the model…", dead: "engine stopped", offline: "offline" };
  $("status").dataset.state = status;
  $("status-label").textContent = labels[status];
  $("status").title = detail;
}

// -- the chat ---------------------------------------------------------------------------------

function addMessage(role, text) {
  $("empty").hidden = true;
  const article = document.createElement("article");
  article.className = `message ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  const meta = document.createElement("div"); // token counts and speed
  meta.className = "meta";
  article.append(content, meta);
  $("messages").append(article);
  scrollToEnd(true);
  return { article, content, meta };
}

/** Follows the answer as it grows, unless the person scrolled up to read. */
function scrollToEnd(force) {
  const box = $("messages");
  const nearEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  if (force || nearEnd) box.scrollTop = box.scrollHeight;
}

function setStreaming(streaming) {
  $("send").disabled = streaming;
  $("stop").hidden = !streaming;
  $("new-chat").disabled = streaming;
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  const form = $("settings");
  let fields;
  try {
    fields = requestFields(form);
  } catch (err) {
    addMessage("error", err.message);
    return;
  }
  const system = systemPrompt(form);
  const user = { role: "user", content: text };
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...state.history, user];
  $("prompt").value = "";
  addMessage("user", text);
  const view = addMessage("assistant", "");
  view.article.classList.add("streaming");
  state.controller = new AbortController();
  setStreaming(true);
  try {
    const answer = await streamChat({
      messages, model: state.model, fields, signal: state.controller.signal,
      onUpdate: (partial) => streamInto(view, partial),
    });
    showAnswer(view, answer);
    // A stopped answer stays in the conversation as far as it got.
    if (answer.text) state.history.push(user, { role: "assistant", content: answer.text });
  } catch (err) {
    view.article.classList.replace("assistant", "error");
    view.content.textContent = err.message;
    if (err.isAuth) showKeyNeeded(true);
  } finally {
    view.done = true; // a frame still scheduled by streamInto must not write any more
    view.article.classList.remove("streaming");
    state.controller = null;
    setStreaming(false);
    $("prompt").focus();
  }
}

/** Shows a streaming answer at most once per frame, appending only the text that is new since
 *  the last frame. Rewriting the whole text on every chunk is quadratic: on a fast stream
 *  (thousands of tokens a second) it kept the page too busy to handle a click on Stop.
 *  ``partial`` is the answer object the stream keeps growing, so a frame shows its latest text. */
function streamInto(view, partial) {
  if (view.framePending) return;
  view.framePending = true;
  requestAnimationFrame(() => {
    view.framePending = false;
    if (view.done) return;
    const shown = view.shownLength || 0;
    if (partial.text.length > shown) {
      view.content.append(partial.text.slice(shown));
      view.shownLength = partial.text.length;
    }
    scrollToEnd(false);
  });
}

function showAnswer(view, answer) {
  const stats = answerStats(answer);
  view.content.textContent = answer.text;
  view.meta.textContent = formatStats(stats);
  view.article.dataset.finish = stats.finish;
  view.article.dataset.completionTokens = String(stats.completionTokens);
}

function newChat() {
  state.history = [];
  for (const el of $("messages").querySelectorAll(".message")) el.remove();
  $("empty").hidden = false;
  $("prompt").focus();
}

// -- start ------------------------------------------------------------------------------------

function init() {
  const settings = $("settings");
  restoreSettings(settings);
  settings.addEventListener("input", () => persistSettings(settings));
  $("api-key").value = getApiKey();
  $("key-form").addEventListener("submit", saveKey);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  new EnginePanel($("engine"), showStatus).start();
  probeServer();
}

init();
