"""A small Python client for a traindx server, for notebooks and scripts.

What smdebug's Trial API gave its users, against a live server: list runs, read anomalies, the
diagnosis and metric series (as records, or as pandas DataFrames when pandas is installed), and drive
fixes (propose, apply, revert, wait for the job's answer)::

    from diag_server.client import Client

    dx = Client()                              # $TRAINDX_SERVER or http://127.0.0.1:8765; the token as below
    run = dx.runs()[0].run
    for a in dx.anomalies(run, status="open"):
        print(a.id, a.kind, a.message)
    loss = dx.series(run, "loss", as_frame=True)   # a DataFrame indexed by step
    fix = dx.propose(run, "a-1")[0]
    dx.apply(run, fix.id)
    dx.wait_fix(run, fix.id)                   # until the job has applied (or refused) it

Every call returns the contract's pydantic records (``schemas.records``); an error answer raises
``TraindxError`` carrying the server's ``Error`` record. Without ``token=``, the token is found as the probe
finds it (``schemas.auth.find_token``: $TRAINDX_TOKEN, else DATA/token with DATA $TRAINDX_DATA or .traindx),
and found anew when the server answers 401 (a server started after the client writes it then).
"""

from __future__ import annotations

import getpass
import os
import time
from typing import Any, Iterator, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from schemas.auth import find_token
from schemas.records import (Anomaly, AnomalyPage, AuditPage, CompressionRecipe, Diagnosis, EmbeddingTables, Error, Fix,
                             FixList, FixPage, Heatmap, RunHistory, RunPage, RunSummary, Series, SeriesSet)

DEFAULT_SERVER = "http://127.0.0.1:8765"
M = TypeVar("M", bound=BaseModel)
# Fix statuses after which the job has answered: waiting longer would not change them by itself.
SETTLED = frozenset({"applied", "rejected", "failed", "expired", "effective", "ineffective", "reverted", "advice"})

__all__ = ["Client", "TraindxError"]


class TraindxError(Exception):
    """The server answered with an error; ``error`` is its ``schemas.records.Error`` record."""

    def __init__(self, status: int, error: Error) -> None:
        super().__init__(f"{status} {error.error}: {error.message}")
        self.status = status
        self.error = error


def api_path(*segments: object) -> str:
    """``/v1/runs/<run>/...`` with every segment percent-encoded, '/' included, and a segment of dots encoded
    too: an id such as ``../../etc`` names one thing on the server and never walks up its paths (httpx, like a
    browser, would resolve the dots before sending)."""
    parts = [quote(str(s), safe="") for s in segments]
    return "/" + "/".join(p.replace(".", "%2E") if p.strip(".") == "" else p for p in parts)


def person() -> str:
    """Who is at this terminal, for the audit trail: $TRAINDX_ACTOR, else the OS user (getpass: $LOGNAME,
    $USER, $LNAME, $USERNAME, then the password database, so a cron job or a container without $USER is
    still named); '' when none is known (the server then records the caller's address)."""
    named = os.environ.get("TRAINDX_ACTOR", "").strip()
    if named:
        return named
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # a uid with no passwd entry (a container run as an arbitrary uid)
        return ""


def _clean(params: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in params.items() if v is not None}


class Client:
    def __init__(self, server: str | None = None, *, token: str | None = None, actor: str | None = None,
                 timeout: float = 10.0, transport: httpx.BaseTransport | None = None) -> None:
        """``actor`` names you in the audit trail ('person:<actor>'); default $TRAINDX_ACTOR, else the OS user."""
        base = (server or os.environ.get("TRAINDX_SERVER") or DEFAULT_SERVER).rstrip("/")
        self._token_given = token is not None
        who = actor or person()
        headers = {"accept": "application/json"}
        if who:
            headers["x-traindx-actor"] = f"person:{who}"
        self._http = httpx.Client(base_url=base, headers=headers, timeout=timeout, transport=transport)
        self._use_token(token if token is not None else find_token())

    def _use_token(self, token: str | None) -> None:
        self._token = token or None
        if self._token:
            self._http.headers["authorization"] = f"Bearer {self._token}"
        else:
            self._http.headers.pop("authorization", None)

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        res = self._http.request(method, path, **kwargs)
        if res.status_code == 401 and not self._token_given:
            fresh = find_token()  # the server may have written its token since this client was made
            if fresh and fresh != self._token:
                self._use_token(fresh)
                res = self._http.request(method, path, **kwargs)
        return res

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------------------
    def _call(self, model: type[M], method: str, path: str, **params: Any) -> M:
        res = self._request(method, path, params=_clean(params))
        if res.status_code >= 400:
            try:
                err = Error.model_validate_json(res.content)
            except ValueError:
                err = Error(error="http_error", message=res.text[:500] or res.reason_phrase)
            raise TraindxError(res.status_code, err)
        return model.model_validate_json(res.content)

    def _pages(self, model: type[M], path: str, attr: str, limit: int | None, **params: Any) -> Iterator[Any]:
        offset, seen = 0, 0
        while True:
            page = self._call(model, "GET", path, offset=offset, limit=200, **params)
            for item in getattr(page, attr):
                if limit is not None and seen >= limit:
                    return
                seen += 1
                yield item
            if page.next_offset is None:  # type: ignore[attr-defined]
                return
            offset = page.next_offset  # type: ignore[attr-defined]

    def raw(self, method: str, path: str, *, format: str = "json", **params: Any) -> bytes:
        """The server's answer as it sent it, in ``format`` (json or xml): for scripts that pipe it on."""
        res = self._request(method, path, params=_clean(params),
                            headers={"accept": "application/xml" if format == "xml" else "application/json"})
        if res.status_code >= 400:
            try:
                err = Error.model_validate_json(res.content) if format == "json" else Error(
                    error="http_error", message=res.text[:2000])
            except ValueError:
                err = Error(error="http_error", message=res.text[:500] or res.reason_phrase)
            raise TraindxError(res.status_code, err)
        return res.content

    @staticmethod
    def _frame(rows: list[dict[str, Any]], index: str | None = None) -> Any:
        try:
            import pandas as pd
        except ImportError as e:  # pandas is optional: say how to get it
            raise ImportError("as_frame=True needs pandas: pip install pandas") from e
        frame = pd.DataFrame(rows)
        return frame.set_index(index) if index and not frame.empty else frame

    # -- runs ----------------------------------------------------------------------------------------
    def runs(self, *, status: str | None = None) -> list:
        """Every run, most recently active first (``status``: active, ended or stale)."""
        return list(self._pages(RunPage, "/v1/runs", "runs", None, status=status))

    def run(self, run: str) -> RunSummary:
        return self._call(RunSummary, "GET", api_path("v1", "runs", run))

    def history(self, run: str, **filters: Any) -> RunHistory:
        """The run's timeline: anomalies, fixes and verdicts on the step axis."""
        return self._call(RunHistory, "GET", api_path("v1", "runs", run, "history"), **{"limit": 500, **filters})

    # -- anomalies and diagnosis ---------------------------------------------------------------------
    def anomalies(self, run: str, *, kind: str | None = None, severity: str | None = None, status: str | None = None,
                  min_step: int | None = None, max_step: int | None = None, min_step_time: float | None = None,
                  limit: int | None = None, as_frame: bool = False) -> Any:
        """The run's anomalies, open and critical first, all pages (or the first ``limit``)."""
        items: list[Anomaly] = list(self._pages(AnomalyPage, api_path("v1", "runs", run, "anomalies"), "anomalies",
                                                limit, kind=kind, severity=severity, status=status, min_step=min_step,
                                                max_step=max_step, min_step_time=min_step_time))
        return self._frame([a.model_dump(mode="json") for a in items], "id") if as_frame else items

    def anomaly(self, run: str, anomaly_id: str) -> Anomaly:
        return self._call(Anomaly, "GET", api_path("v1", "runs", run, "anomalies", anomaly_id))

    def diagnosis(self, run: str) -> Diagnosis:
        return self._call(Diagnosis, "GET", api_path("v1", "runs", run, "diagnosis"))

    # -- metrics -------------------------------------------------------------------------------------
    def series(self, run: str, name: str, *, collection: str | None = None, field: str = "norm",
               min_step: int | None = None, max_step: int | None = None, max_points: int = 10000,
               as_frame: bool = False) -> Any:
        """One metric over steps: a scalar (``loss``, ``sys/step_time``) or, with ``collection``, a tensor's
        statistic. A list of ``(step, value)`` pairs (None where it was NaN/Inf), or a DataFrame indexed by
        step with one column named like the metric."""
        s = self._call(Series, "GET", api_path("v1", "runs", run, "series", name), collection=collection, field=field,
                       min_step=min_step, max_step=max_step, max_points=max_points)
        if as_frame:
            return self._frame([{"step": p.step, name: p.value} for p in s.points], "step")
        return [(p.step, p.value) for p in s.points]

    def scalars(self, run: str, *names: str, prefix: str | None = None, max_points: int = 10000,
                as_frame: bool = False) -> Any:
        """Several scalars at once (all of them by default): ``{name: [(step, value), ...]}``, or a wide
        DataFrame indexed by step with a column per scalar."""
        sset = self._call(SeriesSet, "GET", api_path("v1", "runs", run, "scalars"), name=list(names) or None,
                          prefix=prefix, max_points=max_points)
        data = {s.name: [(p.step, p.value) for p in s.points] for s in sset.series}
        if not as_frame:
            return data
        rows: dict[int, dict[str, Any]] = {}
        for name, points in data.items():
            for step, value in points:
                rows.setdefault(step, {"step": step})[name] = value
        return self._frame([rows[s] for s in sorted(rows)], "step")

    def heatmap(self, run: str, *, collection: str = "gradients", field: str = "norm", max_steps: int = 200) -> Heatmap:
        return self._call(Heatmap, "GET", api_path("v1", "runs", run, "heatmap"), collection=collection, field=field,
                          max_steps=max_steps)

    def embeddings(self, run: str, *, table: str | None = None, rows: int = 20) -> EmbeddingTables:
        """The run's embedding tables as last reported (``table``: one of them, 'item.weight' or 'item'),
        every list of worst rows cut to ``rows``."""
        return self._call(EmbeddingTables, "GET", api_path("v1", "runs", run, "embeddings"), table=table, rows=rows)

    def compression(self, run: str, target_sparsity: float = 0.8) -> CompressionRecipe:
        return self._call(CompressionRecipe, "GET", api_path("v1", "runs", run, "compression"),
                          target_sparsity=target_sparsity)

    # -- fixes ---------------------------------------------------------------------------------------
    def fixes(self, run: str, *, status: str | None = None, anomaly_id: str | None = None) -> list[Fix]:
        return list(self._pages(FixPage, api_path("v1", "runs", run, "fixes"), "fixes", None, status=status,
                                anomaly_id=anomaly_id))

    def propose(self, run: str, anomaly_id: str) -> list[Fix]:
        """Candidate fixes for one anomaly, best first (proposing again returns the same fixes)."""
        return self._call(FixList, "POST", api_path("v1", "runs", run, "anomalies", anomaly_id, "propose")).fixes

    def apply(self, run: str, fix_id: str) -> Fix:
        """Queue a fix for the live job; it applies it at its next step boundary and acknowledges."""
        return self._call(Fix, "POST", api_path("v1", "runs", run, "fixes", fix_id, "apply"))

    def revert(self, run: str, fix_id: str) -> Fix:
        return self._call(Fix, "POST", api_path("v1", "runs", run, "fixes", fix_id, "revert"))

    def fix(self, run: str, fix_id: str) -> Fix:
        return self._call(Fix, "GET", api_path("v1", "runs", run, "fixes", fix_id))

    def wait_fix(self, run: str, fix_id: str, *, until: frozenset[str] | set[str] = SETTLED, timeout: float = 30.0,
                 poll: float = 0.2) -> Fix:
        """Poll the fix until its status is in ``until`` (by default: the job has answered); the last
        state seen is returned when ``timeout`` runs out."""
        deadline = time.monotonic() + timeout
        fix = self.fix(run, fix_id)
        while fix.status.value not in until and time.monotonic() < deadline:
            time.sleep(poll)
            fix = self.fix(run, fix_id)
        return fix

    def audit(self, run: str) -> AuditPage:
        return self._call(AuditPage, "GET", api_path("v1", "runs", run, "audit"), limit=500)
