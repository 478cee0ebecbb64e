// traindx dashboard: the list of runs, searched and filtered on the server, several picked to compare.
"use strict";

const RUNS_REFRESH_MS = 5000;

async function runList() {
  $("#runs-page").hidden = false;
  const picked = new Set(new URLSearchParams(location.search).getAll("run"));
  const search = $("#runs-search"), status = $("#runs-status"), open = $("#runs-open");
  const params = new URLSearchParams(location.search);
  search.value = params.get("search") || "";
  status.value = params.get("status") || "";
  open.checked = params.get("open") === "1";
  let shown = [];
  const button = $("#compare-selected");
  const sync = () => {
    button.disabled = picked.size < 2;
    button.textContent = picked.size >= 2 ? `Compare ${picked.size} runs` : "Compare selected (pick 2 or more)";
    $("#runs-all").checked = shown.length > 0 && shown.every((r) => picked.has(r.run));
  };
  const draw = async () => {
    const q = new URLSearchParams({ limit: "500" });
    if (search.value.trim()) q.set("search", search.value.trim());
    if (status.value) q.set("status", status.value);
    if (open.checked) q.set("open_anomalies", "true");
    try {
      const page = await api(`/v1/runs?${q}`);
      shown = page.runs;
      const now = Date.now() / 1000;
      $("#runs tbody").replaceChildren(...page.runs.map((r) => {
        const box = el("input", { type: "checkbox", "aria-label": `pick ${r.run}`, checked: picked.has(r.run),
          onchange: (ev) => { if (ev.target.checked) picked.add(r.run); else picked.delete(r.run); sync(); } });
        return el("tr", { "data-run": r.run, "data-status": r.status },
          el("td", {}, box), el("td", { class: "run-id" }, el("a", { href: `/runs/${enc(r.run)}` }, r.run)),
          el("td", {}, badge(r.status, `st-${r.status}`)), el("td", {}, String(r.last_step)),
          el("td", {}, r.open_anomalies ? badge(String(r.open_anomalies), "sev-warning") : "0"), el("td", {}, r.device),
          el("td", {}, r.total_params.toLocaleString()), el("td", { title: new Date(r.last_seen * 1000).toLocaleString() },
            `${ago(now - r.last_seen)} ago`));
      }));
      $("#runs-count").textContent = page.total > page.runs.length ? `${page.runs.length} of ${page.total} runs shown`
        : `${page.total} run${page.total === 1 ? "" : "s"}`;
      $("#runs-empty").hidden = page.total > 0 || !!(search.value || status.value || open.checked);
      sync();
      showError(null);
    } catch (e) { showError(e); }
  };
  const remember = () => {
    const p = new URLSearchParams();
    if (search.value.trim()) p.set("search", search.value.trim());
    if (status.value) p.set("status", status.value);
    if (open.checked) p.set("open", "1");
    history.replaceState(null, "", "/" + (p.toString() ? "?" + p : ""));
  };
  let typing = null;
  $("#runs-filters").addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => { remember(); draw(); }, 120);
  });
  $("#runs-all").addEventListener("change", (ev) => {
    for (const r of shown) { if (ev.target.checked) picked.add(r.run); else picked.delete(r.run); }
    draw();
  });
  button.addEventListener("click", () => {
    location.href = "/compare?" + [...picked].map((r) => `run=${enc(r)}`).join("&");
  });
  await draw();
  // The list follows new runs while the tab is seen; a hidden tab (or a print, a screenshot) asks nothing.
  let timer = setInterval(draw, RUNS_REFRESH_MS);
  document.addEventListener("visibilitychange", () => {
    clearInterval(timer);
    if (!document.hidden) { draw(); timer = setInterval(draw, RUNS_REFRESH_MS); }
  });
  settle();
}

state.runList = runList;
