"""Prometheus: ``GET /metrics``, per-run gauges read from the store at scrape time.

Built on the official ``prometheus-client``: a custom collector (its ``collect()`` runs one set of
read queries per scrape) in a registry of the app's own, not the process-wide default one, and the
library's encoder, which answers in the Prometheus text format or OpenMetrics as the scraper asks.
Nothing is counted on the ingest path: every number comes from what the store already holds.
"""

from __future__ import annotations

import time
from typing import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from ..read.queries import STALE_AFTER_S
from ..store import Store

# Runs exported, most recently seen first: a store with thousands of old runs would otherwise make every
# scrape huge (each run is a label value, and Prometheus keeps one series per label value).
MAX_RUNS = 200
# The ingest rate is events stored per second over this window; Prometheus' rate() over the
# traindx_run_ingested_events_total counter gives the same over any window.
RATE_WINDOW_S = 60.0


class StoreCollector:
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        conn = self.store.read()
        now = time.time()
        runs = conn.execute("SELECT run, last_step, last_seen, ended FROM runs ORDER BY last_seen DESC LIMIT ?",
                            (MAX_RUNS,)).fetchall()
        names = {r["run"] for r in runs}
        step = GaugeMetricFamily("traindx_run_step", "Latest training step the run reported.", labels=["run"])
        loss = GaugeMetricFamily("traindx_run_loss", "Training loss at the run's latest step that reported one "
                                 "(NaN when it was NaN or infinite).", labels=["run"])
        active = GaugeMetricFamily("traindx_run_active", f"1 while the job is sending (not ended, heard from in the "
                                   f"last {STALE_AFTER_S:.0f} s), else 0.", labels=["run"])
        seen = GaugeMetricFamily("traindx_run_last_seen_timestamp_seconds", "When the job was last heard from.",
                                 labels=["run"])
        for r in runs:
            run = r["run"]
            step.add_metric([run], r["last_step"] or 0)
            active.add_metric([run], 0 if r["ended"] or now - r["last_seen"] > STALE_AFTER_S else 1)
            seen.add_metric([run], r["last_seen"])
            row = conn.execute("SELECT value FROM scalars WHERE run=? AND name='loss' ORDER BY step DESC LIMIT 1",
                               (run,)).fetchone()
            if row is not None:
                loss.add_metric([run], float("nan") if row[0] is None else row[0])
        yield from (step, loss, active, seen)

        anomalies = GaugeMetricFamily("traindx_run_open_anomalies", "Open anomalies, by kind and severity.",
                                      labels=["run", "kind", "severity"])
        for run, kind, severity, n in conn.execute(
                "SELECT run, kind, severity, count(*) FROM anomalies WHERE status='open' "
                "GROUP BY run, kind, severity ORDER BY run, kind, severity"):
            if run in names:
                anomalies.add_metric([run, kind, severity], n)
        yield anomalies

        fixes = GaugeMetricFamily("traindx_run_fixes", "Fixes, by status (pending, applied, effective, ...).",
                                  labels=["run", "status"])
        for run, status, n in conn.execute("SELECT run, status, count(*) FROM fixes GROUP BY run, status "
                                           "ORDER BY run, status"):
            if run in names:
                fixes.add_metric([run, status], n)
        yield fixes

        events = CounterMetricFamily("traindx_run_ingested_events", "Events stored for the run.", labels=["run"])
        rate = GaugeMetricFamily("traindx_run_ingest_events_per_second",
                                 f"Events stored per second over the last {RATE_WINDOW_S:.0f} s.", labels=["run"])
        recent = dict(conn.execute("SELECT run, sum(events) FROM batches WHERE received >= ? GROUP BY run",
                                   (now - RATE_WINDOW_S,)).fetchall())
        for run, total in conn.execute("SELECT run, sum(events) FROM batches GROUP BY run ORDER BY run"):
            if run in names:
                events.add_metric([run], total or 0)
                rate.add_metric([run], (recent.get(run) or 0) / RATE_WINDOW_S)
        yield from (events, rate)


def build_registry(store: Store) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    return registry


router = APIRouter()


@router.get("/metrics", tags=["server"], response_class=Response,
            summary="Per-run gauges for Prometheus: step, loss, open anomalies by kind and severity, ingest rate")
def metrics(request: Request) -> Response:
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encode(request.app.state.metrics), media_type=content_type)
