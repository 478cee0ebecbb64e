// traindx dashboard: a run list, and a run page whose charts, anomalies and timeline follow the run live.
// It reads the same /v1 routes as the CLI and the Python client, and redraws when
// /v1/runs/{run}/stream says the run's data changed. No build step: plain JS and the vendored uPlot.
"use strict";

const $ = (sel, el = document) => el.querySelector(sel);
const enc = encodeURIComponent;
const PALETTE = ["#2f6fde", "#e8590c", "#2e7d32", "#8e24aa", "#c62828", "#00838f", "#6d4c41", "#ad1457",
                 "#5c6bc0", "#9e9d24", "#37474f", "#f9a825"];
const AXIS = 72; // every chart's y axis takes the same width, so the plot areas (and the step axis) line up
const state = { run: null, maxStep: 1, charts: {}, selected: null, openapi: null, refreshing: false, again: false };
window.traindx = state; // for tests and the curious: the charts' data is at traindx.charts.<name>.data

// -- HTTP ---------------------------------------------------------------------------------------------
function actorName() { return ($("#actor").value || "").trim(); }

async function api(path, { method = "GET" } = {}) {
  const headers = { Accept: "application/json" };
  if (method !== "GET") {
    if (actorName()) headers["x-traindx-actor"] = "person:" + actorName();
    const token = localStorage.getItem("traindx.token");
    if (token) headers.Authorization = "Bearer " + token;
  }
  const res = await fetch(path, { method, headers });
  const body = await res.json().catch(() => ({ error: "bad_response", message: res.statusText }));
  if (!res.ok) {
    if (res.status === 401) $("#token-box").hidden = false;
    const err = new Error(`${body.error}: ${body.message}`);
    err.status = res.status;
    throw err;
  }
  return body;
}

function showError(err) {
  const el = $("#error");
  el.textContent = err ? String(err.message || err) : "";
  el.hidden = !err;
}

const fmt = (v) => v === null || v === undefined ? "NaN/Inf" :
  (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(4)) : String(v));
const el = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(k ?? ""));
  return e;
};
const badge = (text, cls) => el("span", { class: `badge ${cls}` }, text);

// -- run list -----------------------------------------------------------------------------------------
async function runList() {
  $("#runs-page").hidden = false;
  const draw = async () => {
    try {
      const { runs } = await api("/v1/runs?limit=500");
      const body = $("#runs tbody");
      body.replaceChildren(...runs.map((r) => el("tr", { "data-run": r.run },
        el("td", {}, el("a", { href: `/runs/${enc(r.run)}` }, r.run)), el("td", {}, badge(r.status, `st-${r.status}`)),
        el("td", {}, String(r.last_step)), el("td", {}, String(r.open_anomalies)), el("td", {}, r.device),
        el("td", {}, String(r.total_params)), el("td", {}, new Date(r.last_seen * 1000).toLocaleTimeString()))));
      $("#runs-empty").hidden = runs.length > 0;
      showError(null);
    } catch (e) { showError(e); }
  };
  await draw();
  setInterval(draw, 3000);
}

// -- charts -------------------------------------------------------------------------------------------
function align(seriesList, transform = (v) => v) {
  // uPlot wants one x array and y arrays aligned to it; series are sampled on different steps.
  const steps = [...new Set(seriesList.flatMap((s) => s.points.map((p) => p.step)))].sort((a, b) => a - b);
  const index = new Map(steps.map((s, i) => [s, i]));
  const ys = seriesList.map((s) => {
    const y = new Array(steps.length).fill(null);
    for (const p of s.points) y[index.get(p.step)] = transform(p.value);
    return y;
  });
  return [steps, ...ys];
}

// Axis labels that stay readable from 1e-6 (update ratios, log scales) to 1e6 (a diverged loss).
const tick = (v) => v === null ? "" : v === 0 ? "0" : (Math.abs(v) >= 1e-2 && Math.abs(v) < 1e5)
  ? String(+v.toPrecision(3)) : v.toExponential(0);

function chartWidth(id) { return Math.max(320, $(id).parentElement.clientWidth - 18); }

function lineChart(name, target, seriesList, { log = false, height = 190 } = {}) {
  const transform = log ? (v) => (v !== null && v > 0 ? v : null) : (v) => v;
  const data = align(seriesList, transform);
  const labels = seriesList.map((s) => s.name).join("|") + (log ? "|log" : "");
  let chart = state.charts[name];
  if (chart && chart.labels === labels) {
    chart.setData(data);
  } else {
    if (chart) chart.destroy();
    const opts = {
      width: chartWidth(target), height,
      cursor: { sync: { key: "traindx" } },
      scales: { x: { time: false, range: () => [0, state.maxStep] }, y: log ? { distr: 3 } : {} },
      series: [{ label: "step" }, ...seriesList.map((s, i) => ({
        label: s.name, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true,
        points: { show: (u) => u.data[0].length < 60 }, value: (u, v) => v === null ? "–" : fmt(v) }))],
      axes: [{ label: "step" }, { size: AXIS, values: (u, splits) => splits.map(tick) }],
    };
    chart = new uPlot(opts, data, $(target));
    chart.labels = labels;
    state.charts[name] = chart;
  }
  $(target).dataset.points = String(data[0].length);
  $(target).dataset.series = String(seriesList.length);
}

function colour(t) { // 0..1 -> a viridis-like ramp (dark blue -> green -> yellow)
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const x = Math.min(Math.max(t, 0), 1) * (stops.length - 1), i = Math.min(Math.floor(x), stops.length - 2), f = x - i;
  const c = stops[i].map((a, k) => Math.round(a + (stops[i + 1][k] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

function heatmap(target, hm) {
  // A canvas, not a charting library: uPlot draws lines, and a matrix of rectangles is a dozen lines here.
  const box = $(target), canvas = $("canvas", box), tip = $(".heat-tip", box);
  const ref = state.charts.loss;
  const left = ref ? ref.bbox.left / devicePixelRatio : AXIS, width = ref ? ref.bbox.width / devicePixelRatio
    : chartWidth(target) - AXIS - 10;
  const rowH = Math.max(8, Math.min(18, Math.floor(220 / Math.max(hm.tensors.length, 1))));
  const height = Math.max(hm.tensors.length * rowH, 20);
  const W = left + width + 10;
  canvas.width = W * devicePixelRatio; canvas.height = height * devicePixelRatio;
  canvas.style.width = W + "px"; canvas.style.height = height + "px";
  const g = canvas.getContext("2d");
  g.scale(devicePixelRatio, devicePixelRatio);
  g.clearRect(0, 0, W, height);
  const finite = hm.values.flat().filter((v) => v !== null && v > 0);
  const lo = Math.log10(Math.min(...finite, 1e-12)), hi = Math.log10(Math.max(...finite, 1e-12));
  const xOf = (step) => left + (step / Math.max(state.maxStep, 1)) * width;
  g.font = "10px system-ui"; g.textBaseline = "middle"; g.fillStyle = "#6b7683";
  hm.tensors.forEach((t, i) => {
    const label = t.length > 12 ? "…" + t.slice(-11) : t;
    g.fillStyle = "#6b7683"; g.fillText(label, 2, i * rowH + rowH / 2, left - 4);
    hm.steps.forEach((s, j) => {
      const v = hm.values[i][j];
      const x0 = xOf(s), x1 = j + 1 < hm.steps.length ? xOf(hm.steps[j + 1]) : xOf(Math.min(state.maxStep, s + 1)) + 2;
      g.fillStyle = v === null ? "#c62828" : colour(hi > lo ? (Math.log10(Math.max(v, 1e-12)) - lo) / (hi - lo) : 0.5);
      g.fillRect(x0, i * rowH, Math.max(x1 - x0, 1), rowH - 1);
    });
  });
  canvas.onmousemove = (ev) => {
    const r = canvas.getBoundingClientRect(), x = ev.clientX - r.left, i = Math.floor((ev.clientY - r.top) / rowH);
    let j = -1;
    for (let k = 0; k < hm.steps.length && xOf(hm.steps[k]) <= x; k++) j = k;
    if (i >= 0 && i < hm.tensors.length && j >= 0) tip.textContent = `${hm.tensors[i]} @ step ${hm.steps[j]}: ${fmt(hm.values[i][j])}`;
  };
  box.dataset.rows = String(hm.tensors.length);
  box.dataset.columns = String(hm.steps.length);
}

function timeline(target, entries) {
  const rows = { anomaly: 3, resolved: 3, fix: 2, verdict: 1 };
  const steps = [...new Set(entries.map((e) => e.step))].sort((a, b) => a - b);
  const index = new Map(steps.map((s, i) => [s, i]));
  const ys = [["anomaly", "resolved"], ["fix"], ["verdict"]].map((types) => {
    const y = new Array(steps.length).fill(null);
    for (const e of entries) if (types.includes(e.type)) y[index.get(e.step)] = rows[e.type];
    return y;
  });
  const data = [steps, ...ys];
  let chart = state.charts.timeline;
  if (chart) chart.setData(data);
  else {
    const dot = (c) => ({ show: true, size: 9, fill: c, stroke: c });
    chart = new uPlot({
      width: chartWidth(target), height: 110, legend: { show: false },
      cursor: { sync: { key: "traindx" } },
      scales: { x: { time: false, range: () => [0, state.maxStep] }, y: { range: [0.5, 3.5] } },
      series: [{}, { label: "anomalies", paths: () => null, points: dot("#c62828") },
               { label: "fixes", paths: () => null, points: dot("#2f6fde") },
               { label: "verdicts", paths: () => null, points: dot("#2e7d32") }],
      axes: [{}, { size: AXIS, splits: () => [1, 2, 3], values: (u, s) => s.map((v) => ({ 1: "verdict", 2: "fix", 3: "anomaly" })[v] || "") }],
    }, data, $(target));
    state.charts.timeline = chart;
  }
  $(target).dataset.points = String(entries.length);
  $("#timeline-list").replaceChildren(...entries.slice(-30).reverse().map((e) =>
    el("li", { "data-type": e.type, "data-ref": e.ref }, `step ${e.step} · ${e.type} · ${e.label}` +
      (e.actor && e.type === "fix" ? ` · by ${e.actor}` : ""))));
}

async function drawCharts() {
  const r = enc(state.run);
  const [scalars, sys, heat, updates, hist, tables] = await Promise.all([
    api(`/v1/runs/${r}/scalars?max_points=400`),
    api(`/v1/runs/${r}/scalars?prefix=sys/&max_points=400`),
    api(`/v1/runs/${r}/heatmap?collection=gradients&field=norm&max_steps=150`),
    api(`/v1/runs/${r}/stats?collection=updates&field=update_ratio&max_points=300`),
    api(`/v1/runs/${r}/history?limit=500`),
    api(`/v1/runs/${r}/embeddings?rows=5`),
  ]);
  const user = scalars.series.filter((s) => !s.name.startsWith("sys/") && !s.name.startsWith("lr/"));
  const phases = ["sys/data_wait", "sys/forward", "sys/backward", "sys/optimizer", "sys/step_time"];
  const time = phases.map((n) => sys.series.find((s) => s.name === n)).filter(Boolean);
  const memory = sys.series.filter((s) => s.name.endsWith("_mb"));
  // A loss spike flattens everything else on a linear axis: go logarithmic when every value allows it.
  // (Decided on the loss; another scalar's zeros are simply not drawn on a log axis.)
  const lossSeries = user.find((s) => s.name === "loss");
  const positive = !!lossSeries && lossSeries.points.some((p) => p.value > 0) &&
    lossSeries.points.every((p) => p.value === null || p.value > 0);
  lineChart("loss", "#chart-loss", user, { log: positive });
  heatmap("#chart-heat", heat);
  lineChart("updates", "#chart-updates", updates.series, { log: true });
  lineChart("time", "#chart-time", time);
  lineChart("memory", "#chart-memory", memory, { height: 150 });
  timeline("#chart-timeline", hist.entries);
  embeddingTables(tables.tables);
}

// The run's embedding tables as last reported (the embeddings collection): one row a table, the rows most
// like zombies, and those whose data has pulled them hardest over the run (a run score of at least 2 spreads,
// the report's floor: a healthy table's filler rows are left out). Hidden when the run reports none.
function embeddingTables(tables) {
  $("#embeddings tbody").replaceChildren(...tables.map((t) => {
    const s = t.summary;
    const worst = s.zombies.map((z) => `${z.row}: ${fmt(z.noise)}, ${fmt(z.consistency)}`).join(" · ");
    // past the floor of 2 (a probe before run_score, 2026-12-01, ranked and floored the list by run_noise)
    const conflicted = (s.conflicted || []).filter((c) => (c.run_score ?? c.run_noise ?? -Infinity) >= 2)
      .map((c) => `${c.row}: ${c.run_score == null ? "-" : fmt(c.run_score)}, ${fmt(c.run_noise)}`).join(" · ");
    const name = (t.rank ? `${t.name} (rank ${t.rank})` : t.name)
      + (s.tied_to.length ? ` · tied to ${s.tied_to.join(", ")}`
        : s.learns_outside_lookups ? " · learns outside its lookups" : "");
    return el("tr", { "data-table": t.name, "data-rank": String(t.rank) },
      ...[name, t.step, s.rows, s.touched_rows, s.never_updated,
          s.nonfinite_rows, s.median_touches, s.score_spread, s.effective_rank, s.mean_cosine, worst || "-",
          conflicted || "-"]
        .map((v) => el("td", {}, typeof v === "string" ? v : v === null ? "-" : fmt(v)))); // null: not measured
  }));
  $("#embeddings-panel").hidden = !tables.length;
}

// -- anomalies, evidence, diagnosis, fixes ------------------------------------------------------------
async function fillFilters() {
  try { state.openapi = await api("/openapi.json"); } catch (e) { state.openapi = { components: { schemas: {} } }; }
  const enums = state.openapi.components.schemas;
  const fill = (id, name) => {
    for (const v of (enums[name] || {}).enum || []) $(id).append(el("option", { value: v }, v));
  };
  fill("#f-kind", "AnomalyKind"); fill("#f-severity", "Severity"); fill("#f-status", "AnomalyStatus");
  $("#filters").addEventListener("input", () => drawAnomalies().catch(showError));
}

async function drawAnomalies() {
  const q = new URLSearchParams({ limit: "200" });
  for (const id of ["kind", "severity", "status"]) { const v = $(`#f-${id}`).value; if (v) q.set(id, v); }
  const ms = parseFloat($("#f-latency").value);
  if (ms >= 0) q.set("min_step_time", String(ms / 1000));
  const page = await api(`/v1/runs/${enc(state.run)}/anomalies?${q}`);
  $("#anomalies tbody").replaceChildren(...page.anomalies.map((a) => el("tr", {
    "data-id": a.id, "data-kind": a.kind, class: a.id === state.selected ? "selected" : "",
    onclick: () => openAnomaly(a.id) },
    el("td", {}, a.id), el("td", {}, a.kind), el("td", {}, badge(a.severity, `sev-${a.severity}`)),
    el("td", {}, a.status), el("td", {}, `${a.first_step}–${a.last_step}`), el("td", {}, a.message))));
  $("#anomalies-count").textContent = `${page.total} matching`;
}

function kv(obj) {
  return el("table", { class: "grid kv" }, el("tbody", {}, ...Object.entries(obj).map(([k, v]) =>
    el("tr", {}, el("td", {}, k), el("td", {}, Array.isArray(v) ? v.map(fmt).join(", ") : fmt(v))))));
}

async function fixAction(op, id) {
  const r = enc(state.run);
  const path = op === "propose" ? `/v1/runs/${r}/anomalies/${enc(id)}/propose` : `/v1/runs/${r}/fixes/${enc(id)}/${op}`;
  try { await api(path, { method: "POST" }); showError(null); } catch (e) { showError(e); }
  await openAnomaly(state.selected);
}

async function openAnomaly(id) {
  state.selected = id;
  for (const tr of document.querySelectorAll("#anomalies tbody tr")) tr.classList.toggle("selected", tr.dataset.id === id);
  const r = enc(state.run);
  const [a, diag, fixes] = await Promise.all([api(`/v1/runs/${r}/anomalies/${enc(id)}`), api(`/v1/runs/${r}/diagnosis`),
                                             api(`/v1/runs/${r}/fixes?anomaly_id=${enc(id)}&limit=100`)]);
  if (state.selected !== id) return;
  const cause = diag.causes.find((c) => c.anomaly_id === id);
  const parent = diag.causes.find((c) => c.consequences.includes(id));
  const why = cause ? `Root cause: ${cause.explanation}` : parent ?
    `A consequence of ${parent.anomaly_id} (${parent.kind}): ${parent.explanation}` : diag.summary;
  const canApply = (f) => f.live && ["proposed", "rejected", "failed", "expired", "reverted"].includes(f.status);
  const canRevert = (f) => ["applied", "effective", "ineffective", "pending"].includes(f.status);
  const rows = fixes.fixes.map((f) => el("tr", { "data-fix": f.id, "data-status": f.status },
    el("td", {}, f.id), el("td", {}, `${f.action} ${Object.entries(f.params).map(([k, v]) => `${k}=${fmt(v)}`).join(" ")}`),
    el("td", { class: "fix-status" }, badge(f.status, `st-${f.status}`)),
    el("td", {}, f.reason || f.rationale, Object.keys(f.before).length ?
      el("div", { class: "muted" }, `before ${JSON.stringify(f.before)} → after ${JSON.stringify(f.after)}`) : ""),
    el("td", {}, canApply(f) ? el("button", { class: "apply", onclick: () => fixAction("apply", f.id) }, "Apply") : "",
      canRevert(f) ? el("button", { class: "revert", onclick: () => fixAction("revert", f.id) },
        f.status === "pending" ? "Cancel" : "Revert") : "")));
  $("#detail").replaceChildren(
    el("h2", {}, `${a.id} · ${a.kind} `, badge(a.severity, `sev-${a.severity}`), " ", badge(a.status, "")),
    el("p", {}, a.message),
    el("p", { class: "muted" }, `steps ${a.first_step}–${a.last_step}` + (a.tensors.length ? ` · tensors: ${a.tensors.join(", ")}` : "") +
      ` · rule ${a.rule}`),
    el("h2", {}, "Evidence"), kv(a.evidence),
    el("h2", {}, "Diagnosis"), el("p", { class: "diagnosis" }, why),
    el("h2", {}, "Fixes ", el("button", { class: "propose", onclick: () => fixAction("propose", id) }, "Propose fixes")),
    rows.length ? el("table", { class: "grid", id: "fixes" }, el("tbody", {}, ...rows))
      : el("p", { class: "muted" }, "No fixes proposed yet."));
}

// -- the run page, kept live --------------------------------------------------------------------------
// What the probe (or the server, about the job) said that is not an anomaly: the probe degraded, a hook
// raised, the job died of an exception. The latest ones, newest last.
function drawMessages(summary) {
  const list = $("#run-messages");
  const items = summary.messages.map((m) => el("li", { class: `lvl-${m.level}`, "data-level": m.level },
    el("span", { class: "muted" }, `step ${m.step}${m.rank ? ` · rank ${m.rank}` : ""} · ${m.level} `), m.text));
  if (summary.messages_total > summary.messages.length)
    items.unshift(el("li", { class: "muted" }, `latest ${summary.messages.length} of ${summary.messages_total} messages`));
  list.replaceChildren(...items);
  list.hidden = !items.length;
}

async function refresh() {
  if (state.refreshing) { state.again = true; return; }
  state.refreshing = true;
  try {
    const summary = await api(`/v1/runs/${enc(state.run)}`);
    state.maxStep = Math.max(summary.run.last_step, 1);
    const st = $("#run-status");
    st.textContent = summary.run.status; st.className = `badge st-${summary.run.status}`;
    drawMessages(summary);
    await Promise.all([drawCharts(), drawAnomalies()]);
    if (state.selected) await openAnomaly(state.selected);
    showError(null);
  } catch (e) { showError(e); } finally {
    state.refreshing = false;
    if (state.again) { state.again = false; setTimeout(refresh, 0); }
  }
}

async function runPage(run) {
  state.run = run;
  $("#run-page").hidden = false;
  $("#run-name").textContent = run;
  $("#crumb").textContent = "/ " + run;
  document.title = `${run} · traindx`;
  await fillFilters();
  await refresh();
  const source = new EventSource(`/v1/runs/${enc(run)}/stream`);
  let timer = null;
  source.addEventListener("update", (ev) => {
    const d = JSON.parse(ev.data);
    state.updates = (state.updates || 0) + 1;
    $("#live").textContent = `live · step ${d.last_step}` + (d.ended ? " · ended" : "");
    clearTimeout(timer);
    timer = setTimeout(refresh, 150); // several commits in a burst make one redraw
  });
  source.onerror = () => { $("#live").textContent = "reconnecting…"; };
  addEventListener("resize", () => {
    for (const [name, c] of Object.entries(state.charts)) c.setSize({ width: chartWidth(`#chart-${name}`), height: c.height });
    refresh();
  });
}

function main() {
  const actor = $("#actor"), token = $("#token");
  actor.value = localStorage.getItem("traindx.actor") || "";
  actor.addEventListener("change", () => localStorage.setItem("traindx.actor", actor.value.trim()));
  token.value = localStorage.getItem("traindx.token") || "";
  $("#token-box").hidden = !token.value;
  token.addEventListener("change", () => localStorage.setItem("traindx.token", token.value.trim()));
  const m = location.pathname.match(/^\/runs\/(.+)$/);
  (m ? runPage(decodeURIComponent(m[1])) : runList()).catch(showError);
}

main();
