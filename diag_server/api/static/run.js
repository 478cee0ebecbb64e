// traindx dashboard: one run's page. Charts, the configuration, anomalies with their evidence, diagnosis
// and fixes; kept live over /v1/runs/{run}/stream while the run is active, and still once it has ended.
"use strict";

const UPDATE_COALESCE_MS = 30; // commits of one burst (a batch, then the rules' anomalies) make one redraw

// -- the run's state, said once ----------------------------------------------------------------------------
// One badge says what the page is showing: a live run (and the step it is at), one that went quiet, one
// that ended, or a page that lost its stream. Nothing else on the page repeats it.
function showState(kind, text) {
  const box = $("#run-state");
  box.dataset.state = kind;
  box.textContent = text;
}

function describeRun(summary, streaming) {
  const r = summary.run;
  if (r.status === "ended") return ["ended", `ended · step ${r.last_step}`];
  if (r.status === "stale") return ["stale", `no data for ${ago(Date.now() / 1000 - r.last_seen)} · step ${r.last_step}`];
  return streaming ? ["live", `live · step ${r.last_step}`] : ["connecting", `connecting… · step ${r.last_step}`];
}

// -- charts ----------------------------------------------------------------------------------------------
// What the charts read, asked for all at once (the page's first paint and each live update is one round trip).
// The per-tensor charts (heat map, update ratios, distribution) change only with a new sampled step: a live
// update that brings none (a loss, an anomaly) keeps what they last read.
async function chartData(r, perTensor = true) {
  const kept = state.perTensor;
  const data = await Promise.all([
    api(`/v1/runs/${r}/scalars?max_points=400`),
    api(`/v1/runs/${r}/scalars?prefix=sys/&max_points=400`),
    perTensor || !kept ? api(`/v1/runs/${r}/heatmap?collection=gradients&field=norm&max_steps=150`) : kept[0],
    // every tensor's update ratio in one read: the heat map route keeps each bucket's largest value
    perTensor || !kept ? api(`/v1/runs/${r}/heatmap?collection=updates&field=update_ratio&max_steps=150`) : kept[1],
    api(`/v1/runs/${r}/history?limit=500`),
    api(`/v1/runs/${r}/embeddings?rows=5`),
    perTensor || !kept ? distributionData() : kept[2],
  ]);
  state.perTensor = [data[2], data[3], data[6]];
  return data;
}

function drawCharts(data) {
  state.lastCharts = data;
  const [scalars, sys, heat, updates, hist, tables, dist] = data;
  const heatLevel = $("#heat-level").value;
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
  heatmap("#chart-heat", heat, { level: heatLevel, onPick: (tensor) => pickDistribution("gradients", tensor) });
  const ratios = updates.tensors.map((t, i) => ({ name: t, points: updates.steps.map((s, j) => ({ step: s, value: updates.values[i][j] })) }));
  lineChart("updates", "#chart-updates", ratios, { log: true, more: "#updates-more" });
  drawDistribution(dist);
  lineChart("time", "#chart-time", time);
  lineChart("memory", "#chart-memory", memory, { height: 150 });
  timelineChart("#chart-timeline", hist.entries);
  $("#timeline-list").replaceChildren(...hist.entries.slice(-30).reverse().map((e) =>
    el("li", { "data-type": e.type, "data-ref": e.ref }, `step ${e.step} · ${e.type} · ${e.label}` +
      (e.actor && e.type === "fix" ? ` · by ${e.actor}` : ""))));
  embeddingTables(tables.tables);
}

// -- distributions ---------------------------------------------------------------------------------------
async function distributionData() {
  const collection = $("#dist-collection").value;
  const chosen = state.distTensor && state.distTensor.collection === collection ? state.distTensor.tensor : null;
  const q = new URLSearchParams({ collection, max_points: "300" });
  if (chosen) q.set("tensor", chosen);
  try { return await api(`/v1/runs/${enc(state.run)}/distribution?${q}`); } catch (e) {
    if (e.status !== 404 || !chosen) throw e;
    state.distTensor = null; // that tensor is not in this collection: the collection's first instead
    return distributionData();
  }
}

function drawDistribution(d) {
  const collection = d.collection;
  const select = $("#dist-tensor");
  if (select.dataset.options !== d.tensors.join("|")) {
    select.replaceChildren(...d.tensors.map((t) => el("option", { value: t }, t)));
    select.dataset.options = d.tensors.join("|");
  }
  select.value = d.tensor;
  const what = { weights: "weights", gradients: "gradients", activations: "outputs" }[collection];
  $("#dist-title").textContent = d.tensor ? `Distribution of ${d.tensor}'s ${what} over steps` : "Distribution over steps";
  const levels = d.levels.map((l) => `${Math.round(l * 100)}%`);
  $("#dist-note").textContent = !d.points.length ? `No ${collection} measured yet.`
    : d.sample !== null
      ? `Bands between the quantiles ${levels[0]}–${levels[levels.length - 1]}, ${levels[1]}–${levels[levels.length - 2]}, ` +
        `${levels[2]}–${levels[levels.length - 3]}, and the median (line), estimated from ${d.sample} evenly spread ` +
        `elements per tensor (exact for smaller tensors), on sampled steps at least 100 apart; the outer band is the ` +
        `exact min–max.` + (d.downsampled ? " Steps grouped: each point is a group's last sample, within the group's min and max." : "")
      : "This run's probe sent no quantiles: the exact min–max band and the mean only.";
  distributionChart("#chart-dist", d);
  $("#chart-dist").dataset.tensor = d.tensor;
  $("#chart-dist").dataset.collection = collection;
}

async function showDistribution() {
  drawDistribution(await distributionData());
}

function pickDistribution(collection, tensor) {
  state.distTensor = { collection, tensor };
  $("#dist-collection").value = collection;
  showDistribution().catch(showError);
  $("#panel-dist").scrollIntoView({ block: "nearest", behavior: "smooth" });
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

// -- the configuration ------------------------------------------------------------------------------------
function drawConfig(config) {
  const keys = Object.keys(config).sort();
  $("#config-panel").hidden = !keys.length;
  $("#config-count").textContent = `(${keys.length} key${keys.length === 1 ? "" : "s"}, as the job sent them)`;
  $("#config tbody").replaceChildren(...keys.map((k) => el("tr", { "data-key": k },
    el("td", {}, k), el("td", {}, fmtConfig(config[k])))));
}

// -- anomalies, evidence, diagnosis, fixes ------------------------------------------------------------
async function fillFilters() {
  // The filters' choices come from the API's own description; it is large, so it is read after the charts.
  let doc;
  try { doc = await api("/openapi.json"); } catch (e) { return; }
  const enums = doc.components.schemas;
  const fill = (id, name) => {
    for (const v of (enums[name] || {}).enum || []) $(id).append(el("option", { value: v }, v));
  };
  fill("#f-kind", "AnomalyKind"); fill("#f-severity", "Severity"); fill("#f-status", "AnomalyStatus");
}

function anomalyPage() {
  const q = new URLSearchParams({ limit: "200" });
  for (const id of ["kind", "severity", "status"]) { const v = $(`#f-${id}`).value; if (v) q.set(id, v); }
  const ms = parseFloat($("#f-latency").value);
  if (ms >= 0) q.set("min_step_time", String(ms / 1000));
  return api(`/v1/runs/${enc(state.run)}/anomalies?${q}`);
}

function drawAnomalies(page) {
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

// before/after as short "name: old → new" lines, not JSON: JSON without spaces cannot wrap
function changes(before, after) {
  const keys = [...new Set([...Object.keys(before), ...Object.keys(after)])];
  return keys.map((k) => el("div", { class: "muted change" }, `${k}: ${k in before ? fmtValue(before[k]) : "–"} → ` +
    `${k in after ? fmtValue(after[k]) : "–"}`));
}

async function openAnomaly(id) {
  state.selected = id;
  for (const tr of $$("#anomalies tbody tr")) tr.classList.toggle("selected", tr.dataset.id === id);
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
    el("td", {}, f.id), el("td", {}, f.action, ...Object.entries(f.params).map(([k, v]) => el("div", { class: "muted" }, `${k}=${fmtValue(v)}`))),
    el("td", { class: "fix-status" }, badge(f.status, `st-${f.status}`)),
    el("td", {}, f.reason || f.rationale, ...changes(f.before, f.after)),
    el("td", { class: "fix-act" }, canApply(f) ? el("button", { class: "apply", onclick: () => fixAction("apply", f.id) }, "Apply") : "",
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
    rows.length ? el("table", { class: "grid", id: "fixes" },
      el("colgroup", {}, el("col", { class: "c-id" }), el("col", { class: "c-action" }), el("col", { class: "c-status" }),
        el("col", {}), el("col", { class: "c-act" })), el("tbody", {}, ...rows))
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

async function refresh(perTensor = true) {
  if (state.refreshing) { state.again = state.again || perTensor || "light"; return; }
  state.refreshing = true;
  try {
    const r = enc(state.run);
    const [summary, charts, anomalies] = await Promise.all([api(`/v1/runs/${r}`), chartData(r, perTensor),
                                                            anomalyPage()]);
    state.summary = summary;
    state.maxStep = Math.max(summary.run.last_step, 1);
    showState(...describeRun(summary, !!state.source && state.source.readyState === 1));
    drawMessages(summary);
    if (!state.configShown) { drawConfig(summary.config); state.configShown = true; }
    drawCharts(charts);
    drawAnomalies(anomalies);
    if (state.selected) await openAnomaly(state.selected);
    state.shownStep = summary.run.last_step;
    state.timings.shown = Date.now(); // when this step was on screen: benchmarks/dashboard.py reads it
    showError(null);
  } catch (e) { showError(e); } finally {
    state.refreshing = false;
    if (state.again) { const full = state.again === true; state.again = false; setTimeout(() => refresh(full), 0); }
  }
}

function follow(run) {
  // Only a run that can still change keeps a stream open: an ended run's page makes no request once drawn,
  // so it settles (a screenshot, a print, a page left open overnight).
  const source = new EventSource(`/v1/runs/${enc(run)}/stream`);
  state.source = source;
  let timer = null;
  source.addEventListener("open", () => { if (state.summary) showState(...describeRun(state.summary, true)); });
  let statsStep = null, perTensor = false;
  source.addEventListener("update", (ev) => {
    const d = JSON.parse(ev.data);
    state.updates += 1;
    if (d.ended) { source.close(); state.source = null; }
    perTensor = perTensor || d.stats_step !== statsStep;  // a new sampled step since the last redraw
    statsStep = d.stats_step;
    clearTimeout(timer);
    timer = setTimeout(() => { const full = perTensor; perTensor = false; refresh(full); }, UPDATE_COALESCE_MS);
  });
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) state.source = null;
    showState("reconnecting", "reconnecting…");
  };
}

async function runPage(run) {
  state.run = run;
  $("#run-page").hidden = false;
  $("#run-name").textContent = run;
  $("#crumb").textContent = "/ " + run;
  $("#run-compare").href = `/?run=${enc(run)}`; // the list, this run already picked
  document.title = `${run} · traindx`;
  $("#filters").addEventListener("input", () => anomalyPage().then(drawAnomalies).catch(showError));
  $("#heat-level").addEventListener("change", () => state.perTensor && drawCharts(state.lastCharts));
  $("#dist-collection").addEventListener("change", () => showDistribution().catch(showError));
  $("#dist-tensor").addEventListener("change", (ev) => pickDistribution($("#dist-collection").value, ev.target.value));
  await refresh();
  state.timings.drawn = performance.now(); // every chart has its data: what the benchmark calls first paint
  await fillFilters();
  // ?live=0: drawn once and left still, for a screenshot or a print of a run that is still going (a live
  // page keeps its stream open, and tools that wait for the network to go quiet would wait forever).
  const live = new URLSearchParams(location.search).get("live") !== "0";
  if (state.summary && state.summary.run.status !== "ended") {
    if (live) follow(run);
    else showState("snapshot", `snapshot · step ${state.summary.run.last_step} · not following (live=0)`);
  }
  settle();
  let width = innerWidth;
  addEventListener("resize", () => { if (innerWidth !== width) { width = innerWidth; resizeCharts(); } });
  // Printing: the charts take the page's width, then their own back.
  addEventListener("beforeprint", () => resizeCharts(Math.min(980, document.documentElement.clientWidth) - 40));
  addEventListener("afterprint", () => resizeCharts());
}

Object.assign(state, { runPage, refresh, showDistribution, pickDistribution });
