// The engine tab: the step records streamed from /ui/api/steps/stream (timeline, forward
// times, the latest-steps table, DP ranks, speculative decoding) and the snapshot polled from
// /ui/api/engine once a second (summary, KV cache grid, forward time by batch size). Everything
// is drawn as SVG or plain elements; nothing runs while the tab is hidden.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const KEEP_STEPS = 2000; // records the page holds (the server's ring may hold more)
const TIMELINE_STEPS = 160; // the most recent steps drawn in the timeline
const TABLE_ROWS = 40;
const MAX_GRID_CELLS = 4096; // a larger KV pool is drawn with several blocks per cell
const engineView = { steps: [], cursor: 0, missed: 0, stream: null, timer: null, drawQueued: false, snapshot: null };

// The palette lives in style.css; SVG attributes get plain colour values (var() is CSS only).
const palette = {};
function color(name) {
  if (!(name in palette)) palette[name] = getComputedStyle(document.documentElement).getPropertyValue("--" + name).trim();
  return palette[name];
}

function svgNode(name, attrs, parent) {
  const node = document.createElementNS(SVG, name);
  for (const key in attrs) node.setAttribute(key, attrs[key]);
  if (parent) parent.appendChild(node);
  return node;
}

function titled(node, text) {
  svgNode("title", {}, node).textContent = text;
  return node;
}

function fmt(x, digits) {
  return Number(x).toFixed(digits === undefined ? 1 : digits);
}

// ---- data ---------------------------------------------------------------------------------------

async function followSteps() {
  while (engineView.stream) {
    const controller = engineView.stream;
    try {
      const response = await api(`/ui/api/steps/stream?since=${engineView.cursor}`, { signal: controller.signal });
      if (!response.ok) throw new Error(await errorText(response));
      for await (const data of sseData(response)) {
        const reply = JSON.parse(data);
        engineView.cursor = reply.next;
        engineView.missed += reply.missed;
        engineView.steps.push(...reply.records);
        if (engineView.steps.length > KEEP_STEPS) engineView.steps.splice(0, engineView.steps.length - KEEP_STEPS);
        queueDraw();
      }
    } catch (err) {
      if (err.name === "AbortError" || err instanceof AuthError) return;
      $("#timeline-caption").textContent = "stream interrupted (" + err.message + "); retrying";
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

async function pollSnapshot() {
  try {
    const response = await api("/ui/api/engine");
    if (!response.ok) throw new Error(await errorText(response));
    engineView.snapshot = await response.json();
    drawSnapshot(engineView.snapshot);
  } catch (err) {
    if (!(err instanceof AuthError)) $("#engine-summary").textContent = "engine state unavailable: " + err.message;
  }
}

page.onTab.engine = (active) => {
  if (active && !engineView.stream) {
    engineView.stream = new AbortController();
    followSteps();
    pollSnapshot();
    engineView.timer = setInterval(pollSnapshot, 1000);
  } else if (!active && engineView.stream) {
    engineView.stream.abort();
    engineView.stream = null;
    clearInterval(engineView.timer);
  }
};

function queueDraw() {
  if (engineView.drawQueued) return;
  engineView.drawQueued = true;
  requestAnimationFrame(() => {
    engineView.drawQueued = false;
    drawTimeline();
    drawTable();
    drawRanks();
    drawSpec();
  });
}

// ---- the step timeline --------------------------------------------------------------------------

function stepTitle(r) {
  const graph = r.descriptor ? `${r.graph_mode} ${JSON.stringify(r.descriptor)}` : `${r.graph_mode} (eager)`;
  const lines = [
    `rank ${r.rank} step ${r.seq}${r.dummy ? " (dummy pass)" : ""}${r.failed ? " FAILED" : ""}`,
    `${r.num_reqs} requests (${r.num_prefills} prefilling): ${r.prefill_tokens} prefill + ${r.decode_tokens} decode tokens`,
    `graph: ${graph}`,
    `forward ${fmt(r.forward_ms, 2)} ms, step ${fmt(r.step_ms, 2)} ms`,
    `after: ${r.num_running} running, ${r.num_waiting} waiting; KV ${r.kv_used} used / ${r.kv_cached} cached / ${r.kv_free} free`,
  ];
  if (r.preempted) lines.push(`${r.preempted} preempted`);
  if (r.aborted) lines.push(`${r.aborted} aborted`);
  if (r.finished) lines.push(`${r.finished} finished`);
  if (r.spec_draft_tokens) lines.push(`drafts: ${r.spec_accepted_tokens}/${r.spec_draft_tokens} accepted`);
  return lines.join("\n");
}

function drawTimeline() {
  const svg = $("#timeline");
  svg.textContent = "";
  const steps = engineView.steps.slice(-TIMELINE_STEPS);
  const width = 1000, height = 220, top = 24, bottom = 4;
  const maxTokens = Math.max(1, ...steps.map((r) => r.prefill_tokens + r.decode_tokens));
  const barWidth = width / TIMELINE_STEPS;
  const scale = (height - top - bottom) / maxTokens;
  svgNode("text", { x: 4, y: 14, class: "axis", "font-size": 12, fill: "#6b7280" }, svg).textContent =
    `${maxTokens} tokens`;
  steps.forEach((r, i) => {
    const x = width - (steps.length - i) * barWidth;
    const g = titled(svgNode("g", { class: "step", "data-prefill": r.prefill_tokens, "data-decode": r.decode_tokens }, svg), stepTitle(r));
    const w = Math.max(1, barWidth - 1);
    let y = height - bottom;
    const decodeH = r.decode_tokens * scale, prefillH = r.prefill_tokens * scale;
    svgNode("rect", { x, y: top, width: w, height: height - top - bottom, fill: "transparent" }, g);
    if (r.dummy) svgNode("rect", { x, y: y - 3, width: w, height: 3, fill: color("dummy") }, g);
    if (decodeH) svgNode("rect", { x, y: (y -= decodeH), width: w, height: decodeH, fill: color("decode") }, g);
    if (prefillH) svgNode("rect", { x, y: (y -= prefillH), width: w, height: prefillH, fill: color("prefill") }, g);
    if (r.failed) svgNode("rect", { x, y: top, width: w, height: height - top - bottom, fill: "none", stroke: color("preempt") }, g);
    const cx = x + w / 2;
    if (r.preempted) svgNode("path", { d: `M${cx - 5} 20 L${cx + 5} 20 L${cx} 11 Z`, fill: color("preempt") }, g);
    if (r.aborted) svgNode("path", { d: `M${cx - 4} 3 L${cx + 4} 11 M${cx + 4} 3 L${cx - 4} 11`, stroke: color("abort"), "stroke-width": 2 }, g);
    if (r.finished) svgNode("circle", { cx, cy: Math.max(top + 3, y - 5), r: 2.5, fill: color("finish") }, g);
  });
  const total = engineView.cursor;
  $("#timeline-caption").textContent =
    `${total} steps recorded, the last ${steps.length} drawn (newest at the right)` +
    (engineView.missed ? `; ${engineView.missed} steps were pushed out of the server's ring before this page read them` : "");
  drawForward(steps);
}

function drawForward(steps) {
  const svg = $("#forward-chart");
  svg.textContent = "";
  if (!steps.length) return;
  const width = 1000, height = 90, pad = 8;
  const maxMs = Math.max(0.001, ...steps.map((r) => r.forward_ms));
  const barWidth = width / TIMELINE_STEPS;
  const points = steps.map((r, i) => {
    const x = width - (steps.length - i) * barWidth + barWidth / 2;
    return `${fmt(x, 1)},${fmt(height - pad - (r.forward_ms / maxMs) * (height - 2 * pad), 1)}`;
  });
  svgNode("polyline", { points: points.join(" "), fill: "none", stroke: color("forward"), "stroke-width": 1.5 }, svg);
  const last = steps[steps.length - 1];
  $("#forward-caption").textContent = `max ${fmt(maxMs, 2)} ms, latest ${fmt(last.forward_ms, 2)} ms`;
}

function drawTable() {
  const body = $("#steps-table tbody");
  body.textContent = "";
  for (const r of engineView.steps.slice(-TABLE_ROWS).reverse()) {
    const tr = document.createElement("tr");
    tr.dataset.prefill = r.prefill_tokens;
    tr.dataset.decode = r.decode_tokens;
    const events = [];
    if (r.preempted) events.push(`${r.preempted} preempted`);
    if (r.aborted) events.push(`${r.aborted} aborted`);
    if (r.finished) events.push(`${r.finished} finished`);
    if (r.dummy) events.push("dummy");
    if (r.failed) events.push("FAILED");
    const q = r.descriptor && r.descriptor.query_len > 1 ? ` q${r.descriptor.query_len}` : "";
    const graph = r.descriptor ? `${r.graph_mode} ${r.descriptor.num_tokens}${q}` : r.graph_mode;
    const cells = [r.rank, r.seq, r.num_reqs, r.prefill_tokens, r.decode_tokens, graph, fmt(r.forward_ms, 2),
      fmt(r.step_ms, 2), r.num_running, r.num_waiting, r.kv_used, events.join(", ")];
    for (const value of cells) {
      const td = document.createElement("td");
      td.textContent = value;
      tr.appendChild(td);
    }
    tr.title = stepTitle(r);
    body.appendChild(tr);
  }
}

// ---- ranks and speculative decoding (from the recorded steps) ----------------------------------

function drawRanks() {
  const box = $("#ranks");
  const totals = {};
  for (const r of engineView.steps) {
    const t = (totals[r.rank] = totals[r.rank] || { prefill: 0, decode: 0, steps: 0, dummy: 0 });
    t.prefill += r.prefill_tokens;
    t.decode += r.decode_tokens;
    t.steps += 1;
    if (r.dummy) t.dummy += 1;
  }
  const most = Math.max(1, ...Object.values(totals).map((t) => t.prefill + t.decode));
  box.textContent = "";
  for (const rank of Object.keys(totals).sort((a, b) => a - b)) {
    const t = totals[rank];
    const label = document.createElement("div");
    label.className = "small";
    label.textContent = `rank ${rank}: ${t.prefill} prefill + ${t.decode} decode tokens in ${t.steps} steps` +
      (t.dummy ? ` (${t.dummy} dummy passes)` : "");
    const bar = document.createElement("div");
    bar.className = "bar";
    for (const [part, fill] of [["prefill", color("prefill")], ["decode", color("decode")]]) {
      const span = document.createElement("span");
      span.style.width = `${(100 * t[part]) / most}%`;
      span.style.background = fill;
      bar.appendChild(span);
    }
    box.append(label, bar);
  }
  if (!box.childElementCount) box.textContent = "no steps recorded yet";
}

function drawSpec() {
  let drafts = 0, accepted = 0;
  for (const r of engineView.steps) {
    drafts += r.spec_draft_tokens;
    accepted += r.spec_accepted_tokens;
  }
  $("#spec").textContent = drafts
    ? `${accepted} of ${drafts} draft tokens accepted (${fmt((100 * accepted) / drafts)}%) over the recorded steps`
    : "off (no drafts verified in the recorded steps)";
}

// ---- the snapshot: summary, KV grid, forward time by batch size ---------------------------------

function drawSnapshot(s) {
  const summary = $("#engine-summary");
  summary.textContent = "";
  const aborts = s.ranks.reduce((n, r) => n + (r.finished_reasons.abort || 0), 0);
  const preemptions = s.ranks.reduce((n, r) => n + r.num_preemptions_total, 0);
  const cards = [["running", s.num_running, "num-running"], ["waiting", s.num_waiting, "num-waiting"],
    ["KV cache used", `${fmt(100 * s.kv_cache_usage)}%`, "kv-usage"], ["preemptions", preemptions, "preemptions"],
    ["aborted", aborts, "aborts"], ["steps recorded", engineView.cursor, "steps-total"]];
  for (const [name, value, id] of cards) {
    const card = document.createElement("div");
    card.className = "card";
    card.innerHTML = '<div class="muted small"></div><div class="value"></div>';
    card.firstChild.textContent = name;
    card.lastChild.textContent = value;
    card.lastChild.id = "summary-" + id;
    summary.appendChild(card);
  }
  drawKV(s.ranks);
  drawBatchPlot(s.forward_times);
}

function drawKV(ranks) {
  const box = $("#kv-grids");
  box.textContent = "";
  for (const rank of ranks) {
    const states = rank.kv_blocks;
    const n = states.length;
    const per = Math.max(1, Math.ceil(n / MAX_GRID_CELLS));
    const cells = Math.ceil(n / per);
    const cols = Math.min(64, Math.max(1, cells));
    const rows = Math.ceil(cells / cols);
    const size = 10;
    const counts = { 0: 0, 1: 0, 2: 0 };
    for (const c of states) counts[c] += 1;
    const caption = document.createElement("div");
    caption.className = "small";
    caption.textContent = `rank ${rank.rank}: ${counts[2]} in use, ${counts[1]} cached, ${counts[0]} free of ${n} blocks` +
      (per > 1 ? ` (a cell is ${per} blocks, coloured by the busiest)` : "");
    const svg = svgNode("svg", { viewBox: `0 0 ${cols * size} ${rows * size}`, class: "kv-grid" });
    svg.style.maxWidth = `${cols * size * 1.2}px`;
    const colors = [color("kv-free"), color("kv-cached"), color("kv-used")];
    for (let cell = 0; cell < cells; cell++) {
      let state = 0;
      for (let b = cell * per; b < Math.min(n, (cell + 1) * per); b++) state = Math.max(state, states.charCodeAt(b) - 48);
      svgNode("rect", { x: (cell % cols) * size, y: Math.floor(cell / cols) * size, width: size - 1, height: size - 1,
        fill: colors[state], "data-state": state }, svg);
    }
    box.append(caption, svg);
  }
}

function drawBatchPlot(table) {
  const svg = $("#batch-plot");
  svg.textContent = "";
  const width = 500, height = 220, left = 44, bottom = 30, top = 10, right = 10;
  if (!table.length) {
    svgNode("text", { x: width / 2, y: height / 2, "text-anchor": "middle", fill: "#6b7280", "font-size": 13 }, svg)
      .textContent = "no forward passes timed yet";
    return;
  }
  const maxSize = Math.max(...table.map((row) => row[0]));
  const maxMs = Math.max(0.001, ...table.map((row) => row[2]));
  const x = (size) => left + (Math.log2(size) / Math.max(1, Math.log2(maxSize))) * (width - left - right);
  const y = (ms) => height - bottom - (ms / maxMs) * (height - top - bottom);
  const axis = { stroke: "#9ca3af", "stroke-width": 1 };
  svgNode("line", Object.assign({ x1: left, y1: height - bottom, x2: width - right, y2: height - bottom }, axis), svg);
  svgNode("line", Object.assign({ x1: left, y1: top, x2: left, y2: height - bottom }, axis), svg);
  const label = (attrs, text) => (svgNode("text", Object.assign({ fill: "#6b7280", "font-size": 11 }, attrs), svg).textContent = text);
  label({ x: left - 4, y: top + 8, "text-anchor": "end" }, fmt(maxMs, 1));
  label({ x: left - 4, y: height - bottom, "text-anchor": "end" }, "0");
  label({ x: left, y: height - 8 }, "1");
  label({ x: width - right, y: height - 8, "text-anchor": "end" }, `${maxSize} tokens in the pass (log scale)`);
  label({ x: left + 4, y: top + 8 }, "median ms");
  const maxPasses = Math.max(...table.map((row) => row[1]));
  for (const [size, passes, ms] of table) {
    const radius = 2 + 4 * Math.sqrt(passes / maxPasses);
    titled(svgNode("circle", { cx: x(size), cy: y(ms), r: radius, fill: color("forward"), "fill-opacity": 0.6 }, svg),
      `${size} tokens: ${passes} passes, median ${fmt(ms, 2)} ms`);
  }
}
