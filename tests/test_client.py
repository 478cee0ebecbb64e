"""The Python client against a real server and a live training job: read runs, anomalies, the diagnosis
and series (as lists and as DataFrames), then propose, apply and revert a fix that the job acknowledges."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.conftest import PEOPLE_TOKEN, ServerProcess
from diag_server import client as client_module
from diag_server.client import Client, TraindxError
from schemas.records import Anomaly, Diagnosis

RUN = "client-run"


@pytest.fixture(scope="module")
def live(people_server: ServerProcess) -> Iterator[tuple[ServerProcess, object]]:
    from scripts.live_run import LiveRun

    srv = people_server
    job = LiveRun(srv.url, RUN, interval=5, step_sleep=0.003, token=PEOPLE_TOKEN).start()
    job.wait_steps(60)
    job.inject("nan", steps=8)
    job.wait_steps(40)
    yield srv, job
    job.stop()


def test_public_names() -> None:
    assert client_module.__all__ == ["Client", "TraindxError"]


def test_reads_runs_anomalies_diagnosis_and_series(live) -> None:
    srv, job = live
    with Client(srv.url) as dx:
        runs = {r.run: r for r in dx.runs()}
        assert runs[RUN].status == "active"
        assert RUN in {r.run for r in dx.runs(status="active")}
        anomalies = dx.anomalies(RUN)
        assert anomalies and all(isinstance(a, Anomaly) for a in anomalies)
        assert [a.kind.value for a in dx.anomalies(RUN, kind="nonfinite")] == ["nonfinite"]
        # The severity filter: the nonfinite anomaly (critical) is not among the info ones (a step slowed by
        # a loaded machine may be: step_time_outlier is info).
        info = dx.anomalies(RUN, severity="info")
        assert all(a.severity.value == "info" for a in info) and "nonfinite" not in {a.kind.value for a in info}
        assert isinstance(dx.diagnosis(RUN), Diagnosis)
        loss = dx.series(RUN, "loss")
        assert len(loss) >= 60 and all(isinstance(s, int) for s, _ in loss)
        assert any(v is None for _, v in loss)  # the NaN steps are there, as None
        grads = dx.series(RUN, "0.weight", collection="gradients", field="norm")
        assert grads and all(v is None or v >= 0 for _, v in grads)
        scalars = dx.scalars(RUN, prefix="sys/")
        assert "sys/forward" in scalars
        with pytest.raises(TraindxError) as err:
            dx.run("no-such-run")
        assert err.value.status == 404 and err.value.error.error == "unknown_run"


def test_series_as_dataframes(live) -> None:
    pd = pytest.importorskip("pandas")
    srv, _ = live
    with Client(srv.url) as dx:
        loss = dx.series(RUN, "loss", as_frame=True)
        assert isinstance(loss, pd.DataFrame) and loss.index.name == "step" and list(loss.columns) == ["loss"]
        assert loss["loss"].isna().any()
        wide = dx.scalars(RUN, "loss", "accuracy", as_frame=True)
        assert {"loss", "accuracy"} <= set(wide.columns) and wide.index.is_monotonic_increasing
        frame = dx.anomalies(RUN, as_frame=True)
        assert "kind" in frame.columns and len(frame) >= 1


def test_propose_apply_and_revert_reach_the_job(live) -> None:
    srv, _ = live
    with Client(srv.url, actor="nora", token=PEOPLE_TOKEN) as dx:
        nan = dx.anomalies(RUN, kind="nonfinite")[0]
        proposals = dx.propose(RUN, nan.id)
        skip = next(f for f in proposals if f.action.value == "skip_nonfinite")
        assert dx.apply(RUN, skip.id).status.value == "pending"
        done = dx.wait_fix(RUN, skip.id)
        assert done.status.value in ("applied", "effective", "ineffective"), done
        dx.revert(RUN, skip.id)
        back = dx.wait_fix(RUN, skip.id, until={"reverted", "failed"})
        assert back.status.value == "reverted"
        actors = {(e.action, e.actor) for e in dx.audit(RUN).entries if e.fix_id == skip.id}
        assert ("apply_requested", "person:nora") in actors and ("revert_requested", "person:nora") in actors
        assert ("applied", "job") in actors and ("reverted", "job") in actors
    with Client(srv.url, token="") as anonymous, pytest.raises(TraindxError) as err:
        anonymous.propose(RUN, nan.id)
    assert err.value.status == 401 and err.value.error.error == "unauthorized"


def test_the_client_finds_the_token_file_and_reads_it_again_on_401(tmp_path, monkeypatch) -> None:
    """As the probe does: no TRAINDX_TOKEN, the token in TRAINDX_DATA/token; a client made before the server
    wrote it picks it up on the server's first 401."""
    from tests.conftest import free_port

    port = free_port()
    srv = ServerProcess(url=f"http://127.0.0.1:{port}", port=port, data_dir=tmp_path / "data",
                        env={"TRAINDX_TOKEN": None, "TRAINDX_DATA": None})
    monkeypatch.delenv("TRAINDX_TOKEN", raising=False)
    monkeypatch.setenv("TRAINDX_DATA", str(srv.data_dir))
    early = Client(srv.url)  # before the server (and its token) exists
    srv.start()
    try:
        assert early.runs() == []
        with Client(srv.url) as dx:
            assert dx.runs() == []
        with Client(srv.url, token="not-the-token") as wrong, pytest.raises(TraindxError) as err:
            wrong.runs()  # a token given is the token used
        assert err.value.status == 401
    finally:
        early.close()
        srv.stop()
