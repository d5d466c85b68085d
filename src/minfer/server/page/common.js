// What both pages share: the API key (asked once, when the server answers 401) and JSON fetches.
"use strict";

const KEY_STORE = "minfer.apiKey";

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

function authHeaders() {
  const key = localStorage.getItem(KEY_STORE);
  return key ? {Authorization: "Bearer " + key} : {};
}

// Ask for the key in the page's dialog (never window.prompt); resolves false when the person cancels.
function askKey(message) {
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  document.getElementById("key-message").textContent = message || "This server wants an API key.";
  input.value = "";
  return new Promise((resolve) => {
    dialog.onclose = () => {
      if (dialog.returnValue === "save" && input.value.trim()) {
        localStorage.setItem(KEY_STORE, input.value.trim());
        resolve(true);
      } else resolve(false);
    };
    dialog.showModal();
    input.focus();
  });
}

function keyRequired() {
  const meta = document.querySelector('meta[name="minfer-key"]');
  return meta !== null && meta.content === "required";
}

let asking = null;  // one question at a time, whatever the number of calls waiting for it

// fetch with the key: asked first when the server says it wants one and none is saved, and again on a 401.
async function apiFetch(url, options) {
  options = options || {};
  if (keyRequired() && !localStorage.getItem(KEY_STORE)) {
    asking = asking || askKey("This server wants an API key.").finally(() => { asking = null; });
    await asking;
  }
  for (let attempt = 0; ; attempt++) {
    const headers = Object.assign({}, options.headers || {}, authHeaders());
    const r = await fetch(url, Object.assign({}, options, {headers}));
    if (r.status !== 401 || attempt > 0) return r;
    const msg = localStorage.getItem(KEY_STORE) ? "The saved API key was refused: enter it again." : "This server wants an API key.";
    if (!(await askKey(msg))) return r;
  }
}

async function apiJSON(url, options) {
  const r = await apiFetch(url, options);
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (!r.ok) {
    const msg = body && body.error ? body.error.message : r.status + " " + r.statusText;
    throw new Error(msg);
  }
  return body;
}

function fmtNum(x, digits) {
  if (x === null || x === undefined) return "–";
  if (!isFinite(x)) return x > 0 ? "+inf" : "-inf";
  const a = Math.abs(x);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return x.toExponential(digits || 3);
  return String(+x.toFixed(digits === undefined ? 4 : digits));
}

// a stored chat message's content as the server takes it: its images (data: URLs) before its text, as OpenAI
// image_url parts, or the text alone (the chat page sends it; the explorer's Inspect traces it)
function messageContent(m) {
  return m.images && m.images.length
    ? [...m.images.map((url) => ({type: "image_url", image_url: {url}})), {type: "text", text: m.content}]
    : m.content;
}
