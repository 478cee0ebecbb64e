"""Fixes: propose for an anomaly, list, read, apply, revert, and the audit trail of who asked what."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Request
from fastapi.responses import Response

from schemas.enums import AnomalyKind, FixStatus, Severity
from schemas.records import AuditPage, Fix, FixList, FixPage

from ... import fixes
from ...read import queries
from ..deps import WRITER, Limit, MaxStep, MinStep, Offset, Svc, actor, router as _router
from ..render import respond

router = _router()


@router.post("/v1/runs/{run}/anomalies/{anomaly_id}/propose", response_model=FixList, dependencies=WRITER,
             tags=["fixes"])
def propose(request: Request, services: Svc, run: str, anomaly_id: str) -> Response:
    return respond(request, fixes.propose(services.store, run, anomaly_id, actor(request)))


@router.get("/v1/runs/{run}/fixes", response_model=FixPage, tags=["fixes"])
def list_fixes(request: Request, services: Svc, run: str, status: FixStatus | None = None,
               anomaly_id: str | None = None,
               kind: Annotated[AnomalyKind | None, Query(description="Kind of the fix's anomaly.")] = None,
               severity: Annotated[Severity | None, Query(description="Severity of the fix's anomaly.")] = None,
               min_step: MinStep = None, max_step: MaxStep = None, offset: Offset = 0, limit: Limit = 50) -> Response:
    return respond(request, queries.fix_page(services.store, run, status=status, anomaly_id=anomaly_id, kind=kind,
                                             severity=severity, min_step=min_step, max_step=max_step,
                                             offset=offset, limit=limit))


@router.get("/v1/runs/{run}/fixes/{fix_id}", response_model=Fix, tags=["fixes"])
def get_fix(request: Request, services: Svc, run: str, fix_id: str) -> Response:
    return respond(request, fixes.status(services.store, run, fix_id))


@router.post("/v1/runs/{run}/fixes/{fix_id}/apply", response_model=Fix, dependencies=WRITER, tags=["fixes"])
def apply_fix(request: Request, services: Svc, run: str, fix_id: str) -> Response:
    return respond(request, fixes.apply(services.store, run, fix_id, actor(request)))


@router.post("/v1/runs/{run}/fixes/{fix_id}/revert", response_model=Fix, dependencies=WRITER, tags=["fixes"])
def revert_fix(request: Request, services: Svc, run: str, fix_id: str) -> Response:
    return respond(request, fixes.revert(services.store, run, fix_id, actor(request)))


@router.get("/v1/runs/{run}/audit", response_model=AuditPage, tags=["fixes"],
            summary="Who asked for what, when, with the job's before/after values")
def audit(request: Request, services: Svc, run: str, fix_id: str | None = None, offset: Offset = 0,
          limit: Limit = 50) -> Response:
    return respond(request, queries.audit_page(services.store, run, fix_id=fix_id, offset=offset, limit=limit))
