// The encoder page: an encoder model cannot chat, so / offers an embeddings and rerank playground instead.
"use strict";

const $ = (id) => document.getElementById(id);
const SHOWN_VALUES = 6;   // the first values of each vector shown
const MATRIX_MAX = 40;    // the similarity matrix is drawn for this many texts at most

// what the page computed, for whoever looks (and for the tests): {texts, vectors, tokens, similarity, ranking}
window.minferEncoder = {card: null, embed: null, rerank: null};

// One text per line, as typed: only the newlines at the very end are dropped, so an empty or a blank line
// goes to the API, whose answer names it.
function lines(value) {
  return value.replace(/[\r\n]+$/, "").split(/\r?\n/);
}

function norm(v) {
  let s = 0;
  for (const x of v) s += x * x;
  return Math.sqrt(s);
}

function cosine(a, b, na, nb) {
  let s = 0;
  for (let i = 0; i < a.length; i++) s += a[i] * b[i];
  return na > 0 && nb > 0 ? s / (na * nb) : 0;
}

// Blue for similar, red for opposite, white around 0 (set through the CSSOM, which the page's CSP allows).
function shade(td, c) {
  const t = Math.max(-1, Math.min(1, c));
  const mix = (to) => Math.round(255 + (to - 255) * Math.abs(t));  // white to the colour, with |c|
  td.style.backgroundColor = t >= 0 ? `rgb(${mix(110)}, ${mix(160)}, ${mix(235)})` : `rgb(${mix(235)}, ${mix(120)}, ${mix(110)})`;
  if (Math.abs(t) > 0.75) td.style.color = "#fff";
}

function showError(id, message) {
  const p = $(id);
  p.textContent = message || "";
  p.title = message || "";
}

function busy(button, on) {
  button.disabled = on;
  button.setAttribute("aria-busy", on ? "true" : "false");
}

function clip(text, n) {
  return text.length > n ? text.slice(0, n - 1) + "…" : text;
}

// ---------------------------------------------------------------------------------------------------
// embeddings

async function tokenCounts(texts, usage) {
  if (texts.length === 1 && usage && usage.prompt_tokens !== undefined) return [usage.prompt_tokens];
  try {
    const got = await Promise.all(texts.map((t) => apiJSON("/tokenize", {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify({content: t})})));
    return got.map((g) => g.tokens.length);
  } catch (e) {
    return texts.map(() => null);
  }
}

function renderVectors(texts, vectors, norms, tokens) {
  const table = $("vectors");
  table.replaceChildren(el("tr", {}, el("th", {}, "#"), el("th", {}, "Text"), el("th", {}, "Tokens"),
    el("th", {}, `First ${Math.min(SHOWN_VALUES, vectors[0] ? vectors[0].length : 0)} values`), el("th", {}, "Norm")));
  texts.forEach((t, i) => {
    const first = Array.from(vectors[i].slice(0, SHOWN_VALUES), (x) => x.toFixed(4)).join(", ");
    table.append(el("tr", {"data-index": i},
      el("td", {}, String(i + 1)),
      el("td", {class: "text", title: t}, clip(t, 60)),
      el("td", {class: "tokens"}, tokens[i] === null ? "–" : String(tokens[i])),
      el("td", {class: "values"}, `[${first}${vectors[i].length > SHOWN_VALUES ? ", …" : ""}]`),
      el("td", {class: "norm", "data-value": norms[i]}, norms[i].toFixed(4))));
  });
  table.hidden = false;
}

function renderSimilarity(texts, sim) {
  const table = $("similarity");
  if (texts.length > MATRIX_MAX) {
    table.hidden = true;
    $("similarity-title").hidden = false;
    $("similarity-title").textContent = `Cosine similarity: not drawn for more than ${MATRIX_MAX} texts`;
    return;
  }
  const head = el("tr", {}, el("th", {}, ""));
  texts.forEach((t, j) => head.append(el("th", {scope: "col", title: t}, String(j + 1))));
  table.replaceChildren(head);
  sim.forEach((row, i) => {
    const tr = el("tr", {}, el("th", {scope: "row", title: texts[i]}, String(i + 1)));
    row.forEach((c, j) => {
      const td = el("td", {"data-value": c, title: `${i + 1} · ${j + 1}: ${c.toFixed(6)}`}, c.toFixed(3));
      shade(td, c);
      tr.append(td);
    });
    table.append(tr);
  });
  $("similarity-title").textContent = "Cosine similarity";
  $("similarity-title").hidden = false;
  table.hidden = false;
}

async function embed(ev) {
  ev.preventDefault();
  const texts = lines($("texts").value);
  showError("embed-error", "");
  busy($("embed"), true);
  $("embed-info").textContent = "embedding…";
  const t0 = performance.now();
  try {
    const body = await apiJSON("/v1/embeddings", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({input: texts, model: window.minferEncoder.card ? window.minferEncoder.card.id : undefined})});
    const ms = performance.now() - t0;
    const data = body.data.slice().sort((a, b) => a.index - b.index);
    const vectors = data.map((d) => Float64Array.from(d.embedding));
    const norms = vectors.map(norm);
    const sim = vectors.map((a, i) => vectors.map((b, j) => cosine(a, b, norms[i], norms[j])));
    const tokens = await tokenCounts(texts, body.usage);
    renderVectors(texts, vectors, norms, tokens);
    renderSimilarity(texts, sim);
    const total = body.usage ? body.usage.prompt_tokens : tokens.reduce((s, n) => s + (n || 0), 0);
    $("embed-info").textContent = `${texts.length} text${texts.length === 1 ? "" : "s"} · ${total} tokens · ` +
      `${vectors[0] ? vectors[0].length : 0} dimensions · ${Math.round(ms)} ms`;
    window.minferEncoder.embed = {texts, vectors: vectors.map((v) => Array.from(v)), norms, tokens, similarity: sim};
  } catch (e) {
    $("embed-info").textContent = "";
    showError("embed-error", e.message);
  } finally {
    busy($("embed"), false);
  }
}

// ---------------------------------------------------------------------------------------------------
// rerank

async function rank(ev) {
  ev.preventDefault();
  const query = $("query").value;
  const documents = lines($("documents").value);
  showError("rerank-error", "");
  busy($("rank"), true);
  $("rerank-info").textContent = "ranking…";
  const t0 = performance.now();
  try {
    const body = await apiJSON("/v1/rerank", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({query, documents, model: window.minferEncoder.card ? window.minferEncoder.card.id : undefined})});
    const ms = performance.now() - t0;
    const table = $("ranking");
    table.replaceChildren(el("tr", {}, el("th", {}, "Rank"), el("th", {}, "Score"), el("th", {}, "Line"),
      el("th", {}, "Document")));
    body.results.forEach((r, k) => {
      table.append(el("tr", {"data-index": r.index},
        el("td", {}, String(k + 1)),
        el("td", {class: "score", "data-value": r.relevance_score}, r.relevance_score.toFixed(4)),
        el("td", {}, String(r.index + 1)),
        el("td", {class: "text", title: documents[r.index]}, clip(documents[r.index], 80))));
    });
    table.hidden = false;
    const n = body.usage ? ` · ${body.usage.prompt_tokens} tokens` : "";
    $("rerank-info").textContent = `${documents.length} document${documents.length === 1 ? "" : "s"}${n} · ${Math.round(ms)} ms`;
    window.minferEncoder.rerank = body.results;
  } catch (e) {
    $("rerank-info").textContent = "";
    showError("rerank-error", e.message);
  } finally {
    busy($("rank"), false);
  }
}

// ---------------------------------------------------------------------------------------------------

async function start() {
  $("embed-form").addEventListener("submit", embed);
  $("rerank-form").addEventListener("submit", rank);
  try {
    const models = await apiJSON("/v1/models");
    const card = models.data && models.data[0];
    if (!card) throw new Error("the server lists no model");
    window.minferEncoder.card = card;
    const meta = card.meta || {};
    $("model-name").textContent = card.id;
    document.title = card.id + " · minfer encoder";
    $("kind-note").textContent = `${card.id} is an encoder model (it ${meta.rerank ? "embeds and reranks" : "embeds"}` +
      "): chat is not available on this server.";
    const info = [];
    if (meta.n_embd) info.push(`${meta.n_embd} dimensions`);
    if (meta.pooling) info.push(`${meta.pooling} pooling`);
    if (meta.max_seq_length) info.push(`at most ${meta.max_seq_length} tokens a text`);
    $("model-info").textContent = info.join(" · ");
    $("rerank-form").hidden = !meta.rerank;
    $("rerank-unavailable").hidden = !!meta.rerank;
    document.body.dataset.ready = "1";
  } catch (e) {
    $("status").textContent = "cannot reach the server: " + e.message;
  }
}

start();
