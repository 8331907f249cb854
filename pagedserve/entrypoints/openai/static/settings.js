// The sampling settings form: kept in localStorage, read into request fields.

const SETTINGS_STORAGE = "pagedserve.settings";

/** Fills the form's named fields from what was saved in this browser. */
export function restoreSettings(form) {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_STORAGE) || "{}");
  } catch {
    return; // unreadable: keep the defaults of the page
  }
  for (const field of form.elements) {
    if (!field.name || !(field.name in saved)) continue;
    if (field.type === "checkbox") field.checked = Boolean(saved[field.name]);
    else field.value = String(saved[field.name]);
  }
}

export function persistSettings(form) {
  const values = {};
  for (const field of form.elements) {
    if (!field.name) continue;
    values[field.name] = field.type === "checkbox" ? field.checked : field.value;
  }
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(values));
}

/** The system prompt, or "" for none. */
export function systemPrompt(form) {
  return form.elements["system_prompt"].value.trim();
}

/** The request's sampling fields; throws an Error naming the field for a bad value
 *  (the form's min / max / step are checked by the browser). */
export function requestFields(form) {
  for (const field of form.elements) {
    if (field.name && !field.checkValidity()) throw new Error(`${field.name}: ${field.validationMessage}`);
  }
  const el = form.elements;
  const fields = {
    temperature: Number(el["temperature"].value),
    top_p: Number(el["top_p"].value),
    max_tokens: Number(el["max_tokens"].value),
  };
  const stop = parseStops(el["stop"].value);
  if (stop.length) fields.stop = stop;
  if (el["ignore_eos"].checked) fields.ignore_eos = true;
  return fields;
}

/** Stop sequences, one per line; `\n`, `\t` and `\\` stand for a newline, a tab, a backslash. */
export function parseStops(text) {
  const escapes = { n: "\n", t: "\t", "\\": "\\" };
  return text
    .split("\n")
    .filter((line) => line !== "")
    .map((line) => line.replace(/\\([nt\\])/g, (_, c) => escapes[c]));
}
