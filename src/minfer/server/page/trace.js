// The trace explorer: one forward pass held on the server, its tensors fetched as the page needs them.
"use strict";

const $ = (id) => document.getElementById(id);
const API = "/trace/api";
// the model traced, on a server of several (the chat page's Inspect link names it): every request names it, so the
// server of several sends each to that model's own server, which holds its runs
const MODEL = new URLSearchParams(location.search).get("model");

function api(path) {
  if (!MODEL) return API + path;
  return API + path + (path.includes("?") ? "&" : "?") + "model=" + encodeURIComponent(MODEL);
}
// what the page holds, for people poking at it in the console (and the browser tests)
const X = window.minferExplorer = {run: null, summary: null, graph: null, node: null, attention: null, lens: null,
  compare: null, parted: null, painted: null};

function decode(o) {
  if (!o) return null;
  const bin = atob(o.b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return {shape: o.shape, data: new Float32Array(bytes.buffer)};
}

function status(text) { $("status").textContent = text || ""; }

function tokenLabel(t) { return JSON.stringify(t); }

// ---------------------------------------------------------------------------------------------------
// drawing

const tip = () => $("tooltip");

function hideTip() { tip().style.display = "none"; }

function showTip(e, text) {
  const t = tip();
  t.textContent = text;
  t.style.display = "block";
  t.style.left = (e.clientX + 14) + "px";
  t.style.top = (e.clientY + 10) + "px";
}

// Writes the colour of value v into img at byte k: white to blue for weights (sequential), blue-white-red
// around 0 otherwise, grey where not finite.
function paint(px, k, v, lo, hi, sequential) {
  let r, g, b;
  if (!isFinite(v)) { r = g = b = 215; }
  else if (sequential) {
    const a = hi > lo ? (v - lo) / (hi - lo) : 0;
    r = 255 - 215 * a; g = 255 - 160 * a; b = 255 - 60 * a;
  } else {
    const m = Math.max(-lo, hi) || 1;
    const a = Math.max(-1, Math.min(1, v / m));
    if (a >= 0) { r = 255; g = b = 255 - 200 * a; } else { r = g = 255 + 200 * a; b = 255; }
  }
  px[k] = r; px[k + 1] = g; px[k + 2] = b; px[k + 3] = 255;
}

// A matrix as a canvas, one cell per value, exact values on hover.
// opts: name, rowAxis, colAxis, rowLabel(i), colLabel(j), masked(i, j), maskLabel, sequential, note
function heatmap(title, m, opts) {
  opts = opts || {};
  const [r, c] = m.shape.length === 2 ? m.shape : [1, m.shape[0]];
  const masked = opts.masked;
  let lo = Infinity, hi = -Infinity;
  for (let i = 0; i < r; i++) for (let j = 0; j < c; j++) {
    if (masked && masked(i, j)) continue;
    const v = m.data[i * c + j];
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  if (!isFinite(lo)) lo = 0;
  if (!isFinite(hi)) hi = 0;
  const canvas = el("canvas", {width: String(c), height: String(r), "data-name": opts.name || title,
    role: "img", "aria-label": title + " [" + r + ", " + c + "]"});
  const g2 = canvas.getContext("2d");
  const img = g2.createImageData(c, r);
  const px = img.data;
  for (let i = 0; i < r; i++) for (let j = 0; j < c; j++) {
    const k = 4 * (i * c + j);
    if (masked && masked(i, j)) { px[k] = px[k + 1] = px[k + 2] = 200; px[k + 3] = 255; }
    else paint(px, k, m.data[i * c + j], lo, hi, opts.sequential);
  }
  g2.putImageData(img, 0, 0);
  // each axis scaled on its own: a [12, 576] activation reads as well as a [512, 512] score matrix
  const cw = Math.max(1, Math.min(24, Math.floor(576 / c))), ch = Math.max(1, Math.min(24, Math.floor(320 / r)));
  canvas.style.width = (c * cw) + "px";
  canvas.style.height = (r * ch) + "px";
  canvas.values = m;
  canvas.addEventListener("mousemove", (e) => {
    const box = canvas.getBoundingClientRect();
    const j = Math.floor((e.clientX - box.left) / box.width * c), i = Math.floor((e.clientY - box.top) / box.height * r);
    if (i < 0 || j < 0 || i >= r || j >= c) return hideTip();
    const masked = opts.masked && opts.masked(i, j);
    showTip(e, (opts.rowAxis || "row") + " " + (opts.rowLabel ? opts.rowLabel(i) : i) + "\n" +
      (opts.colAxis || "col") + " " + (opts.colLabel ? opts.colLabel(j) : j) + "\n" +
      (masked ? "masked (-inf before softmax, weight 0)" : "value " + m.data[i * c + j]));
  });
  canvas.addEventListener("mouseleave", hideTip);
  const meta = el("div", {class: "meta"}, "[" + r + ", " + c + "] " + (opts.rowAxis || "row") + " × " + (opts.colAxis || "col") +
    " · min " + fmtNum(lo) + " · max " + fmtNum(hi) + (opts.note ? " · " + opts.note : ""));
  const wrap = el("div", {class: "heat", "data-heatmap": opts.name || title}, el("h3", {}, title), canvas, meta);
  if (r <= 6 && c <= 6) {  // small enough to read every value
    const t = el("table", {class: "data values"});
    for (let i = 0; i < r; i++) t.append(el("tr", {}, el("th", {}, opts.rowLabel ? opts.rowLabel(i) : String(i)),
      ...Array.from({length: c}, (_, j) => {
        const hidden = opts.maskLabel && opts.masked && opts.masked(i, j);
        return el("td", {"data-value": hidden ? "-Infinity" : String(m.data[i * c + j])},
          hidden ? opts.maskLabel : fmtNum(m.data[i * c + j], 8));
      })));
    wrap.append(t);
  }
  return wrap;
}

function histogram(h) {
  const w = 300, ht = 80;
  const canvas = el("canvas", {width: String(w), height: String(ht), role: "img", "aria-label": "histogram"});
  const g = canvas.getContext("2d");
  const max = Math.max(1, ...h.counts);
  const bw = w / Math.max(1, h.counts.length);
  g.fillStyle = "#5b7db1";
  h.counts.forEach((n, i) => { const bh = n / max * (ht - 2); g.fillRect(i * bw, ht - bh, Math.max(1, bw - 1), bh); });
  canvas.addEventListener("mousemove", (e) => {
    const i = Math.floor((e.clientX - canvas.getBoundingClientRect().left) / bw);
    if (i >= 0 && i < h.counts.length) showTip(e, fmtNum(h.edges[i], 5) + " .. " + fmtNum(h.edges[i + 1], 5) + ": " + h.counts[i]);
  });
  canvas.addEventListener("mouseleave", hideTip);
  return el("div", {class: "heat"}, el("h3", {}, "histogram (all values)"), canvas,
    el("div", {class: "meta"}, h.edges.length ? fmtNum(h.edges[0]) + " .. " + fmtNum(h.edges[h.edges.length - 1]) : "no finite values"));
}

function statsTable(s) {
  const t = el("table", {class: "data"});
  const keys = ["min", "max", "mean", "rms", "nan", "inf"];
  t.append(el("tr", {}, ...keys.map((k) => el("th", {}, k))));
  t.append(el("tr", {}, ...keys.map((k) => el("td", {}, s && s[k] !== undefined ? fmtNum(s[k], 6) : "–"))));
  return t;
}

// ---------------------------------------------------------------------------------------------------
// graph

function shortShape(s) { return "[" + s.join(",") + "]"; }

function drawGraph(g) {
  const box = $("graph");
  box.textContent = "";
  const NS = "http://www.w3.org/2000/svg";
  const main = g.nodes.filter((n) => n.op !== "weight");
  const weights = g.nodes.filter((n) => n.op === "weight");
  const rowH = 26, wX = 4, wW = 190, mX = wW + 24, mW = 300;
  const y = {};
  main.forEach((n, i) => { y[n.id] = 8 + i * rowH; });
  const consumerOf = {};
  for (const n of main) for (const i of n.inputs) consumerOf[i] = consumerOf[i] || n.id;
  const height = 16 + main.length * rowH;
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("width", String(mX + mW + 120));
  svg.setAttribute("height", String(height));
  svg.setAttribute("role", "group");
  svg.setAttribute("aria-label", "graph of layer " + g.layer);
  const add = (tag, attrs, parent) => {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    (parent || svg).append(e);
    return e;
  };
  // edges between nodes of the column: arcs on the right, longer ones further out
  for (const n of main) for (const i of n.inputs) {
    if (y[i] === undefined) continue;
    const y0 = y[i] + 10, y1 = y[n.id] + 10, bulge = Math.min(110, 14 + (y1 - y0) / 5);
    add("path", {class: "edge", d: `M ${mX + mW} ${y0} C ${mX + mW + bulge} ${y0}, ${mX + mW + bulge} ${y1}, ${mX + mW} ${y1}`,
      "data-from": String(i), "data-to": String(n.id)});
  }
  const nodeBox = (n, x, yy, w, cls, label) => {
    const grp = add("g", {class: "gnode " + cls, "data-node": String(n.id), tabindex: "0", role: "button",
      "aria-label": "node " + n.id + " " + (n.name || n.op)});
    add("rect", {x: String(x), y: String(yy), width: String(w), height: "20"}, grp);
    const t = add("text", {x: String(x + 5), y: String(yy + 14)}, grp);
    t.textContent = label;
    const title = add("title", {}, grp);
    const s = n.stats;
    title.textContent = `#${n.id} ${n.op} ${n.name} ${shortShape(n.shape)}` + (n.type ? " " + n.type : "") +
      (n.inputs.length ? "\ninputs: " + n.inputs.map((i) => "#" + i).join(", ") : "") +
      (s && s.min !== undefined && s.min !== null ? `\nmin ${fmtNum(s.min)} max ${fmtNum(s.max)} rms ${fmtNum(s.rms)}` : "") +
      (s && s.us ? `\n${s.us} µs` : "");
    const open = () => showNode(n.id);
    grp.addEventListener("click", open);
    grp.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); open(); } });
    return grp;
  };
  for (const n of main) {
    const ins = n.inputs.filter((i) => y[i] !== undefined).map((i) => "#" + i).join(",");
    const label = `#${n.id} ${n.op} ${(n.name || "").replace(/^blk\.\d+\./, "")} ${shortShape(n.shape)}`;
    nodeBox(n, mX, y[n.id], mW, (n.outside ? "outside " : "") + (n.op === "attn" ? "attn" : ""), label);
    if (ins) { const t = add("text", {x: String(mX + mW + 4), y: String(y[n.id] + 14), class: "ins"}); t.textContent = "← " + ins; }
  }
  for (const w of weights) {
    const c = consumerOf[w.id];
    if (c === undefined) continue;
    const yy = y[c];
    nodeBox(w, wX, yy, wW, "weight", `#${w.id} ${w.name.replace(/^blk\.\d+\./, "")} ${w.type || ""}`);
    add("path", {class: "edge", d: `M ${wX + wW} ${yy + 10} L ${mX} ${yy + 10}`, "data-from": String(w.id), "data-to": String(c)});
  }
  box.append(svg);
  markParted();
}

function markParted() {
  for (const g of document.querySelectorAll("#graph .gnode.parted")) g.classList.remove("parted");
  if (X.parted === null) return;
  const g = document.querySelector(`#graph .gnode[data-node="${X.parted}"]`);
  if (g) g.classList.add("parted");
}

function selectNode(id) {
  for (const g of document.querySelectorAll("#graph .gnode.selected")) g.classList.remove("selected");
  const g = document.querySelector(`#graph .gnode[data-node="${id}"]`);
  if (g) g.classList.add("selected");
}

// ---------------------------------------------------------------------------------------------------
// one node

function axesText(a, shape) {
  if (!a) return "";
  let cols = a.cols;
  if (a.heads) cols += " (" + a.heads + " heads × " + a.head_dim + ")";
  return "axes: rows = " + a.rows + " (" + shape[0] + "), columns = " + cols + (shape[1] !== undefined ? " (" + shape[1] + ")" : "");
}

async function showNode(id, rows, cols, vision) {
  selectNode(vision ? null : id);
  const nodes = vision ? X.vision && X.vision.nodes : X.graph && X.graph.nodes;
  const n = nodes && nodes.find((x) => x.id === id);
  const box = $("node");
  const where = vision ? "Vision node" : "Node";
  $("node-title").textContent = n ? `${where} #${id}: ${n.name || n.op} (${n.op})` : where + " #" + id;
  if (n && (n.op === "weight" || n.op === "input" || n.op === "kv_load")) {
    box.textContent = "";
    box.append(el("p", {}, `${n.op} ${n.name} ${shortShape(n.shape)}` + (n.type ? " in " + n.type : "") +
      (n.op === "weight" ? ": a weight, an input of the nodes it feeds (its values are the checkpoint's)."
        : n.op === "kv_load" ? ": a view of the layer's KV cache regions (no data moves)." : ": an input of the pass.")));
    return;
  }
  status("fetching node #" + id + " …");
  const q = new URLSearchParams();
  if (rows) q.set("rows", rows);
  if (cols) q.set("cols", cols);
  let v;
  try { v = await apiJSON(api(`/runs/${X.run}/${vision ? "vision/nodes" : "nodes"}/${id}?${q}`)); } catch (e) { status("error: " + e.message); return; }
  status("");
  X.node = Object.assign({}, v, {values: decode(v.values)});
  box.textContent = "";
  const [r0, r1, rs] = v.rows, [c0, c1, cs] = v.cols;
  const labels = v.labels;
  box.append(el("p", {class: "note"}, "shape " + shortShape(v.shape) + " · " + axesText(v.axes, v.shape)));
  box.append(statsTable(v.stats));
  const strided = rs > 1 || cs > 1 ? ` (1 in ${rs} rows, 1 in ${cs} columns shown: ask for a smaller window to see each)` : "";
  box.append(heatmap(`rows ${r0}:${r1}, columns ${c0}:${c1}${strided}`, X.node.values, {name: "node", rowAxis: v.axes.rows,
    colAxis: v.axes.cols, rowLabel: (i) => (r0 + i * rs) + (labels ? " " + tokenLabel(labels[i]) : ""),
    colLabel: (j) => {
      const c = c0 + j * cs;
      return v.axes.heads ? c + " (head " + Math.floor(c / v.axes.head_dim) + ", dim " + (c % v.axes.head_dim) + ")" : String(c);
    }}));
  box.append(histogram(v.histogram));
  const form = el("form", {class: "pickers"},
    el("label", {}, "Rows ", el("input", {name: "rows", size: "8", value: r0 + ":" + r1})),
    el("label", {}, "Columns ", el("input", {name: "cols", size: "8", value: c0 + ":" + c1})),
    el("button", {type: "submit"}, "Show window"));
  form.addEventListener("submit", (e) => { e.preventDefault(); showNode(id, form.rows.value, form.cols.value, vision); });
  box.append(form);
}

// ---------------------------------------------------------------------------------------------------
// the vision tower's pass (a run whose prompt holds images)

async function showVision() {
  const box = $("vision");
  box.textContent = "";
  X.vision = null;
  $("vision-section").hidden = !X.summary.vision;
  if (!X.summary.vision) return;
  const V = X.vision = await apiJSON(api(`/runs/${X.run}/vision`));
  const rows = X.summary.images.map(([a, b], k) => `${a}..${b - 1} (image ${k})`).join(", ");
  box.append(el("p", {class: "note"}, `${V.tiles} tile${V.tiles === 1 ? "" : "s"} through the vision tower and projector in ${fmtNum(V.seconds, 3)} s, ` +
    `${V.tokens_per_tile} tokens each; prompt rows ${rows} took them. Click a node to see its tensor.`));
  const t = el("table", {class: "data vision-nodes"});
  t.append(el("tr", {}, ...["#", "layer", "node", "op", "shape", "µs", "mean", "rms"].map((c) => el("th", {}, c))));
  for (const n of V.nodes) {
    const st = n.stats || {};
    t.append(el("tr", {}, el("td", {}, el("a", {href: "#", "data-vision-node": String(n.id), class: "node-link"}, "#" + n.id)),
      el("td", {}, n.layer === null ? "" : String(n.layer)), el("td", {}, n.name || ""), el("td", {}, n.op), el("td", {}, shortShape(n.shape)),
      el("td", {}, st.us === undefined ? "" : fmtNum(st.us)), el("td", {}, st.mean === undefined ? "" : fmtNum(st.mean)),
      el("td", {}, st.rms === undefined ? "" : fmtNum(st.rms))));
  }
  t.addEventListener("click", (e) => {
    const a = e.target.closest("[data-vision-node]");
    if (!a) return;
    e.preventDefault();
    showNode(+a.dataset.visionNode, null, null, true);
  });
  box.append(t);
}

// ---------------------------------------------------------------------------------------------------
// attention

async function showAttention() {
  const layer = +$("layer").value, head = +$("head").value;
  const box = $("attention");
  const s = X.summary;
  const n = s.tokens.length;
  const q = new URLSearchParams();
  const want = $("attn-rows").value.trim();
  if (want) q.set("rows", want);
  else if (n > 128) q.set("rows", (n - 128) + ":" + n);  // the last queries, against every key they see
  let a;
  try { a = await apiJSON(api(`/runs/${X.run}/layers/${layer}/attention/${head}?${q}`)); }
  catch (e) { box.textContent = ""; box.append(el("p", {class: "error"}, e.message)); return; }
  const A = X.attention = {layer: a.layer, head: a.head, kv_head: a.kv_head, rows: a.rows, keys: a.keys, check: a.check,
    cache_type: a.cache_type, scale: a.scale, window: a.window, nodes: a.nodes, labels: a.labels,
    q: decode(a.q), k: decode(a.k), v: decode(a.v), scores: decode(a.scores), weights: decode(a.weights),
    output: decode(a.output), output_reference: decode(a.output_reference), o_proj: decode(a.o_proj),
    visible_from: a.visible_from, visible_to: a.visible_to};
  box.textContent = "";
  const r0 = a.rows[0];
  const tok = (i) => i + " " + tokenLabel(a.labels[i]);
  const nd = a.nodes;
  const ref = (key) => nd[key] ? el("a", {href: "#", "data-node": String(nd[key].id), class: "node-link"}, `#${nd[key].id} ${nd[key].name}`) : "(given)";
  const flow = el("p", {class: "flow"}, "query path: ");
  if (nd.q) flow.append(ref("q"), " → ");
  if (nd.q_norm) flow.append(ref("q_norm"), " (QK-norm, per head, before RoPE) → ");
  flow.append(ref("q_rope"), " · keys: ");
  if (nd.k) flow.append(ref("k"), " → ");
  if (nd.k_norm) flow.append(ref("k_norm"), " → ");
  flow.append(ref("k_rope"), " → KV cache (", el("strong", {}, a.cache_type), ") · values: ", ref("v"),
    " → KV cache · ", ref("attn"), " (fused kernel)");
  if (nd.o_proj) flow.append(" → ", ref("o_proj"), " (o_proj)");
  box.append(flow);
  for (const link of flow.querySelectorAll("a.node-link")) link.addEventListener("click", (e) => { e.preventDefault(); showNode(+link.dataset.node); });
  const groupNote = a.group > 1 ? ` · query heads ${a.kv_head * a.group}..${a.kv_head * a.group + a.group - 1} share kv head ${a.kv_head}` : "";
  box.append(el("p", {class: "note"}, `layer ${a.layer}, query head ${a.head} (kv head ${a.kv_head})${groupNote} · scale 1/√d = ${fmtNum(a.scale, 6)} · ` +
    (a.window > 0 ? `sliding window of ${a.window}` : "causal window: query t sees keys 0..t") + ` · K and V as the kernel read them from the ${a.cache_type} cache` +
    (r0 > 0 ? ` · queries ${a.rows[0]}..${a.rows[1] - 1} of ${n}` : "")));
  const c = a.check;
  box.append(el("p", {class: "check " + (c.equal ? "ok" : "bad"), id: "attention-check"},
    `O from the fused kernel vs the traced reference (float64, same Q, K, V): max |Δ| = ${c.max_abs.toExponential(2)} ` +
    (c.equal ? `≤ ${c.tol.toExponential(1)}: equal` : `> ${c.tol.toExponential(1)}: they differ`)));
  const qo = {rowAxis: "query position", rowLabel: (i) => tok(r0 + i)};
  const ko = {rowAxis: "key position", rowLabel: tok};
  const dim = {colAxis: "head feature"};
  // a query sees keys visible_from..visible_to: its own position, or an image's last (Gemma 3's image rows)
  const masked = (i, j) => j < A.visible_from[i] || j > A.visible_to[i];
  const grid = el("div");
  grid.append(heatmap("Q (after " + (nd.q_norm ? "QK-norm and " : "") + "RoPE)", A.q, Object.assign({name: "q"}, qo, dim)));
  grid.append(heatmap("K (from the cache)", A.k, Object.assign({name: "k"}, ko, dim)));
  grid.append(heatmap("V (from the cache)", A.v, Object.assign({name: "v"}, ko, dim)));
  box.append(grid);
  const kq = {rowAxis: "query", rowLabel: (i) => tok(r0 + i), colAxis: "key", colLabel: tok};
  const grid2 = el("div");
  grid2.append(heatmap("scores S = QKᵀ/√d", A.scores, Object.assign({name: "scores"}, kq)));
  grid2.append(heatmap("causal window: S with future keys at -inf", A.scores, Object.assign({name: "masked", masked, maskLabel: "-inf"}, kq)));
  grid2.append(heatmap("softmax weights A (rows sum to 1)", A.weights, Object.assign({name: "weights", masked, sequential: true}, kq)));
  box.append(grid2);
  const grid3 = el("div");
  grid3.append(heatmap("O = AV (fused kernel, this head)", A.output, Object.assign({name: "output"}, qo, dim)));
  grid3.append(heatmap("O = AV (reference)", A.output_reference, Object.assign({name: "output_reference"}, qo, dim)));
  if (A.o_proj) grid3.append(heatmap("o_proj: all heads concatenated × W_o", A.o_proj, Object.assign({name: "o_proj"}, qo, {colAxis: "embedding feature"})));
  box.append(grid3);
}

// ---------------------------------------------------------------------------------------------------
// logit lens

async function showLens() {
  const n = X.summary.tokens.length;
  const raw = $("lens-positions").value.trim() || (Math.max(0, n - 8) + ":" + n);
  const box = $("lens");
  status("logit lens …");
  let L;
  try { L = await apiJSON(api(`/runs/${X.run}/lens?positions=${encodeURIComponent(raw)}`)); } catch (e) { status("error: " + e.message); return; }
  status("");
  X.lens = L;
  box.textContent = "";
  const t = el("table", {class: "data lens"});
  t.append(el("tr", {}, el("th", {}, "layer"), ...L.positions.map((p, j) => el("th", {}, p + " " + tokenLabel(L.labels[j])))));
  L.layers.forEach((row, layer) => {
    t.append(el("tr", {}, el("th", {}, String(layer)), ...row.map((cell) => el("td",
      {title: cell.map(([id, text, logit, p]) => `${tokenLabel(text)} ${(100 * p).toFixed(1)}% (logit ${fmtNum(logit)}, id ${id})`).join("\n")},
      tokenLabel(cell[0][1]) + " " + (100 * cell[0][3]).toFixed(0) + "%"))));
  });
  if (L.model_top) t.append(el("tr", {}, el("th", {}, "model"), ...L.model_top.map((id, j) => {
    const best = X.summary.top_tokens[L.positions[j]];
    return el("td", {}, best ? tokenLabel(best[0][1]) : String(id));
  })));
  box.append(t);
}

// ---------------------------------------------------------------------------------------------------
// compare

async function showCompare(b) {
  status("comparing …");
  let C;
  try { C = await apiJSON(api(`/compare?a=${encodeURIComponent(X.run)}&b=${encodeURIComponent(b)}`)); } catch (e) { status("error: " + e.message); return; }
  status("");
  X.compare = C;
  const box = $("compare");
  box.textContent = "";
  const f = C.first;
  X.parted = f ? f.node : null;
  box.append(el("p", {id: "compare-verdict", class: f ? "check bad" : "check ok"}, f
    ? `${C.a} and ${C.b} part at node #${f.node} ${f.name} (${f.op}): max abs ${fmtNum(f.max_abs, 4)}, max rel ${fmtNum(f.max_rel, 4)}, cosine ${f.cosine !== undefined ? f.cosine.toFixed(7) : "–"} (tolerance ${C.tol})`
    : `${C.a} and ${C.b} agree on all ${C.rows.length} nodes compared (tolerance ${C.tol})`));
  const t = el("table", {class: "data"});
  t.append(el("tr", {}, ...["node", "name", "op", "max abs", "max rel", "cosine"].map((h) => el("th", {}, h))));
  for (const r of C.rows) t.append(el("tr", {class: r.parts ? "parted" : null}, el("td", {}, "#" + r.node), el("td", {}, r.name), el("td", {}, r.op),
    el("td", {}, r.shape_mismatch ? "shapes " + JSON.stringify(r.shape_mismatch) : fmtNum(r.max_abs, 4)),
    el("td", {}, r.shape_mismatch ? "" : fmtNum(r.max_rel, 4)), el("td", {}, r.shape_mismatch ? "" : r.cosine.toFixed(7))));
  box.append(t);
  if (f && f.layer !== null && f.layer !== +$("layer").value) { $("layer").value = String(f.layer); await showLayer(); }
  markParted();
}

// ---------------------------------------------------------------------------------------------------
// runs

async function refreshRuns(selected) {
  const list = await apiJSON(api(`/runs`));
  const sel = $("run");
  sel.textContent = "";
  for (const r of list.runs.slice().reverse()) sel.append(el("option", {value: r.id, selected: r.id === selected ? "" : null}, `${r.id}: ${r.description}`));
  const cmp = $("compare-b");
  cmp.textContent = "";
  for (const r of list.runs.slice().reverse()) if (r.id !== selected) cmp.append(el("option", {value: r.id}, `${r.id}: ${r.description}`));
  for (const d of list.dumps) cmp.append(el("option", {value: d}, d));
  return list;
}

async function showLayer(withNode) {
  const layer = +$("layer").value;
  $("graph-layer").textContent = String(layer);
  const attention = showAttention();  // fetched while the graph is drawn
  X.graph = await apiJSON(api(`/runs/${X.run}/layers/${layer}/graph`));
  drawGraph(X.graph);
  const attnNode = X.graph.nodes.find((n) => n.op === "attn");
  await Promise.all([attention, withNode && attnNode ? showNode(attnNode.id) : null]);
}

async function openRun(id) {
  X.run = id;
  X.parted = null;
  const s = X.summary = await apiJSON(api(`/runs/${id}`));
  const url = new URL(location.href);
  if (url.searchParams.get("run") !== id) {
    url.search = "?run=" + id + (MODEL ? "&model=" + encodeURIComponent(MODEL) : "");
    history.replaceState(null, "", url);
  }
  const m = s.memory;
  $("run-info").textContent = `${s.description} · ${s.tokens.length} tokens · ${s.n_layer} layers, ${s.n_head} query heads over ${s.n_head_kv} kv heads of ${s.head_dim} · ` +
    (s.images.length ? `images at rows ${s.images.map(([a, b]) => a + ".." + (b - 1)).join(", ")} · ` : "") +
    `${s.cache_type} KV cache · traced in ${fmtNum(s.seconds, 2)} s · trace memory: ${(m.held_bytes / 1048576).toFixed(1)} MiB held ` +
    `(budget ${(m.budget_bytes / 1048576).toFixed(0)} MiB; all layers would take ${(m.all_layers_bytes / 1048576).toFixed(1)} MiB; layers held: ${m.held_layers.length} of ${s.n_layer}` +
    `${m.held_layers.length < s.n_layer ? ", the others captured again when asked" : ""}) + plan and cache ${(m.arena_bytes / 1048576).toFixed(1)} MiB`;
  const ls = $("layer"), hs = $("head");
  const wantLayer = Math.min(+(url.searchParams.get("layer") || 0), s.n_layer - 1);
  ls.textContent = ""; hs.textContent = "";
  for (let i = 0; i < s.n_layer; i++) ls.append(el("option", {value: String(i), selected: i === wantLayer ? "" : null}, String(i)));
  const g = s.n_head / s.n_head_kv;
  for (let h = 0; h < s.n_head; h++) hs.append(el("option", {value: String(h)}, `${h} (kv ${Math.floor(h / g)})`));
  await Promise.all([refreshRuns(id), showLayer(true), showVision()]);
  if (X.painted === null) {
    X.painted = performance.now();
    performance.mark("explorer-painted");
  }
  document.body.dataset.ready = "1";
}

async function newRun(body) {
  status("tracing …");
  const r = await apiJSON(api(`/runs`), {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  status("");
  return r.id;
}

function exchangeFromChat(convId, upto) {
  let convs = [];
  try { convs = JSON.parse(localStorage.getItem("minfer.conversations") || "[]"); } catch (e) { convs = []; }
  const c = convs.find((x) => x.id === convId);
  if (!c) throw new Error("no conversation " + convId + " in this browser's storage");
  const messages = [];
  let system = "";
  try { system = (JSON.parse(localStorage.getItem("minfer.settings") || "{}").system || "").trim(); } catch (e) { system = ""; }
  if (system) messages.push({role: "system", content: system});
  const end = upto === null ? c.messages.length - 1 : +upto;
  for (const m of c.messages.slice(0, end + 1)) messages.push({role: m.role, content: messageContent(m)});
  return messages;
}

async function start() {
  window.addEventListener("error", (e) => status("error: " + e.message));
  $("layer").addEventListener("change", () => showLayer().catch((e) => status("error: " + e.message)));
  $("head").addEventListener("change", () => showAttention().catch((e) => status("error: " + e.message)));
  $("attn-rows").addEventListener("change", () => showAttention().catch((e) => status("error: " + e.message)));
  $("run").addEventListener("change", () => openRun($("run").value).catch((e) => status("error: " + e.message)));
  $("new-run").addEventListener("submit", async (e) => {
    e.preventDefault();
    const body = {prompt: $("prompt").value};
    if ($("cache-type").value) body.cache_type = $("cache-type").value;
    try { await openRun(await newRun(body)); } catch (err) { status("error: " + err.message); }
  });
  $("lens-form").addEventListener("submit", (e) => { e.preventDefault(); showLens(); });
  $("compare-form").addEventListener("submit", (e) => { e.preventDefault(); if ($("compare-b").value) showCompare($("compare-b").value); });
  $("compare-cache-go").addEventListener("click", async () => {
    try {
      const b = await newRun({run: X.run, cache_type: $("compare-cache").value});
      await refreshRuns(X.run);
      $("compare-b").value = b;
      await showCompare(b);
    } catch (err) { status("error: " + err.message); }
  });
  const p = new URLSearchParams(location.search);
  try {
    if (p.get("conversation")) {
      await openRun(await newRun({messages: exchangeFromChat(p.get("conversation"), p.get("upto"))}));
    } else if (p.get("run")) {
      await openRun(p.get("run"));
    } else {
      const list = await refreshRuns(null);
      if (list.runs.length) await openRun(list.runs[list.runs.length - 1].id);
      else status("no trace yet: give a prompt above");
    }
  } catch (e) {
    status("error: " + e.message);
  }
}

start();
