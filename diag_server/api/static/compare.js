// traindx dashboard: several runs side by side (/compare?run=a&run=b): one metric overlaid, aligned by step
// or by time since each run began; each run's anomalies and fixes on the same axis; where their configs differ.
"use strict";

const MARK_SHAPES = { anomaly: "▲", resolved: "▽", fix: "●", verdict: "◆" };

// A mark's x when runs are aligned by time: the seconds at its step, read off the run's own points (the
// job's clock, as the metric's), else the mark's own time since the run began.
function secondsAt(run, step, time) {
  const pts = run.points;
  if (!pts.length) return time - run.started_at;
  let i = 0;
  while (i + 1 < pts.length && pts[i + 1].step <= step) i++;
  const a = pts[i], b = pts[Math.min(i + 1, pts.length - 1)];
  if (b.step === a.step || step <= a.step) return a.seconds;
  return a.seconds + (b.seconds - a.seconds) * Math.min(1, (step - a.step) / (b.step - a.step));
}

function compareCharts(cmp, align) {
  const byTime = align === "time";
  const xOf = (p) => byTime ? p.seconds : p.step;
  const xs = [...new Set(cmp.runs.flatMap((r) => r.points.map(xOf)))].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  const ys = cmp.runs.map((r) => {
    const y = new Array(xs.length).fill(null);
    for (const p of r.points) y[index.get(xOf(p))] = p.value;
    return y;
  });
  const marks = cmp.runs.flatMap((r, i) => r.marks.map((m) => ({ run: i, m,
    x: byTime ? secondsAt(r, m.step, m.time) : m.step })));
  const hi = Math.max(1, ...xs, ...marks.map((k) => k.x));
  const range = () => [0, hi];
  const xLabel = byTime ? "seconds since the run began" : "step";
  const values = ys.flat().filter((v) => v !== null);
  const log = values.length > 0 && values.every((v) => v > 0) && cmp.metric !== "accuracy";
  const data = [xs.length ? xs : [0], ...(xs.length ? ys : ys.map(() => [null]))];
  if (state.charts.compare) state.charts.compare.destroy();
  state.charts.compare = new uPlot({
    width: chartWidth("#chart-compare"), height: 260, cursor: { sync: { key: "compare" } },
    scales: { x: { time: false, range }, y: log ? { distr: 3 } : {} },
    series: [{ label: xLabel, value: (u, v) => v === null ? "–" : fmt(v) }, ...cmp.runs.map((r, i) => ({
      label: r.run.run, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true,
      points: { show: (u) => u.data[0].length < 60 }, value: (u, v) => v === null ? "–" : fmt(v) }))],
    axes: [{ label: xLabel }, { size: AXIS, values: (u, splits) => splits.map(tick) }],
  }, data, $("#chart-compare"));
  $("#chart-compare").dataset.series = String(cmp.runs.length);
  $("#chart-compare").dataset.points = String(xs.length);
  $("#compare-chart-title").textContent = `${cmp.metric}${log ? " (log scale)" : ""} by ${byTime ? "time" : "step"}`;

  // Marks: a row per run, a shape per kind, the run's colour; drawn inside uPlot's scales and cursor.
  const n = cmp.runs.length;
  const tip = $("#compare-tip") || $("#panel-compare-marks").appendChild(el("div", { id: "compare-tip", class: "heat-tip muted" }));
  tip.textContent = "Hover a mark for what it was.";
  const draw = (u) => {
    const g = u.ctx, { left, top, width, height } = u.bbox;
    g.save();
    g.beginPath(); g.rect(left, top, width, height); g.clip();
    g.textAlign = "center"; g.textBaseline = "middle";
    g.font = `${Math.round(12 * devicePixelRatio)}px system-ui`;
    for (const k of marks) {
      g.fillStyle = PALETTE[k.run % PALETTE.length];
      g.fillText(MARK_SHAPES[k.m.type] || "•", u.valToPos(k.x, "x", true), top + (k.run + 0.5) * (height / n));
    }
    g.restore();
  };
  if (state.charts.marks) state.charts.marks.destroy();
  const labels = cmp.runs.map((r) => r.run.run);
  state.charts.marks = new uPlot({
    width: chartWidth("#chart-compare-marks"), height: 34 * n + 50, legend: { show: false },
    cursor: { sync: { key: "compare" }, y: false, points: { show: false } },
    scales: { x: { time: false, range }, y: { range: [0, n] } },
    series: [{}, { stroke: "transparent", paths: () => null, points: { show: false } }],
    axes: [{}, { size: AXIS, font: "11px system-ui", stroke: "#1d232a", grid: { show: false }, ticks: { show: false },
      splits: () => labels.map((_, i) => n - i - 0.5),
      values: (u, splits) => splits.map((v) => shorten(labels[Math.round(n - v - 0.5)] || "", 16)) }],
    hooks: {
      draw: [draw],
      setCursor: [(u) => {
        if (u.cursor.left < 0) return;
        const row = Math.floor(u.cursor.top / (u.bbox.height / devicePixelRatio) * n);
        const x = u.posToVal(u.cursor.left, "x"), px = (v) => u.valToPos(v, "x");
        const near = marks.filter((k) => k.run === row && Math.abs(px(k.x) - px(x)) < 8)
          .sort((a, b) => Math.abs(a.x - x) - Math.abs(b.x - x))[0];
        if (near) tip.textContent = `${labels[row]} · step ${near.m.step} · ${near.m.type} · ${near.m.label}` +
          (near.m.actor && near.m.type === "fix" ? ` · by ${near.m.actor}` : "");
      }],
    },
  }, [xs.length ? xs : [0], (xs.length ? xs : [0]).map(() => null)], $("#chart-compare-marks"));
  $("#chart-compare-marks").dataset.marks = String(marks.length);
}

function configTable(cmp) {
  const runs = cmp.runs.map((r) => r.run.run);
  $("#config-diff thead").replaceChildren(el("tr", {}, el("th", {}, "key"),
    ...runs.map((r, i) => el("th", {}, el("span", { class: "swatch", style: `background:${PALETTE[i % PALETTE.length]}` }), r))));
  $("#config-diff tbody").replaceChildren(...cmp.config_differences.map((d) => el("tr", { "data-key": d.key },
    el("td", {}, d.key), ...runs.map((r) => el("td", { class: r in d.values ? "" : "muted" },
      r in d.values ? fmtConfig(d.values[r]) : "not set")))));
  $("#compare-same").textContent = `(${cmp.config_differences.length} differ; ${cmp.config_same} the same in every run)`;
}

async function comparePage(runs) {
  $("#compare-page").hidden = false;
  runs = [...new Set(runs)];
  $("#crumb").textContent = "/ compare";
  document.title = `compare ${runs.length} runs · traindx`;
  if (runs.length < 1) throw new Error("pick runs to compare on the runs page (tick two or more)");
  $("#compare-title").textContent = `Compare ${runs.length} runs`;
  const params = new URLSearchParams(location.search);
  const metric = $("#compare-metric");
  const align = () => $("input[name=align]:checked").value;
  if (params.get("align") === "time") $("input[name=align][value=time]").checked = true;
  let cmp = null;
  const load = async (name) => {
    const q = new URLSearchParams([...runs.map((r) => ["run", r]), ["metric", name], ["max_points", "600"]]);
    cmp = await api(`/v1/compare?${q}`);
    state.comparison = cmp;
    if (metric.dataset.options !== cmp.metrics.join("|")) {
      const names = cmp.metrics.includes(cmp.metric) ? cmp.metrics : [cmp.metric, ...cmp.metrics];
      metric.replaceChildren(...names.map((m) => el("option", { value: m }, m)));
      metric.dataset.options = cmp.metrics.join("|");
    }
    metric.value = cmp.metric;
    $("#compare-legend").replaceChildren(...cmp.runs.map((r, i) => el("span", { class: "legend-item", "data-run": r.run.run },
      el("span", { class: "swatch", style: `background:${PALETTE[i % PALETTE.length]}` }),
      el("a", { href: `/runs/${enc(r.run.run)}` }, r.run.run), " ", badge(r.run.status, `st-${r.run.status}`),
      el("span", { class: "muted" }, ` step ${r.run.last_step}` + (r.points.length ? "" : ` · no ${cmp.metric}`) +
        (r.marks_total > r.marks.length ? ` · first ${r.marks.length} of ${r.marks_total} marks` : "")))));
    compareCharts(cmp, align());
    configTable(cmp);
    remember();
  };
  const remember = () => {
    const p = new URLSearchParams([...runs.map((r) => ["run", r]), ["metric", cmp.metric], ["align", align()]]);
    history.replaceState(null, "", `/compare?${p}`);
  };
  metric.addEventListener("change", () => load(metric.value).catch(showError));
  for (const radio of $$("input[name=align]")) radio.addEventListener("change", () => {
    if (cmp) { compareCharts(cmp, align()); remember(); }
  });
  await load(params.get("metric") || "loss");
  addEventListener("resize", () => cmp && compareCharts(cmp, align()));
  settle();
}

state.comparePage = comparePage;
