"""`traindx runs / run / anomalies / diagnose / fixes / propose / apply` against a real server over HTTP:
readable tables by default, the server's JSON and XML with --json / --xml, the token sent when set."""

from __future__ import annotations

import os
import uuid

import httpx
import orjson
import pytest
from click.testing import CliRunner
from lxml import etree

from tests.conftest import PEOPLE_RUN, PEOPLE_TOKEN, ServerProcess
from diag_server.cli import main
from diag_server.cli_people import table
from diag_server.api.xml import xsd_schema

RUN = PEOPLE_RUN
TOKEN = PEOPLE_TOKEN


@pytest.fixture
def srv(people_server: ServerProcess) -> ServerProcess:
    return people_server


def cli(srv: ServerProcess, *args: str, token: str | None = TOKEN) -> tuple[int, str]:
    env = {"TRAINDX_SERVER": srv.url, "TRAINDX_TOKEN": token or "", "USER": "cli-user"}
    res = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return res.exit_code, res.output


def test_tables_for_people(srv: ServerProcess) -> None:
    code, out = cli(srv, "runs")
    assert code == 0 and out.splitlines()[0].split() == ["RUN", "STATUS", "STEP", "OPEN", "DEVICE", "PARAMS"]
    assert RUN in out and "ended" in out
    code, out = cli(srv, "anomalies", RUN)
    assert code == 0 and "exploding_gradient" in out and "nonfinite" in out and out.startswith("ID")
    code, out = cli(srv, "anomalies", RUN, "--kind", "nonfinite")
    assert code == 0 and "exploding_gradient" not in out
    # A non-finite value is always critical. (Whether a spike that long kills ReLUs, an info dead_relu,
    # depends on how many steps the job ran between the injections: on timing.)
    code, out = cli(srv, "anomalies", RUN, "--kind", "nonfinite", "--severity", "info")
    assert code == 0 and f"no anomalies in {RUN} matching the filters" in out
    code, out = cli(srv, "diagnose", RUN)
    assert code == 0 and "Diagnosis of run" in out and "exploding_gradient" in out
    code, out = cli(srv, "fixes", RUN, "--status", "pending")
    assert code == 0 and "no fixes" in out
    code, out = cli(srv, "fixes", RUN)
    assert code == 0 and "person:ana" in out


def test_one_run_with_its_latest_scalars_counts_and_messages(srv: ServerProcess) -> None:
    code, out = cli(srv, "run", RUN)
    assert code == 0 and out.splitlines()[0].split() == ["RUN", "STATUS", "STEP", "OPEN", "DEVICE", "PARAMS"]
    summary = httpx.get(f"{srv.url}/v1/runs/{RUN}").json()
    assert "ended" in out and "loss" in out and summary["anomalies_by_kind"]
    assert all(f"{kind} {n}" in out for kind, n in summary["anomalies_by_kind"].items())
    # A run whose job died of an exception says so (the probe's run_end at exit, as a message).
    run = "cli-died"
    event = {"kind": "run_end", "step": 7, "time": 1.0, "reason": "exit after RuntimeError: CUDA out of memory"}
    httpx.post(f"{srv.url}/v1/ingest", headers={"authorization": f"Bearer {TOKEN}"},
               json={"batch_id": uuid.uuid4().hex, "run": run, "seq": 0, "events": [
                   {"kind": "scalars", "step": 7, "time": 1.0, "values": {"loss": 2.5}}, event]}).raise_for_status()
    code, out = cli(srv, "run", run)
    assert code == 0 and "ended" in out and "open anomalies: none" in out
    assert "error" in out and "the job ended: exit after RuntimeError: CUDA out of memory" in out
    code, out = cli(srv, "run", run, "--json")
    assert code == 0 and orjson.loads(out)["messages"][0]["level"] == "error"
    code, out = cli(srv, "run", "no-such-run")
    assert code != 0 and "no-such-run" in out


def test_json_and_xml_for_scripts(srv: ServerProcess) -> None:
    code, out = cli(srv, "anomalies", RUN, "--json")
    page = orjson.loads(out)
    assert code == 0 and page["run"] == RUN and page["total"] == len(page["anomalies"]) >= 2
    code, out = cli(srv, "runs", "--xml")
    doc = etree.fromstring(out.encode())
    assert code == 0 and doc.tag == "RunPage" and xsd_schema().validate(doc)
    code, out = cli(srv, "diagnose", RUN, "--xml")
    assert code == 0 and etree.fromstring(out.encode()).tag == "Diagnosis"


def test_writes_send_the_token_and_name_the_person(srv: ServerProcess) -> None:
    code, out = cli(srv, "anomalies", RUN, "--kind", "nonfinite", "--json")
    anomaly = orjson.loads(out)["anomalies"][0]["id"]
    code, out = cli(srv, "propose", RUN, anomaly, token=None)
    assert code == 1 and "unauthorized" in out
    code, out = cli(srv, "propose", RUN, anomaly)
    # The run's weights went NaN and it keeps no snapshots: what is proposed is a restart (advice), not live.
    assert code == 0 and ("proposed" in out or "advice" in out)
    code, out = cli(srv, "fixes", RUN, "--anomaly", anomaly, "--json")
    fixes = orjson.loads(out)["fixes"]
    assert fixes and {f["requested_by"] for f in fixes} == {"person:cli-user"}
    code, out = cli(srv, "apply", RUN, fixes[0]["id"])  # the job has ended, or it is advice: refused, saying why
    assert code == 1 and ("job_unavailable" in out or "not_live" in out)


def test_errors_say_what_to_do(srv: ServerProcess) -> None:
    code, out = cli(srv, "anomalies", "no-such-run")
    assert code == 1 and "unknown_run" in out and RUN in out
    res = CliRunner().invoke(main, ["runs"], env={"TRAINDX_SERVER": "http://127.0.0.1:9"})
    assert res.exit_code == 1 and "cannot reach the traindx server" in res.output


def test_table_pads_columns() -> None:
    text = table(["A", "LONGER"], [["x", "1"], ["yyy", None]])
    assert text.splitlines() == ["A    LONGER", "---  ------", "x    1", "yyy  -"]  # the rule fits the column


def test_every_command_finds_the_token_the_server_wrote(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`traindx runs` in the server's own directory: no TRAINDX_TOKEN, the server's token file in ./.traindx
    (reads need the token on this server). Elsewhere, the 401 says where the token was looked for."""
    from tests.conftest import free_port

    port = free_port()
    srv = ServerProcess(url=f"http://127.0.0.1:{port}", port=port, data_dir=tmp_path / ".traindx",
                        env={"TRAINDX_TOKEN": None, "TRAINDX_DATA": None})
    srv.start()
    try:
        env = {"TRAINDX_SERVER": srv.url, "TRAINDX_TOKEN": None, "TRAINDX_DATA": None, "USER": "cli-user"}
        monkeypatch.chdir(tmp_path)
        run = CliRunner().invoke(main, ["runs"], env=env, catch_exceptions=False)
        assert run.exit_code == 0 and "no runs yet" in run.output, run.output
        httpx.post(f"{srv.url}/v1/ingest", headers=srv.headers, json={
            "batch_id": uuid.uuid4().hex, "run": "mine", "seq": 0,
            "events": [{"kind": "scalars", "step": s, "time": 1.0, "values": {"loss": 1.0}} for s in range(3)]},
        ).raise_for_status()
        for args in (["runs"], ["run", "mine"], ["anomalies", "mine"], ["fixes", "mine"], ["diagnose", "mine"],
                     ["runs", "--json"]):
            res = CliRunner().invoke(main, args, env=env, catch_exceptions=False)
            assert res.exit_code == 0 and "unauthorized" not in res.output, (args, res.output)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        monkeypatch.chdir(elsewhere)
        res = CliRunner().invoke(main, ["runs"], env=env, catch_exceptions=False)
        assert res.exit_code == 1 and "unauthorized" in res.output
        assert str(elsewhere / ".traindx" / "token") in res.output and "TRAINDX_TOKEN" in res.output
    finally:
        srv.stop()


def test_ids_are_sent_encoded_and_a_path_is_not_a_run(srv: ServerProcess) -> None:
    """`traindx run ../../etc` is refused before any request; an id of dots (a fix id is not checked here) is
    sent as one encoded segment, so the server answers about that id instead of a route the dots walked to."""
    for args in (["run", "../../etc"], ["anomalies", "../../etc", "--json"], ["apply", "../x", "f-1"]):
        code, out = cli(srv, *args)
        assert code == 2 and "is not a run id" in out and "traindx runs" in out, (args, out)
    code, out = cli(srv, "revert", RUN, "..")  # unencoded, httpx would have asked for /v1/runs/<run>/revert
    assert code == 1 and "unknown_fix" in out and "'..'" in out, out
    code, out = cli(srv, "propose", RUN, "../../../../etc", "--json")  # the server asked stays under the run
    assert code == 1 and f"no route POST /v1/runs/{RUN}/anomalies/../../../../etc/propose" in out, out


def test_the_person_is_the_os_user_when_user_is_unset(srv: ServerProcess) -> None:
    """No $USER (cron, a container, `env -i`): the fix is still recorded as the person at the terminal,
    the OS user from the password database, not as the caller's address."""
    import pwd

    run = "cli-no-user-" + uuid.uuid4().hex[:8]
    httpx.post(f"{srv.url}/v1/ingest", headers={"authorization": f"Bearer {TOKEN}"}, json={
        "batch_id": uuid.uuid4().hex, "run": run, "seq": 0,
        "events": [{"kind": "scalars", "step": s, "time": 1.0, "values": {"loss": 1.0 if s < 5 else None}}
                   for s in range(8)]}).raise_for_status()
    anomaly = httpx.get(f"{srv.url}/v1/runs/{run}/anomalies?kind=nonfinite").json()["anomalies"][0]["id"]
    env = {"TRAINDX_SERVER": srv.url, "TRAINDX_TOKEN": TOKEN, "TRAINDX_ACTOR": None,
           "USER": None, "LOGNAME": None, "LNAME": None, "USERNAME": None}
    res = CliRunner().invoke(main, ["propose", run, anomaly], env=env, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    fixes = httpx.get(f"{srv.url}/v1/runs/{run}/fixes").json()["fixes"]
    me = pwd.getpwuid(os.getuid()).pw_name
    assert fixes and {f["requested_by"] for f in fixes} == {f"person:{me}"}
