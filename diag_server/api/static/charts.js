// traindx dashboard charts, all on uPlot: lines (with a legend that keeps to the top few), a heat map and
// distribution bands (uPlot's own bands between series). Every run-page chart shares one step axis and
// one cursor, so a mark on the timeline sits under the spike that caused it.
"use strict";

const PALETTE = ["#2f6fde", "#e8590c", "#2e7d32", "#8e24aa", "#c62828", "#00838f", "#6d4c41", "#ad1457",
                 "#5c6bc0", "#9e9d24", "#37474f", "#f9a825"];
const AXIS = 96; // every chart's y axis takes the same width, so the plot areas (and the step axis) line up; 96 px holds a 16-character label
const TOP_K = 6; // lines a chart draws and lists before "show all": more is a tangle, not a chart
const SYNC = "traindx";

function chartWidth(target) {
  const box = $(target).parentElement;
  return Math.max(280, box.clientWidth - 18);
}

// Axis labels that stay readable from 1e-6 (update ratios, log scales) to 1e6 (a diverged loss).
const tick = (v) => v === null ? "" : v === 0 ? "0" : (Math.abs(v) >= 1e-2 && Math.abs(v) < 1e5)
  ? String(+v.toPrecision(3)) : v.toExponential(0);

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

function peak(s) {
  let best = -Infinity;
  for (const p of s.points) if (p.value !== null && p.value > best) best = p.value;
  return best;
}

// A line chart. With more than TOP_K series only the TOP_K with the highest peak are drawn and listed, and
// a button (opts.more) offers the rest; state.showAll[name] remembers the choice.
function lineChart(name, target, seriesList, { log = false, height = 190, xRange = null, more = null } = {}) {
  state.showAll = state.showAll || {};
  let shown = seriesList;
  if (more) {
    const cut = seriesList.length > TOP_K && !state.showAll[name];
    if (cut) {
      const keep = new Set([...seriesList].sort((a, b) => peak(b) - peak(a)).slice(0, TOP_K));
      shown = seriesList.filter((s) => keep.has(s)); // forward order kept
    }
    const button = $(more);
    button.hidden = seriesList.length <= TOP_K;
    button.textContent = cut ? `top ${TOP_K} of ${seriesList.length} by peak · show all` : `show top ${TOP_K} only`;
    button.onclick = () => { state.showAll[name] = !state.showAll[name]; lineChart(name, target, seriesList,
      { log, height, xRange, more }); };
  }
  const transform = log ? (v) => (v !== null && v > 0 ? v : null) : (v) => v;
  const data = align(shown, transform);
  const labels = shown.map((s) => s.name).join("|") + (log ? "|log" : "");
  let chart = state.charts[name];
  if (chart && chart.labels === labels) {
    chart.setData(data);
  } else {
    if (chart) chart.destroy();
    const opts = {
      width: chartWidth(target), height,
      cursor: { sync: { key: SYNC } },
      legend: { live: true },
      scales: { x: { time: false, range: xRange || (() => [0, state.maxStep]) }, y: log ? { distr: 3 } : {} },
      series: [{ label: "step" }, ...shown.map((s, i) => ({
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
  $(target).dataset.shown = String(shown.length);
  return chart;
}

function colour(t) { // 0..1 -> a viridis-like ramp (dark blue -> green -> yellow)
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const x = Math.min(Math.max(t, 0), 1) * (stops.length - 1), i = Math.min(Math.floor(x), stops.length - 2), f = x - i;
  const c = stops[i].map((a, k) => Math.round(a + (stops[i + 1][k] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// -- the heat map ---------------------------------------------------------------------------------------
// Rows of a 100-layer model do not fit as rows of labels: they are grouped. A tensor's layer is its name up
// to the first numeric part ("layers.17" of "layers.17.attn.q_proj.weight", "3" of "3.bias"), else its
// module ("encoder.norm" of "encoder.norm.weight"); blocks join neighbouring layers. A grouped cell shows
// its largest member (a spike in one tensor still shows), and hovering names that member.
const HEAT_MAX_ROWS = 40;

function layerOf(name) {
  const parts = name.split(".");
  const i = parts.findIndex((p) => /^\d+$/.test(p));
  if (i >= 0) return parts.slice(0, i + 1).join(".");
  return parts.length > 1 ? parts.slice(0, -1).join(".") : name;
}

function groupRows(tensors, level) {
  const single = tensors.map((t, i) => ({ label: t, members: [i] }));
  if (level === "tensor") return single;
  const layers = [];
  const at = new Map();
  tensors.forEach((t, i) => {
    const key = layerOf(t);
    if (!at.has(key)) { at.set(key, layers.length); layers.push({ label: key, members: [] }); }
    layers[at.get(key)].members.push(i);
  });
  if (level === "layer") return layers;
  const size = Math.ceil(layers.length / HEAT_MAX_ROWS);
  if (size <= 1) return layers;
  const blocks = [];
  for (let i = 0; i < layers.length; i += size) {
    const part = layers.slice(i, i + size);
    blocks.push({ label: part.length > 1 ? `${part[0].label} … ${part[part.length - 1].label}` : part[0].label,
                  members: part.flatMap((l) => l.members) });
  }
  return blocks;
}

function heatLevel(tensors, chosen) {
  if (chosen !== "auto") return chosen;
  if (tensors.length <= HEAT_MAX_ROWS) return "tensor";
  const layers = new Set(tensors.map(layerOf)).size;
  return layers <= HEAT_MAX_ROWS ? "layer" : "block";
}

// Middle-cut labels keep both ends of a long name: "encoder.layer.11.attention.output.dense.weight" ->
// "encoder.la…dense.weight".
function shorten(label, chars) {
  if (label.length <= chars) return label;
  const head = Math.ceil((chars - 1) * 0.4), tail = chars - 1 - head;
  return label.slice(0, head) + "…" + label.slice(label.length - tail);
}

function heatmap(target, hm, { level = "auto", onPick = null } = {}) {
  const chosen = heatLevel(hm.tensors, level);
  const rows = groupRows(hm.tensors, chosen);
  // each row's cells: the largest member, and which member that was
  const cells = rows.map((r) => hm.steps.map((_, j) => {
    let best = undefined, who = r.members[0];
    for (const i of r.members) {
      const v = hm.values[i][j];
      if (v === null) { best = null; who = i; break; } // NaN/Inf wins: it is what a person looks for
      if (v !== undefined && (best === undefined || v > best)) { best = v; who = i; }
    }
    return [best === undefined ? undefined : best, who];
  }));
  let lo = Infinity, hi = -Infinity;
  for (const row of cells) for (const [v] of row) if (v !== null && v !== undefined && v > 0) {
    const l = Math.log10(v); if (l < lo) lo = l; if (l > hi) hi = l;
  }
  const rowH = Math.max(3, Math.min(16, Math.floor(300 / Math.max(rows.length, 1))));
  const plotH = Math.max(rows.length * rowH, 24);
  const labelEvery = Math.max(1, Math.ceil(11 / rowH)); // a 10px label needs ~11px
  const ends = hm.steps.map((s, j) => j + 1 < hm.steps.length ? hm.steps[j + 1] : Math.max(state.maxStep, s + 1));
  const draw = (u) => {
    const g = u.ctx, { left, top, width, height } = u.bbox;
    g.save();
    g.beginPath(); g.rect(left, top, width, height); g.clip();
    const h = height / rows.length;
    cells.forEach((row, i) => {
      const y0 = top + i * h;
      row.forEach(([v], j) => {
        if (v === undefined) return;
        const x0 = u.valToPos(hm.steps[j], "x", true), x1 = u.valToPos(ends[j], "x", true);
        g.fillStyle = v === null ? "#c62828" : colour(hi > lo ? (Math.log10(Math.max(v, 1e-30)) - lo) / (hi - lo) : 0.5);
        g.fillRect(x0, y0, Math.max(x1 - x0, 1), Math.max(h - (h > 4 ? 1 : 0), 1));
      });
    });
    g.restore();
  };
  const key = `${chosen}|${rows.length}|${rows.map((r) => r.label).join("|")}`;
  const data = [hm.steps.length ? hm.steps : [0], (hm.steps.length ? hm.steps : [0]).map(() => null)];
  let chart = state.charts.heat;
  const tip = $("#heat-tip");
  const rowAt = (u) => Math.floor((u.cursor.top / (u.bbox.height / devicePixelRatio)) * rows.length);
  const colAt = (u) => {
    const x = u.posToVal(u.cursor.left, "x");
    let j = -1;
    for (let k = 0; k < hm.steps.length && hm.steps[k] <= x; k++) j = k;
    return j;
  };
  if (chart && chart.key === key) {
    chart.heat = { draw };
    chart.setData(data);
  } else {
    if (chart) chart.destroy();
    const labels = rows.map((r) => r.label);
    chart = new uPlot({
      width: chartWidth(target), height: plotH + 30, legend: { show: false },
      cursor: { sync: { key: SYNC }, y: false, points: { show: false } },
      scales: { x: { time: false, range: () => [0, state.maxStep] }, y: { range: [0, rows.length] } },
      series: [{}, { label: "", stroke: "transparent", paths: () => null, points: { show: false } }],
      axes: [{ show: false },
             { size: AXIS, gap: 2, font: "10px system-ui", stroke: "#6b7683", grid: { show: false }, ticks: { show: false },
               splits: () => labels.map((_, i) => rows.length - i - 0.5).filter((_, i) => i % labelEvery === 0),
               values: (u, splits) => splits.map((v) => shorten(labels[Math.round(rows.length - v - 0.5)] || "", 16)) }],
      hooks: {
        draw: [(u) => u.heat.draw(u)],
        setCursor: [(u) => {
          const i = rowAt(u), j = colAt(u);
          if (u.cursor.left < 0 || i < 0 || i >= rows.length || j < 0) return;
          const [v, who] = cells[i][j];
          const r = rows[i];
          const what = r.members.length > 1 ? `${r.label} (${r.members.length} tensors; largest: ${hm.tensors[who]})`
            : hm.tensors[who];
          tip.textContent = `${what} · steps ${hm.steps[j]}–${ends[j] - 1}: ${v === undefined ? "not sampled" : fmt(v)}`;
          tip.dataset.tensor = hm.tensors[who];
        }],
      },
    }, data, $(target));
    chart.key = key;
    chart.heat = { draw };
    chart.over.addEventListener("click", () => { if (onPick && tip.dataset.tensor) onPick(tip.dataset.tensor); });
    chart.over.title = "";
    state.charts.heat = chart;
  }
  const box = $(target);
  box.dataset.rows = String(rows.length);
  box.dataset.tensors = String(hm.tensors.length);
  box.dataset.level = chosen;
  box.dataset.columns = String(hm.steps.length);
  return chart;
}

// -- distributions ---------------------------------------------------------------------------------------
// TensorBoard's distributions chart: nested bands between quantiles, the outermost between the exact min
// and max, the median as a line. levels are the Distribution's (7: ~7%, 16%, 31%, 50%, 69%, 84%, 93%).
function distributionChart(target, d) {
  const steps = d.points.map((p) => p.step);
  const withQ = d.points.some((p) => p.quantiles.length);
  const col = (f) => d.points.map(f);
  const series = [{ label: "step" }];
  const data = [steps];
  const add = (label, values, style) => { series.push({ label, spanGaps: true, points: { show: false }, ...style,
    value: (u, v) => v === null || v === undefined ? "–" : fmt(v) }); data.push(values); return data.length - 1; };
  const edge = { stroke: "rgba(47,111,222,0.35)", width: 1 };
  const iMax = add("max", col((p) => p.max), edge);
  const iMin = add("min", col((p) => p.min), edge);
  const bands = [{ series: [iMax, iMin], fill: "rgba(47,111,222,0.10)" }];
  if (withQ) {
    const q = (k) => col((p) => p.quantiles.length ? p.quantiles[k] : null);
    const pct = (k) => `${Math.round(d.levels[k] * 100)}%`;
    const n = d.levels.length, mid = Math.floor(n / 2);
    const shades = [0.16, 0.24, 0.34];
    for (let k = 0; k < mid; k++) {
      const hiI = add(pct(n - 1 - k), q(n - 1 - k), { stroke: "transparent", width: 0 });
      const loI = add(pct(k), q(k), { stroke: "transparent", width: 0 });
      bands.push({ series: [hiI, loI], fill: `rgba(47,111,222,${shades[Math.min(k, shades.length - 1)]})` });
    }
    add("median", q(mid), { stroke: "#1d3f8f", width: 1.5 });
  } else {
    add("mean", col((p) => p.mean), { stroke: "#1d3f8f", width: 1.5 });
  }
  const key = `${withQ}|${series.length}`;
  let chart = state.charts.dist;
  if (chart && chart.key === key) chart.setData(data);
  else {
    if (chart) chart.destroy();
    chart = new uPlot({
      width: chartWidth(target), height: 190, bands, legend: { live: true },
      cursor: { sync: { key: SYNC } },
      scales: { x: { time: false, range: () => [0, state.maxStep] } },
      series, axes: [{ label: "step" }, { size: AXIS, values: (u, splits) => splits.map(tick) }],
    }, data, $(target));
    chart.key = key;
    state.charts.dist = chart;
  }
  $(target).dataset.points = String(steps.length);
  $(target).dataset.quantiles = String(withQ);
  return chart;
}

// -- the timeline -----------------------------------------------------------------------------------------
function timelineChart(target, entries) {
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
      cursor: { sync: { key: SYNC } },
      scales: { x: { time: false, range: () => [0, state.maxStep] }, y: { range: [0.5, 3.5] } },
      series: [{}, { label: "anomalies", paths: () => null, points: dot("#c62828") },
               { label: "fixes", paths: () => null, points: dot("#2f6fde") },
               { label: "verdicts", paths: () => null, points: dot("#2e7d32") }],
      axes: [{}, { size: AXIS, splits: () => [1, 2, 3], values: (u, s) => s.map((v) => ({ 1: "verdict", 2: "fix", 3: "anomaly" })[v] || "") }],
    }, data, $(target));
    state.charts.timeline = chart;
  }
  $(target).dataset.points = String(entries.length);
  return chart;
}

// Charts follow their box's width (a window resized, a print page).
function resizeCharts(width = null) {
  for (const [name, c] of Object.entries(state.charts)) {
    const box = c.root.parentElement;
    if (!box) continue;
    c.setSize({ width: width || Math.max(280, box.parentElement.clientWidth - 18), height: c.height });
  }
}

Object.assign(state, { PALETTE, AXIS, SYNC, tick, lineChart, heatmap, distributionChart, timelineChart, resizeCharts,
                       layerOf, groupRows, shorten, chartWidth });
