// unmask playground: chat, fill in the middle and JSON mode against this server's OpenAI-compatible API.
// Plain script, no dependencies. Every URL is relative, so the page works under a proxy's path prefix.
"use strict";

const MASK = "\u2591"; // "░": one per masked position in `diffusing` frames (docs/server.md)
const KEY_STORE = "unmask.apiKey";
const $ = (id) => document.getElementById(id);

const state = {
  mode: "chat",
  history: [],          // [{role, content}] of the conversation (system prompt added per request)
  controller: null,     // AbortController of the request in flight
};

// ------------------------------------------------------------------------------------------ text
function escapeHtml(s) {
  return s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
          .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

// Inline Markdown on already-escaped text: code spans first (their content left alone), then links,
// bold, italic. Only http(s) links become anchors.
function inline(escaped) {
  const spans = [];
  let s = escaped.replace(/`([^`\n]+)`/g, (_, code) => { spans.push(code); return `\u0000${spans.length - 1}\u0000`; });
  s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g,
                (_, text, url) => `<a href="${url}" rel="noopener noreferrer" target="_blank">${text}</a>`);
  s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^_\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${spans[Number(i)]}</code>`);
}

// A small Markdown renderer: fenced code (an unclosed fence runs to the end, as while streaming),
// headings, bullet and numbered lists, block quotes, paragraphs. Everything is escaped first.
function renderMarkdown(text) {
  const lines = text.split("\n");
  const out = [];
  let para = [], list = null;
  const flushPara = () => { if (para.length) { out.push(`<p>${inline(para.join("<br>"))}</p>`); para = []; } };
  const flushList = () => { if (list) { out.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`); list = null; } };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)/);
    if (fence) {
      flushPara(); flushList();
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      const lang = fence[1] ? ` data-lang="${escapeHtml(fence[1])}"` : "";
      const label = fence[1] ? `<span class="lang">${escapeHtml(fence[1])}</span>` : "";
      out.push(`<pre class="code"${lang}>${label}<code>${escapeHtml(code.join("\n"))}</code></pre>`);
      continue;
    }
    const esc = escapeHtml(line);
    let m;
    if ((m = esc.match(/^(#{1,6})\s+(.*)$/))) {
      flushPara(); flushList();
      const level = Math.min(m[1].length + 2, 6);  // h1/h2 belong to the page
      out.push(`<h${level}>${inline(m[2])}</h${level}>`);
    } else if ((m = esc.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/))) {
      flushPara();
      const tag = /\d/.test(m[1]) ? "ol" : "ul";
      if (list && list.tag !== tag) flushList();
      if (!list) list = { tag, items: [] };
      list.items.push(m[2]);
    } else if ((m = esc.match(/^&gt;\s?(.*)$/))) {
      flushPara(); flushList();
      out.push(`<blockquote>${inline(m[1])}</blockquote>`);
    } else if (!line.trim()) {
      flushPara(); flushList();
    } else {
      flushList();
      para.push(esc);
    }
  }
  flushPara(); flushList();
  return out.join("");
}

// ------------------------------------------------------------------------------------------ API
function apiKey() { return localStorage.getItem(KEY_STORE) || ""; }

function askKey() {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-input").value = "";
    dialog.addEventListener("close", () => {
      const key = $("key-input").value.trim();
      if (dialog.returnValue === "ok" && key) { localStorage.setItem(KEY_STORE, key); resolve(true); }
      else resolve(false);
    }, { once: true });
    dialog.showModal();
    $("key-input").focus();
  });
}

// fetch with the stored key; on a 401 ask for the key once and retry
async function api(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const headers = { ...(options.headers || {}) };
    const key = apiKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    const resp = await fetch(path, { ...options, headers });
    if (resp.status !== 401 || attempt > 0) return resp;
    if (!(await askKey())) return resp;
  }
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return `${resp.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `${resp.status} ${resp.statusText}`;
}

// Reads a server-sent event stream, calling onData with each parsed `data:` JSON; resolves at [DONE].
async function readSSE(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      onData(JSON.parse(data));
    }
  }
}

// ------------------------------------------------------------------------------------------ settings
function numberField(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function requestFields() {
  const body = {};
  const model = $("set-model").value;
  if (model) body.model = model;
  const effort = $("set-effort").value, policy = $("set-policy").value;
  if (effort) body.reasoning_effort = effort;
  if (policy) body.policy = policy;
  const fields = { threshold: "set-threshold", block_size: "set-block", temperature: "set-temperature",
                   max_tokens: "set-max-tokens" };
  for (const [name, id] of Object.entries(fields)) {
    const v = numberField(id);
    if (v !== undefined && !Number.isNaN(v)) body[name] = v;
  }
  const extra = $("set-extra").value.trim();
  if (extra) {
    let parsed;
    try { parsed = JSON.parse(extra); } catch (e) { throw new Error(`Extra request fields: ${e.message}`); }
    if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) throw new Error("Extra request fields: not a JSON object");
    Object.assign(body, parsed);
  }
  if ($("set-diffusing").checked) body.diffusing = true;
  body.stream = true;
  body.stream_options = { include_usage: true };
  return body;
}

// Settings (and the system prompt) are kept in local storage on every change and restored on load; the API key
// is kept apart (KEY_STORE), so "Default settings" leaves it.
const SETTINGS_STORE = "unmask.settings";
const KEPT = ["set-model", "set-effort", "set-policy", "set-threshold", "set-block", "set-temperature",
              "set-max-tokens", "set-diffusing", "set-extra", "system"];
let defaults = {};

function readSettings() {
  const out = {};
  for (const id of KEPT) out[id] = $(id).type === "checkbox" ? $(id).checked : $(id).value;
  return out;
}

function applySettings(values) {
  for (const [id, v] of Object.entries(values)) {
    if (!KEPT.includes(id)) continue;
    const el = $(id);
    if (el.type === "checkbox") el.checked = Boolean(v);
    else if (el.tagName !== "SELECT" || [...el.options].some((o) => o.value === v)) el.value = v;
  }
}

function storedSettings() {
  try { return JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}") || {}; } catch (e) { return {}; }
}

function saveSettings() { localStorage.setItem(SETTINGS_STORE, JSON.stringify(readSettings())); }

async function loadModels() {
  try {
    const resp = await api("v1/models");
    if (!resp.ok) { setStatus(`models: ${await errorMessage(resp)}`); return; }
    const select = $("set-model");
    select.replaceChildren();
    for (const m of (await resp.json()).data) {
      const opt = document.createElement("option");
      opt.value = opt.textContent = m.id;
      select.append(opt);
    }
    const kept = storedSettings()["set-model"];
    if (kept) applySettings({ "set-model": kept });   // the model kept from last time, if still served
    setStatus("ready");
  } catch (e) {
    setStatus(`models: ${e.message}`);
  }
}

function setStatus(text) { $("status").textContent = text; }

// ------------------------------------------------------------------------------------------ denoising view
// Each frame is the choice's whole current text with "░" per masked token, and the spans (code-point offsets in
// that text) of the tokens committed this step and of those this step revised: replaced by an edit, or put back
// to mask (docs/server.md). Everything else that is not masked was committed earlier (settled).
function frameStates(frame) {
  const chars = Array.from(frame.text);       // code points, as the server counts offsets
  const states = chars.map((ch) => ch === MASK ? "mask" : "settled");
  const mark = (spans, kind) => {
    for (const [start, end] of spans || []) {
      for (let i = Math.max(start, 0); i < Math.min(end, chars.length); i++) {
        states[i] = kind === "edit" && chars[i] === MASK ? "remask" : kind;
      }
    }
  };
  mark(frame.committed, "new");
  mark(frame.edited, "edit");
  return { chars, states };
}

const TOKEN_TITLES = { mask: "masked", new: "committed this step", edit: "edited this step",
                       remask: "put back to mask this step" };

function renderFrame(container, frame) {
  const { chars, states } = frameStates(frame);
  const frag = document.createDocumentFragment();
  let run = "", runState = null;
  const flush = () => {
    if (!run) return;
    const span = document.createElement("span");
    span.className = `tok tok-${runState}`;
    if (TOKEN_TITLES[runState]) span.title = TOKEN_TITLES[runState];
    span.textContent = run;
    frag.append(span);
    run = "";
  };
  chars.forEach((ch, i) => {
    // masks stay one span each (one box per masked token); other states group into runs
    if (states[i] !== runState || states[i] === "mask" || states[i] === "remask") { flush(); runState = states[i]; }
    run += ch;
  });
  flush();
  container.replaceChildren(frag);
  container.scrollTop = container.scrollHeight;   // the active block is at the end
}

// ------------------------------------------------------------------------------------------ messages
function addMessage(role, text) {
  const el = document.createElement("article");
  el.className = `msg ${role}`;
  el.setAttribute("aria-label", role === "user" ? "You" : "Assistant");
  const body = document.createElement("div");
  body.className = "body";
  if (role === "user") body.textContent = text; else body.innerHTML = renderMarkdown(text || "");
  el.append(body);
  $("messages").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function assistantParts(el) {
  const view = document.createElement("details");
  view.className = "denoise";
  view.open = true;
  view.innerHTML = '<summary>Denoising</summary><div class="frame" aria-label="Current frame"></div>';
  const stats = document.createElement("p");
  stats.className = "stats";
  el.append(view, stats);
  return { body: el.querySelector(".body"), view, frame: view.querySelector(".frame"), stats };
}

function showStats(parts, s) {
  const seconds = (performance.now() - s.t0) / 1000;
  const tokens = s.tokens;
  const bits = [];
  if (tokens !== null) bits.push(`${tokens} tokens`, `${(tokens / Math.max(seconds, 1e-3)).toFixed(1)} tokens/s`);
  if (s.frames > 0) {
    bits.push(`${s.frames} forwards`);
    if (tokens !== null) bits.push(`${(tokens / s.frames).toFixed(2)} tokens/forward`);
  }
  if (s.edits) bits.push(`${s.edits} edits`);
  if (s.remasks) bits.push(`${s.remasks} remasks`);
  bits.push(`${seconds.toFixed(2)} s`);
  if (s.finish) bits.push(`finish: ${s.finish}`);
  parts.stats.textContent = bits.join(" · ");
}

// Streams one request; onText(fullText) on each content delta. Returns the final text.
async function stream(path, body, parts, onText) {
  const s = { t0: performance.now(), frames: 0, tokens: null, finish: null };
  let text = "";
  state.controller = new AbortController();
  setBusy(true);
  try {
    const resp = await api(path, { method: "POST", headers: { "Content-Type": "application/json" },
                                   body: JSON.stringify(body), signal: state.controller.signal });
    if (!resp.ok) throw new Error(await errorMessage(resp));
    await readSSE(resp, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || "error");
      if (chunk.diffusing && chunk.diffusing.index === 0) {
        s.frames = chunk.diffusing.forwards ?? s.frames + 1;  // the server's count, prefill included
        renderFrame(parts.frame, chunk.diffusing);
        parts.frame.dataset.masked = String(chunk.diffusing.masked);
        if (chunk.diffusing.edits !== undefined) s.edits = chunk.diffusing.edits;     // with self-correction on
        if (chunk.diffusing.remasks !== undefined) s.remasks = chunk.diffusing.remasks;
      }
      for (const choice of chunk.choices || []) {
        if (choice.index !== 0) continue;
        const piece = choice.delta ? choice.delta.content : choice.text;
        if (piece) { text += piece; onText(text); }
        if (choice.finish_reason) s.finish = choice.finish_reason;
      }
      if (chunk.usage) s.tokens = chunk.usage.completion_tokens;
      showStats(parts, s);
    });
    parts.view.open = false;
  } catch (e) {
    const stopped = e.name === "AbortError";
    if (!stopped) state.controller.abort();  // an error frame: close the stream too
    s.finish = stopped ? "stopped" : s.finish;
    const note = document.createElement("p");
    note.className = stopped ? "note" : "error";
    note.setAttribute("role", stopped ? "status" : "alert");
    note.textContent = stopped ? "Stopped." : `Error: ${e.message}`;
    parts.body.after(note);
  } finally {
    state.controller = null;
    setBusy(false);
    showStats(parts, s);
    if (!body.diffusing) parts.view.hidden = true;
  }
  return text;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.classList.toggle("busy", busy);
}

// ------------------------------------------------------------------------------------------ modes
async function sendChat(fields) {
  const input = $("input");
  const content = input.value.trim();
  if (!content) return;
  input.value = "";
  addMessage("user", content);
  state.history.push({ role: "user", content });
  const el = addMessage("assistant", "");
  el.classList.add("streaming");
  const parts = assistantParts(el);
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...state.history] : [...state.history];
  const text = await stream("v1/chat/completions", { ...fields, messages }, parts, (t) => {
    parts.body.innerHTML = renderMarkdown(t);
  });
  el.classList.remove("streaming");
  el.dataset.text = text;   // the raw answer (Markdown source)
  el.dataset.done = "true";
  state.history.push({ role: "assistant", content: text });
}

async function sendFim(fields) {
  const prefix = $("fim-prefix").value, suffix = $("fim-suffix").value;
  const out = $("fim-out");
  delete out.dataset.done;
  out.replaceChildren();
  out.innerHTML = '<div class="body"><pre class="code"><code></code></pre></div>';
  const parts = assistantParts(out);
  const code = out.querySelector("code");
  const draw = (middle) => {
    const mark = document.createElement("mark");
    mark.className = "infill";
    mark.textContent = middle;
    code.replaceChildren(document.createTextNode(prefix), mark, document.createTextNode(suffix));
  };
  draw("");
  await stream("v1/fim/completions", { ...fields, prompt: prefix, suffix }, parts, draw);
  out.dataset.done = "true";
}

async function sendJson(fields) {
  const content = $("input").value.trim();
  const verdict = $("json-valid");
  let schema;
  try { schema = JSON.parse($("json-schema").value); } catch (e) {
    verdict.className = "validity bad"; verdict.textContent = `The schema is not JSON: ${e.message}`; return;
  }
  const out = $("json-out");
  delete out.dataset.done;
  out.innerHTML = '<div class="body"><pre class="code"><code></code></pre></div>';
  verdict.className = "validity"; verdict.textContent = "";
  const parts = assistantParts(out);
  const code = out.querySelector("code");
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []),
                    { role: "user", content: content || "Answer with a JSON value." }];
  const text = await stream("v1/chat/completions", {
    ...fields, messages, response_format: { type: "json_schema", json_schema: { name: "playground", schema } },
  }, parts, (t) => { code.textContent = t; });
  let value;
  try { value = JSON.parse(text); } catch (e) {
    verdict.className = "validity bad"; verdict.textContent = `✗ Not valid JSON: ${e.message}`; out.dataset.done = "true"; return;
  }
  const problems = validate(value, schema, "$");
  verdict.className = problems.length ? "validity bad" : "validity good";
  verdict.textContent = problems.length ? `✗ Does not match the schema: ${problems.join("; ")}`
                                        : "✓ Valid JSON matching the schema (type, properties, required, enum, items checked)";
  out.dataset.done = "true";
}

// A minimal JSON Schema check: type, enum, const, properties, required, items. Other keywords are ignored.
function validate(value, schema, path) {
  if (schema === true || !schema || typeof schema !== "object") return [];
  const problems = [];
  const typeOf = (v) => v === null ? "null" : Array.isArray(v) ? "array"
                      : Number.isInteger(v) ? "integer" : typeof v;
  if (schema.type) {
    const types = Array.isArray(schema.type) ? schema.type : [schema.type];
    const t = typeOf(value);
    if (!types.some((want) => want === t || (want === "number" && t === "integer"))) {
      return [`${path} is ${t}, not ${types.join(" or ")}`];
    }
  }
  if (schema.enum && !schema.enum.some((e) => JSON.stringify(e) === JSON.stringify(value))) {
    problems.push(`${path} is not one of ${JSON.stringify(schema.enum)}`);
  }
  if ("const" in schema && JSON.stringify(schema.const) !== JSON.stringify(value)) {
    problems.push(`${path} is not ${JSON.stringify(schema.const)}`);
  }
  if (typeOf(value) === "object") {
    for (const name of schema.required || []) if (!(name in value)) problems.push(`${path}.${name} is missing`);
    for (const [name, sub] of Object.entries(schema.properties || {})) {
      if (name in value) problems.push(...validate(value[name], sub, `${path}.${name}`));
    }
  }
  if (Array.isArray(value) && schema.items) {
    value.forEach((v, i) => problems.push(...validate(v, schema.items, `${path}[${i}]`)));
  }
  return problems;
}

function setMode(mode) {
  state.mode = mode;
  for (const tab of document.querySelectorAll("[role=tab]")) {
    const on = tab.dataset.mode === mode;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    $(`mode-${tab.dataset.mode}`).hidden = !on;
  }
  $("send").textContent = mode === "fim" ? "Fill" : "Send";
  $("input").hidden = mode === "fim";
  $("input").placeholder = mode === "json" ? "Describe the JSON to produce" : "Send a message (Enter sends, Shift+Enter for a new line)";
}

// ------------------------------------------------------------------------------------------ wiring
async function submit() {
  if (state.controller) return;
  let fields;
  try { fields = requestFields(); } catch (e) { setStatus(e.message); return; }
  if (state.mode === "chat") await sendChat(fields);
  else if (state.mode === "fim") await sendFim(fields);
  else await sendJson(fields);
}

function init() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); submit(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("reset").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history = [];
    $("messages").replaceChildren();
    $("fim-out").replaceChildren();
    $("json-out").replaceChildren();
    $("json-valid").textContent = "";
    $("input").focus();
  });
  $("forget-key").addEventListener("click", () => { localStorage.removeItem(KEY_STORE); setStatus("API key forgotten"); });
  const tabs = [...document.querySelectorAll("[role=tab]")];
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => setMode(tab.dataset.mode));
    tab.addEventListener("keydown", (e) => {  // arrow keys move between tabs
      const step = e.key === "ArrowRight" ? 1 : e.key === "ArrowLeft" ? -1 : 0;
      if (!step) return;
      const next = tabs[(i + step + tabs.length) % tabs.length];
      setMode(next.dataset.mode);
      next.focus();
    });
  });
  defaults = readSettings();
  applySettings(storedSettings());
  for (const id of KEPT) {
    $(id).addEventListener("input", saveSettings);
    $(id).addEventListener("change", saveSettings);
  }
  $("default-settings").addEventListener("click", () => {
    localStorage.removeItem(SETTINGS_STORE);
    applySettings(defaults);
    setStatus("default settings");
  });
  setMode("chat");
  setBusy(false);
  loadModels();
}

document.addEventListener("DOMContentLoaded", init);
