// Calls to the server's API: the API key (kept in this browser's localStorage) and errors in
// OpenAI's shape. Paths are relative, so the page also works behind a proxy under a prefix.

const KEY_STORAGE = "pagedserve.apiKey";

export function getApiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

/** An HTTP error of the API, or an error event inside a stream. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.name = "ApiError";
    this.status = status;
  }
  get isAuth() {
    return this.status === 401;
  }
}

/** fetch() with `Authorization: Bearer KEY` when a key is set. */
export function apiFetch(path, init = {}) {
  const headers = new Headers(init.headers || {});
  const key = getApiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  return fetch(path, { ...init, headers });
}

/** POST a JSON body; throws ApiError unless the answer is 2xx. */
export async function postJson(path, body, signal) {
  const response = await apiFetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  return response;
}

/** The ApiError of a failed response, with the server's message when it sent one. */
export async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`.trim();
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, message);
}

/** The served models (`GET v1/models`); throws ApiError (401 when a key is needed). */
export async function listModels() {
  const response = await apiFetch("v1/models", { cache: "no-store" });
  if (!response.ok) throw await errorOf(response);
  const body = await response.json();
  return body.data || [];
}
