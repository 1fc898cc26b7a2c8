// kvserve dashboard: polls GET dashboard/state twice a second and draws the KV block pool, a few
// time series (uPlot) and the request table. No build step, no network beyond this server.
"use strict";

const POLL_MS = 500;
const HISTORY_S = 300;
const HIT_WINDOW_S = 30;  // the prefix-cache hit rate is over this sliding window
const MAP_MAX_HEIGHT = 320;
const STATES = ["free", "cached", "used", "shared"];
const PUBLISHED_BIT = 4;
const COLOURS = { free: [230, 230, 230], cached: [143, 184, 222], shared: [214, 39, 40] };
const KEY_STORE = "kvserve-api-key";

const $ = (id) => document.getElementById(id);

// What the page last drew; tests and the curious read it from the console.
const dash = {
  state: null,      // the last state body
  counts: null,     // blocks per state, counted from the per-block states the map draws
  blocks: null,     // decoded: { states: Uint8Array, refs: Uint16Array, first }
  owners: null,     // block id -> { ids: [request ids], tokens }
  layout: null,     // the map's geometry: cell size (px), blocks per cell, columns
  polls: 0,
  refresh,
  cellCentre,
};
window.kvDashboard = dash;

let apiKey = sessionStorage.getItem(KEY_STORE);
let layout = null;  // block map geometry, for hover
const history = { t: [], usage: [], running: [], waiting: [], preempt: [], hit: [], prompt: [], gen: [] };
let charts = null;
let lastPoint = null;
const totals = [];  // {t, tot} of the last HIT_WINDOW_S seconds
let shownAt = 0;  // performance.now() when the shown state arrived

// ------------------------------------------------------------------ data

function bytesOf(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

function decode(state) {
  const pool = state.pool;
  const states = bytesOf(pool.states);
  const refs = new Uint16Array(bytesOf(pool.ref_counts).buffer);
  const counts = { free: 0, cached: 0, used: 0, shared: 0 };
  for (let i = 0; i < states.length; i++) counts[STATES[states[i] & 3]]++;
  const owners = new Map();
  const bs = state.block_size;
  for (const r of state.requests) {
    r.blocks.forEach((id, i) => {
      const tokens = Math.max(0, Math.min(bs, r.kv_tokens - i * bs));
      const o = owners.get(id);
      if (o) o.ids.push(r.id);
      else owners.set(id, { ids: [r.id], tokens });
    });
  }
  return { blocks: { states, refs, first: pool.first_block_id }, counts, owners };
}

function hueOf(id) {  // a stable hue per request id, away from the shared red and cached blue
  let h = 2166136261;
  for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 16777619);
  const x = (h >>> 0) % 220;  // orange .. green .. teal (30-190), or purple (260-320)
  return x < 160 ? 30 + x : 200 + x;
}

function hsl(h, s, l) {
  s /= 100; l /= 100;
  const k = (n) => (n + h / 30) % 12;
  const a = s * Math.min(l, 1 - l);
  const f = (n) => l - a * Math.max(-1, Math.min(k(n) - 3, Math.min(9 - k(n), 1)));
  return [Math.round(255 * f(0)), Math.round(255 * f(8)), Math.round(255 * f(4))];
}

function colourOf(index) {  // RGB of block index `index` in the decoded arrays
  const s = STATES[dash.blocks.states[index] & 3];
  if (s !== "used") return COLOURS[s];
  const o = dash.owners.get(index + dash.blocks.first);
  return o ? hsl(hueOf(o.ids[0]), 55, 52) : [90, 180, 109];
}

// ------------------------------------------------------------------ block map

function drawMap() {
  const canvas = $("blockmap");
  const n = dash.blocks.states.length;
  const width = Math.max(200, Math.floor(canvas.parentElement.clientWidth) - 2);
  let cell = 20, per = 1, cols, rows;
  for (;;) {  // the largest cell that fits; below two pixels, several blocks per cell
    cols = Math.floor(width / cell);
    rows = Math.ceil(n / per / cols);
    if (rows * cell <= MAP_MAX_HEIGHT) break;
    if (cell > 2) cell--; else per *= 2;  // cells stay two pixels or more, to hover
  }
  const height = Math.max(cell, rows * cell);
  canvas.width = width; canvas.height = height;
  canvas.style.height = height + "px";
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(width, height);
  const px = new Uint32Array(image.data.buffer);
  const gap = cell >= 4 ? 1 : 0;
  const cells = Math.ceil(n / per);
  for (let c = 0; c < cells; c++) {
    let index = c * per;
    if (per > 1) {  // the cell shows its busiest block: shared > used > cached > free
      let best = -1;
      for (let i = c * per; i < Math.min(n, (c + 1) * per); i++) {
        const s = dash.blocks.states[i] & 3;
        if (s > best) { best = s; index = i; }
      }
    }
    const [r, g, b] = colourOf(index);
    const rgba = (255 << 24) | (b << 16) | (g << 8) | r;
    const x0 = (c % cols) * cell, y0 = Math.floor(c / cols) * cell;
    for (let y = y0; y < y0 + cell - gap; y++) px.fill(rgba, y * width + x0, y * width + x0 + cell - gap);
  }
  ctx.putImageData(image, 0, 0);
  layout = { cell, per, cols, n };
  dash.layout = layout;
}

function cellCentre(index) {  // page coordinates of block index `index`'s cell
  const rect = $("blockmap").getBoundingClientRect();
  const c = Math.floor(index / layout.per);
  return { x: rect.left + (c % layout.cols + 0.5) * layout.cell, y: rect.top + (Math.floor(c / layout.cols) + 0.5) * layout.cell };
}

function blockInfo(index) {
  const id = index + dash.blocks.first;
  const s = dash.blocks.states[index];
  const o = dash.owners.get(id);
  const cachedTokens = (s & 3) === 1 ? dash.state.block_size : 0;
  return [
    `block ${id}: ${STATES[s & 3]}`,
    `ref-count ${dash.blocks.refs[index]}`,
    `tokens ${o ? o.tokens : cachedTokens} / ${dash.state.block_size}`,
    `prefix-cache block: ${(s & PUBLISHED_BIT) ? "yes" : "no"}`,
    `requests: ${!o ? "none" : o.ids.slice(0, 4).join(", ") + (o.ids.length > 4 ? ` and ${o.ids.length - 4} more` : "")}`,
  ].join("\n");
}

function onHover(event) {
  const tip = $("tooltip");
  if (!layout || !dash.blocks) { tip.hidden = true; return; }
  const rect = event.target.getBoundingClientRect();
  const x = Math.floor((event.clientX - rect.left) / layout.cell);
  const y = Math.floor((event.clientY - rect.top) / layout.cell);
  const c = y * layout.cols + x;
  if (x >= layout.cols || c * layout.per >= layout.n) { tip.hidden = true; return; }
  let text;
  if (layout.per === 1) {
    text = blockInfo(c);
  } else {
    const lo = c * layout.per, hi = Math.min(layout.n, lo + layout.per);
    const counts = [0, 0, 0, 0];
    for (let i = lo; i < hi; i++) counts[dash.blocks.states[i] & 3]++;
    text = `blocks ${lo + dash.blocks.first}–${hi - 1 + dash.blocks.first}\n` +
      STATES.map((s, i) => `${s} ${counts[i]}`).join(", ");
  }
  tip.textContent = text;
  tip.style.left = (event.clientX - rect.left + 14) + "px";
  tip.style.top = (event.clientY - rect.top + 14) + "px";
  tip.hidden = false;
}

// ------------------------------------------------------------------ time series

const SERIES = [
  { title: "KV usage (%)", keys: [["usage", "in use"]] },
  { title: "Requests", keys: [["running", "running"], ["waiting", "waiting"], ["preempt", "preemptions/s"]] },
  { title: "Tokens/s", keys: [["prompt", "prompt"], ["gen", "generation"]] },
  { title: "Prefix-cache hit rate (%, last 30 s)", keys: [["hit", "hit rate"]] },
];
const LINE_COLOURS = ["#1f77b4", "#ff7f0e", "#d62728", "#2ca02c"];

function makeCharts() {
  const grid = $("chart-grid");
  const width = Math.max(380, Math.floor(grid.clientWidth / 2) - 12);
  return SERIES.map((spec) => {
    const box = document.createElement("div");
    box.className = "chart";
    box.innerHTML = "<h3></h3>";
    box.firstChild.textContent = spec.title;
    grid.appendChild(box);
    const opts = {
      width, height: 150, legend: { show: true },
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } },
      series: [{}, ...spec.keys.map(([, label], i) => ({ label, stroke: LINE_COLOURS[i], width: 1.5, spanGaps: true }))],
      axes: [{}, { size: 50 }],
    };
    return { spec, plot: new uPlot(opts, [[], ...spec.keys.map(() => [])], box) };
  });
}

function record(state) {
  const t = state.time, tot = state.totals, c = dash.counts, n = state.pool.num_blocks;
  const point = { t, tot };
  let rate = (key) => null;
  if (lastPoint && t > lastPoint.t) {
    const dt = t - lastPoint.t, prev = lastPoint.tot;
    rate = (key) => (tot[key] - prev[key]) / dt;
  }
  while (totals.length && totals[0].t < t - HIT_WINDOW_S) totals.shift();
  const base = totals.length ? totals[0].tot : tot;
  totals.push(point);
  const queries = tot.prefix_cache_queries - base.prefix_cache_queries;
  const hits = tot.prefix_cache_hits - base.prefix_cache_hits;
  const running = state.requests.filter((r) => r.status === "running").length;
  history.t.push(t);
  history.usage.push(100 * (c.used + c.shared) / n);
  history.running.push(running);
  history.waiting.push(state.requests.length - running);
  history.preempt.push(rate("preemptions"));
  history.hit.push(queries > 0 ? 100 * hits / queries : null);
  history.prompt.push(rate("prompt_tokens"));
  history.gen.push(rate("generation_tokens"));
  while (history.t.length && history.t[0] < t - HISTORY_S) for (const k in history) history[k].shift();
  lastPoint = point;
  if (!charts) charts = makeCharts();
  for (const { spec, plot } of charts) plot.setData([history.t, ...spec.keys.map(([k]) => history[k])]);
}

// ------------------------------------------------------------------ request table

function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}

function drawRequests(state) {
  const rows = state.requests.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.requestId = r.id;
    const swatch = document.createElement("td");
    if (r.status === "running") {
      const chip = document.createElement("span");
      chip.className = "chip";
      const [red, g, b] = hsl(hueOf(r.id), 55, 52);
      chip.style.background = `rgb(${red},${g},${b})`;
      swatch.appendChild(chip);
    }
    tr.append(swatch, cell(r.id), cell(r.status), cell(r.prompt_tokens), cell(r.output_tokens),
      cell(r.cached_tokens), cell(r.kv_tokens), cell(r.num_blocks), cell(r.shared_blocks),
      cell(r.kv_cache_dtype), cell(r.eviction || "–"), cell(r.evicted_tokens), cell(r.preemptions));
    tr.children[7].className = "blocks";
    tr.children[8].className = "shared";
    return tr;
  });
  $("request-rows").replaceChildren(...rows);
  const running = state.requests.filter((r) => r.status === "running").length;
  $("request-summary").textContent = `${running} running, ${state.requests.length - running} waiting`;
}

// ------------------------------------------------------------------ status line

function showStep() {
  const s = dash.state;
  if (!s) return;
  const age = s.age_s + (performance.now() - shownAt) / 1000;
  let text = `step ${s.step}, ${age.toFixed(1)} s ago`;
  if (s.engine.step_running_s !== null && s.engine.step_running_s > 1)
    text += ` (step ${s.engine.steps_completed + 1} running for ${s.engine.step_running_s.toFixed(1)} s)`;
  $("step").textContent = text;
}

// ------------------------------------------------------------------ polling

function askForKey(message) {
  $("main").hidden = true;
  $("key-form").hidden = false;
  $("key-message").textContent = message;
  $("step").textContent = "";
}

async function refresh() {
  dash.polls++;
  let response;
  try {
    response = await fetch("dashboard/state", {
      cache: "no-store", headers: apiKey ? { Authorization: "Bearer " + apiKey } : {},
    });
  } catch (e) {
    $("error").textContent = "server unreachable";
    return null;
  }
  if (response.status === 401) {
    askForKey(apiKey ? "That key was refused." : "");
    return null;
  }
  if (!response.ok) {
    let message = `HTTP ${response.status}`;
    try { message = (await response.json()).error.message; } catch (e) { /* not JSON */ }
    $("error").textContent = message;
    return null;
  }
  const state = await response.json();
  $("error").textContent = "";
  // Two polls in flight (the timer's and a caller's) can answer out of order: never draw an older
  // snapshot over a newer one. A restarted server counts steps from 0 again but later in time.
  const shown = dash.state;
  if (shown && state.step <= shown.step && state.time < shown.time) return shown;
  const fresh = !dash.state || state.step !== dash.state.step || state.time !== dash.state.time;
  Object.assign(dash, decode(state), { state });
  shownAt = performance.now();
  $("key-form").hidden = true;
  $("main").hidden = false;
  $("model").textContent = `${state.model} · ${state.kv_cache_dtype} KV · block size ${state.block_size}`;
  for (const s of STATES) $("count-" + s).textContent = dash.counts[s];
  $("pool-summary").textContent = `${state.pool.num_blocks} blocks`;
  drawMap();
  drawRequests(state);
  if (fresh) record(state);
  showStep();
  return state;
}

async function loop() {
  await refresh();
  setTimeout(loop, POLL_MS);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = $("key").value.trim();
  sessionStorage.setItem(KEY_STORE, apiKey);
  refresh();
});
$("blockmap").addEventListener("mousemove", onHover);
$("blockmap").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
setInterval(showStep, 100);
loop();
