// The chat page: conversations in localStorage, answers streamed from /v1/chat/completions.
"use strict";

const STORE = "minfer.conversations";
const CURRENT = "minfer.current";
const SETTINGS = "minfer.settings";

const $ = (id) => document.getElementById(id);
const state = {conversations: [], current: null, controller: null, modelId: null, vision: false, pending: [],
  models: [], refreshing: null, propsFor: null};

// ---------------------------------------------------------------------------------------------------
// storage

function load() {
  try { state.conversations = JSON.parse(localStorage.getItem(STORE) || "[]"); } catch (e) { state.conversations = []; }
  state.current = localStorage.getItem(CURRENT);
  if (!state.conversations.some((c) => c.id === state.current)) state.current = null;
  try {
    const s = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
    for (const [id, v] of Object.entries(s)) if ($(id)) $(id).value = v;
  } catch (e) { /* settings are optional */ }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state.conversations));
  if (state.current) localStorage.setItem(CURRENT, state.current); else localStorage.removeItem(CURRENT);
}

function saveSettings() {
  const s = {};
  for (const id of ["system", "temperature", "top-p", "max-tokens", "json-schema"]) s[id] = $(id).value;
  localStorage.setItem(SETTINGS, JSON.stringify(s));
}

function conversation() {
  return state.conversations.find((c) => c.id === state.current) || null;
}

function newConversation() {
  const c = {id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat",
    messages: [], updated: Date.now()};
  state.conversations.unshift(c);
  state.current = c.id;
  save();
  return c;
}

// ---------------------------------------------------------------------------------------------------
// rendering

function renderMarkdown(target, text) {
  const html = DOMPurify.sanitize(marked.parse(text, {gfm: true, breaks: false}));
  target.innerHTML = html;
  for (const pre of target.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    if (code) hljs.highlightElement(code);
    const copy = el("button", {type: "button", class: "copy", "aria-label": "Copy code"}, "Copy");
    copy.addEventListener("click", async () => {
      try { await navigator.clipboard.writeText(code ? code.textContent : pre.textContent); copy.textContent = "Copied"; }
      catch (e) { copy.textContent = "Copy failed"; }
      setTimeout(() => { copy.textContent = "Copy"; }, 1500);
    });
    pre.prepend(copy);
  }
}

function statsLine(s) {
  if (!s) return "";
  const parts = [];
  if (s.completion_tokens !== undefined) parts.push(s.completion_tokens + " tokens");
  if (s.tokens_per_second) parts.push(fmtNum(s.tokens_per_second, 1) + " tokens/s");
  if (s.first_token_ms !== undefined) parts.push("first token " + Math.round(s.first_token_ms) + " ms");
  if (s.total_ms !== undefined) parts.push("total " + fmtNum(s.total_ms / 1000, 2) + " s");
  if (s.prompt_tokens !== undefined) parts.push("prompt " + s.prompt_tokens + " tokens" +
    (s.cached_tokens ? " (" + s.cached_tokens + " cached)" : ""));
  if (s.finish_reason) parts.push("finish: " + s.finish_reason);
  return parts.join(" · ");
}

function renderSidebar() {
  const list = $("conversations");
  list.textContent = "";
  for (const c of state.conversations) {
    const open = el("button", {type: "button", class: "open", "aria-current": c.id === state.current ? "true" : null},
      c.title || "New chat");
    open.addEventListener("click", () => {
      if (!state.controller) { state.current = c.id; save(); render(); restoreModel(c); }
    });
    const del = el("button", {type: "button", class: "delete", "aria-label": "Delete " + (c.title || "chat")}, "×");
    del.addEventListener("click", () => {
      if (state.controller) return;
      state.conversations = state.conversations.filter((x) => x !== c);
      if (state.current === c.id) {
        state.current = state.conversations.length ? state.conversations[0].id : null;
        restoreModel(conversation());
      }
      save(); render();
    });
    list.append(el("li", {}, open, del));
  }
}

function messageArticle(c, m, i) {
  const body = el("div", {class: "content"});
  const art = el("article", {class: "message " + m.role, "aria-label": m.role === "user" ? "You" : "Assistant",
    "data-index": String(i)}, el("div", {class: "role"}, m.role === "user" ? "You" : "Assistant"), body);
  if (m.role === "assistant") {
    renderMarkdown(body, m.content);
    if (m.error) art.append(el("p", {class: "error", role: "alert"}, m.error));
    art.append(el("p", {class: "stats"}, statsLine(m.stats)));
    const actions = el("div", {class: "actions"});
    const regen = el("button", {type: "button"}, "Regenerate");
    regen.addEventListener("click", () => regenerate(i));
    const copy = el("button", {type: "button"}, "Copy answer");
    copy.addEventListener("click", () => navigator.clipboard.writeText(m.content).catch(() => {}));
    // on a server of several, the trace is of the model that answered (the explorer names it on every request)
    const model = state.models.length > 1 && (c.model || state.modelId);
    const inspect = el("a", {href: "/trace?conversation=" + encodeURIComponent(c.id) + "&upto=" + i +
      (model ? "&model=" + encodeURIComponent(model) : ""), class: "inspect"}, "Inspect");
    actions.append(regen, copy, inspect);
    art.append(actions);
  } else {
    for (const url of m.images || []) body.append(el("img", {class: "thumbnail", src: url, alt: "image sent"}));
    body.append(document.createTextNode(m.content));
    const edit = el("button", {type: "button"}, "Edit");
    edit.addEventListener("click", () => startEdit(art, i));
    art.append(el("div", {class: "actions"}, edit));
  }
  return art;
}

function render() {
  renderSidebar();
  const box = $("conversation");
  box.textContent = "";
  const c = conversation();
  if (!c) return;
  c.messages.forEach((m, i) => box.append(messageArticle(c, m, i)));
  box.scrollTop = box.scrollHeight;
}

function startEdit(art, i) {
  if (state.controller) return;
  const c = conversation();
  const area = el("textarea", {"aria-label": "Edit message", rows: "3"});
  area.value = c.messages[i].content;
  const resend = el("button", {type: "button"}, "Resend");
  const cancel = el("button", {type: "button"}, "Cancel");
  resend.addEventListener("click", () => {
    const text = area.value.trim();
    if (!text) return;
    const images = c.messages[i].images;
    c.messages = c.messages.slice(0, i);
    c.messages.push(images ? {role: "user", content: text, images} : {role: "user", content: text});
    save(); render(); answer(c);
  });
  cancel.addEventListener("click", render);
  const content = art.querySelector(".content");
  content.replaceWith(el("div", {class: "content editing"}, area, el("div", {class: "actions"}, resend, cancel)));
  art.querySelector(".actions:last-child").remove();
  area.focus();
}

function regenerate(i) {
  if (state.controller) return;
  const c = conversation();
  c.messages = c.messages.slice(0, i);
  save(); render(); answer(c);
}

// ---------------------------------------------------------------------------------------------------
// requests

function requestBody(c) {
  $("settings-error").textContent = "";
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  for (const m of c.messages) {
    if (m.error && !m.content) continue;
    messages.push({role: m.role, content: messageContent(m)});
  }
  const body = {messages, stream: true, stream_options: {include_usage: true}};
  if (state.modelId) body.model = state.modelId;
  const number = (id, name, int) => {
    const raw = $(id).value.trim();
    if (raw === "") return;
    const v = int ? parseInt(raw, 10) : parseFloat(raw);
    if (!isFinite(v)) throw new Error(name + " must be a number");
    body[name] = v;
  };
  number("temperature", "temperature"); number("top-p", "top_p"); number("max-tokens", "max_tokens", true);
  const schema = $("json-schema").value.trim();
  if (schema) {
    let parsed;
    try { parsed = JSON.parse(schema); } catch (e) { throw new Error("the JSON schema is not valid JSON: " + e.message); }
    body.response_format = {type: "json_schema", json_schema: {name: "answer", schema: parsed}};
  }
  return body;
}

function setBusy(busy) {
  $("conversation").setAttribute("aria-busy", busy ? "true" : "false");
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function answer(c) {
  let body;
  try { body = requestBody(c); } catch (e) { $("settings-error").textContent = e.message; $("settings").open = true; return; }
  saveSettings();
  if (state.modelId) c.model = state.modelId;  // the conversation keeps the model it was answered with
  const m = {role: "assistant", content: "", stats: null};
  c.messages.push(m);
  c.updated = Date.now();
  const box = $("conversation");
  const art = messageArticle(c, m, c.messages.length - 1);
  box.append(art);
  const content = art.querySelector(".content");
  const statsEl = art.querySelector(".stats");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const chosen = state.models.find((x) => x.id === state.modelId);
  if (chosen && chosen.status && chosen.status !== "loaded") $("status").textContent = "loading " + chosen.id + "…";
  const t0 = performance.now();
  let tFirst = null, usage = null, finish = null, pending = false;
  const paint = () => {
    pending = false;
    renderMarkdown(content, m.content);
    box.scrollTop = box.scrollHeight;
  };
  try {
    const r = await apiFetch("/v1/chat/completions", {method: "POST", signal: controller.signal,
      headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try { const e = await r.json(); if (e.error) msg = e.error.message; } catch (e) { /* not JSON */ }
      throw new Error(msg);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            if (choice.delta && choice.delta.content) {
              if (tFirst === null) { tFirst = performance.now(); $("status").textContent = ""; }
              m.content += choice.delta.content;
              if (!pending) { pending = true; requestAnimationFrame(paint); }
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else m.error = e.message;
  } finally {
    state.controller = null;
    const t1 = performance.now();
    const n = usage ? usage.completion_tokens : undefined;
    m.stats = {finish_reason: finish || (m.error ? "error" : undefined), total_ms: t1 - t0};
    if (tFirst !== null) m.stats.first_token_ms = tFirst - t0;
    if (usage) {
      m.stats.completion_tokens = n;
      m.stats.prompt_tokens = usage.prompt_tokens;
      m.stats.cached_tokens = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
      if (tFirst !== null && n > 1) m.stats.tokens_per_second = (n - 1) / ((t1 - tFirst) / 1000);
    }
    if (c.title === "New chat") {
      const first = c.messages.find((x) => x.role === "user");
      if (first) c.title = first.content.slice(0, 48);
    }
    save();
    paint();
    if (m.error) art.querySelector(".content").after(el("p", {class: "error", role: "alert"}, m.error));
    statsEl.textContent = statsLine(m.stats);
    setBusy(false);
    renderSidebar();
    $("status").textContent = m.error ? "error: " + m.error : (finish === "stopped" ? "stopped" : "");
    if (state.models.length > 1) refreshModels();  // this answer may have loaded (or unloaded) a model
  }
}

function send() {
  if (state.controller) return;
  const text = $("message").value.trim();
  if (!text) return;
  const c = conversation() || newConversation();
  const m = {role: "user", content: text};
  if (state.pending.length) m.images = state.pending;
  c.messages.push(m);
  state.pending = [];
  renderAttachments();
  if (c.title === "New chat") c.title = text.slice(0, 48);
  $("message").value = "";
  try { save(); } catch (e) { $("status").textContent = "this conversation is too large to keep in the browser: " + e.message; }
  render(); answer(c);
}

// ---------------------------------------------------------------------------------------------------
// images (a vision model: its listing's capabilities or /props say so), attached with the button or pasted,
// sent as data: URLs

function renderAttachments() {
  const box = $("attachments");
  box.textContent = "";
  state.pending.forEach((url, i) => {
    const remove = el("button", {type: "button", "aria-label": "Remove image " + (i + 1)}, "×");
    remove.addEventListener("click", () => { state.pending.splice(i, 1); renderAttachments(); });
    box.append(el("span", {class: "attachment"}, el("img", {class: "thumbnail", src: url, alt: "image " + (i + 1)}), remove));
  });
}

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.addEventListener("load", () => { state.pending.push(reader.result); renderAttachments(); });
    reader.readAsDataURL(file);
  }
}

// ---------------------------------------------------------------------------------------------------
// the model: a several-model server (minfer serve A B, --models-dir) lists more than one, and the picker
// chooses the one each request names; a conversation keeps its model

function modelLabel(m) {
  return m.status ? m.id + " (" + m.status + ")" : m.id;
}

function listModels(data) {
  state.models = (data || []).map((m) => ({id: m.id, status: m.status && m.status.value,
    vision: Array.isArray(m.capabilities) && m.capabilities.includes("multimodal")}));
}

function renderPicker() {
  const several = state.models.length > 1;
  $("model-picker").hidden = !several;
  $("model-name").hidden = several;
  const select = $("model");
  if (!several) { select.textContent = ""; return; }
  // options updated in place: rebuilding them would close the list if it is open
  const ids = state.models.map((m) => m.id);
  if ([...select.options].map((o) => o.value).join("\n") !== ids.join("\n")) {
    select.textContent = "";
    for (const m of state.models) select.append(el("option", {value: m.id}));
  }
  state.models.forEach((m, i) => { select.options[i].textContent = modelLabel(m); });
  select.value = state.modelId;
}

function showVision(vision) {
  state.vision = vision;
  $("attach").hidden = !vision;
}

// Vision is the chosen model's. Several models: its capabilities in the /v1/models listing (choosing one loads
// nothing; /props?model= would load it). One model: /props; the answer for a model chosen since is dropped, and an
// error leaves images off.
function readProps() {
  const id = state.modelId;
  state.propsFor = id;
  if (state.models.length > 1) {
    const chosen = state.models.find((m) => m.id === id);
    showVision(Boolean(chosen && chosen.vision));
    return;
  }
  const apply = (vision) => { if (state.propsFor === id) showVision(vision); };
  apply(false);
  apiJSON("/props").then((props) => apply(Boolean(props.modalities && props.modalities.vision)))
    .catch(() => apply(false));
}

function chooseModel(id) {
  if (!state.models.some((m) => m.id === id)) return;
  const changed = id !== state.modelId;
  state.modelId = id;
  $("model-name").textContent = id;
  document.title = id + " · minfer chat";
  renderPicker();
  if (changed) readProps();
}

// a conversation brings back its model, when the server still has it
function restoreModel(c) {
  if (c && c.model && c.model !== state.modelId) chooseModel(c.model);
}

// the states (loaded, loading, unloaded) read again: when the picker gets focus and after each answer
function refreshModels() {
  if (state.refreshing) return state.refreshing;
  state.refreshing = apiJSON("/v1/models").then((models) => {
    listModels(models.data);
    renderPicker();
  }).catch(() => { /* the states shown stay as they were */ }).finally(() => { state.refreshing = null; });
  return state.refreshing;
}

// ---------------------------------------------------------------------------------------------------

async function start() {
  load();
  render();
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("new-chat").addEventListener("click", () => { if (!state.controller) { newConversation(); render(); $("message").focus(); } });
  for (const id of ["system", "temperature", "top-p", "max-tokens", "json-schema"]) $(id).addEventListener("change", saveSettings);
  $("image-input").addEventListener("change", (e) => { attach(e.target.files); e.target.value = ""; });
  $("message").addEventListener("paste", (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])].filter((f) => f.type.startsWith("image/"));
    if (state.vision && files.length) { e.preventDefault(); attach(files); }
  });
  $("model").addEventListener("focus", refreshModels);
  $("model").addEventListener("change", (e) => {
    chooseModel(e.target.value);
    const c = conversation();
    if (c) { c.model = state.modelId; save(); }
  });
  try {
    const models = await apiJSON("/v1/models");
    listModels(models.data);
  } catch (e) {
    $("status").textContent = "cannot reach the server: " + e.message;
  }
  if (!state.models.length) { readProps(); return; }
  // this conversation's model, else the first one loaded, else the first
  const c = conversation();
  const loaded = state.models.find((m) => m.status === "loaded");
  const saved = c && c.model && state.models.find((m) => m.id === c.model);
  chooseModel((saved || loaded || state.models[0]).id);
}

start();
