"""Anomalies: a run's list, one anomaly with its evidence, and the diagnosis that relates them."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Request
from fastapi.responses import Response

from schemas.enums import AnomalyKind, AnomalyStatus, Severity
from schemas.records import Anomaly, AnomalyPage, Diagnosis

from ...read import diagnosis
from ...read import queries
from ..deps import Limit, MaxStep, MinStep, Offset, Svc, router as _router
from ..render import respond

router = _router()


@router.get("/v1/runs/{run}/anomalies", response_model=AnomalyPage, tags=["anomalies"])
def anomalies(request: Request, services: Svc, run: str, kind: AnomalyKind | None = None,
              severity: Severity | None = None, status: AnomalyStatus | None = None, min_step: MinStep = None,
              max_step: MaxStep = None, offset: Offset = 0, limit: Limit = 50,
              min_step_time: Annotated[float | None, Query(
                  ge=0, allow_inf_nan=False, description="Latency threshold in seconds: only anomalies during "
                  "which a step took at least this long (sys/step_time_max).")] = None) -> Response:
    return respond(request, queries.anomalies(services.store, run, kind=kind, severity=severity, status=status,
                                              min_step=min_step, max_step=max_step, offset=offset, limit=limit,
                                              min_step_time=min_step_time))


@router.get("/v1/runs/{run}/anomalies/{anomaly_id}", response_model=Anomaly, tags=["anomalies"],
            summary="One anomaly with its evidence")
def anomaly(request: Request, services: Svc, run: str, anomaly_id: str) -> Response:
    return respond(request, queries.get_anomaly(services.store.read(), run, anomaly_id))


@router.get("/v1/runs/{run}/diagnosis", response_model=Diagnosis, tags=["anomalies"])
def diagnose(request: Request, services: Svc, run: str) -> Response:
    return respond(request, diagnosis.diagnose(services.store, run))
