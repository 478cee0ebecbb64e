// traindx dashboard, the shared part: HTTP, small DOM helpers, and which page to show. The pages are
// runs.js (the list), run.js (one run, kept live) and compare.js (several runs side by side); charts.js
// draws on uPlot. They read the same /v1 routes as the CLI and the Python client. No build step.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => [...root.querySelectorAll(sel)];
const enc = encodeURIComponent;
// state is the page's, shared by the scripts; window.traindx exposes it to tests and the curious (a chart's
// data is at traindx.charts.<name>.data).
const state = { run: null, maxStep: 1, charts: {}, selected: null, refreshing: false, again: false,
                updates: 0, timings: {}, settled: false };
window.traindx = state;

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
  const box = $("#error");
  box.textContent = err ? String(err.message || err) : "";
  box.hidden = !err;
}

// -- formatting and DOM -------------------------------------------------------------------------------
const fmt = (v) => v === null || v === undefined ? "NaN/Inf" :
  (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(4)) : String(v));
const fmtValue = (v) => v === null ? "null" : Array.isArray(v) ? `[${v.map(fmtValue).join(", ")}]` :
  typeof v === "number" ? fmt(v) : String(v);
// A config value as the job gave it: 0.0003 stays 0.0003 (fmt's 4 significant digits are for measurements).
const fmtConfig = (v) => v === null ? "null" : Array.isArray(v) ? `[${v.map(fmtConfig).join(", ")}]` : String(v);
const el = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(k ?? ""));
  return e;
};
const badge = (text, cls) => el("span", { class: `badge ${cls}` }, text);

function ago(seconds) {
  const s = Math.max(0, Math.round(seconds));
  return s < 90 ? `${s} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${Math.round(s / 3600)} h`;
}

// -- the page -------------------------------------------------------------------------------------------
function forgetTokenInAddress() {
  // /?token=... set the cookie (the server answered with it); the secret should not stay in the address
  // bar, the history or a screenshot.
  const params = new URLSearchParams(location.search);
  if (!params.has("token")) return;
  params.delete("token");
  const rest = params.toString();
  history.replaceState(history.state, "", location.pathname + (rest ? "?" + rest : "") + location.hash);
}

// The page has drawn what it shows (html[data-settled]): a screenshot or a print can be taken now.
function settle() {
  state.settled = true;
  document.documentElement.dataset.settled = "true";
}

function main() {
  forgetTokenInAddress();
  const actor = $("#actor"), token = $("#token");
  actor.value = localStorage.getItem("traindx.actor") || "";
  actor.addEventListener("change", () => localStorage.setItem("traindx.actor", actor.value.trim()));
  token.value = localStorage.getItem("traindx.token") || "";
  $("#token-box").hidden = !token.value;
  token.addEventListener("change", () => localStorage.setItem("traindx.token", token.value.trim()));
  const m = location.pathname.match(/^\/runs\/(.+)$/);
  const page = m ? state.runPage(decodeURIComponent(m[1]))
    : location.pathname === "/compare" ? state.comparePage(new URLSearchParams(location.search).getAll("run"))
      : state.runList();
  page.catch(showError);
}

Object.assign(state, { $, $$, enc, api, showError, fmt, fmtValue, fmtConfig, el, badge, ago, settle, main });
document.addEventListener("DOMContentLoaded", main);
