"""Distributed runs: real 2- and 4-rank DDP jobs (gloo, CPU) streaming to a real server.

One launcher process (tests/ddp_job.py) imports torch once and runs four jobs in turn, each on forked
ranks with the environment torchrun gives them: a healthy 2-rank job that an agent captures over MCP
while it runs, a 2-rank job with a straggler (rank 1 sleeps in its forward), a 4-rank job with a slow
data loader on rank 2, a healthy 4-rank job, a 2-rank job sharded with FSDP2, and a 2-rank
recommender whose ranks each see half of the items.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import anyio
import httpx
import jsonschema
import pytest
import torch
from click.testing import CliRunner

import probes
from diag_server.cli import main as cli_main

from .conftest import AUTH, ROOT, ServerProcess, make_server

pytestmark = pytest.mark.slow

JOBS = [
    {"rdzv_id": "cap2", "nproc": 2, "steps": 60, "interval": 10, "pace": 0.01, "eval_every": 20, "until_capture": True},
    # The straggler job times its all-reduce with the probe's communication hook; the others use the
    # default, the gradient-ready marks.
    {"rdzv_id": "strag2", "nproc": 2, "steps": 24, "interval": 2, "slow_forward": "1:0.06", "time_allreduce": True},
    {"rdzv_id": "data4", "nproc": 4, "steps": 24, "interval": 2, "slow_data": "2:0.06"},
    {"rdzv_id": "ok4", "nproc": 4, "steps": 24, "interval": 2},
    # FSDP2 (fully_shard): each rank holds half of every parameter and of its gradient, as DTensors.
    {"rdzv_id": "fsdp2", "nproc": 2, "steps": 12, "interval": 2, "fsdp": True},
    # A recommender under DDP, each rank's data holding its own half of the items (tests/ddp_job.py).
    {"rdzv_id": "recsys2", "nproc": 2, "steps": 300, "interval": 20, "recsys": True},
    # A fix the ranks pick up 100 steps apart (MemorySinks, no server: tests/ddp_job.py fix_sync), and one
    # that rank 1 never gets.
    {"rdzv_id": "fixsync", "nproc": 2, "steps": 700, "fix_sync": True, "inject": [50, 150]},
    {"rdzv_id": "fixone", "nproc": 2, "steps": 700, "fix_sync": True, "inject": [50, -1]},
]
SERVED = [j for j in JOBS if not j.get("fix_sync")]
# The same with sparse gradients (SparseAdam), in a launcher of its own: see _run_apart.
SPARSE_RECSYS = {"rdzv_id": "recsys2s", "nproc": 2, "steps": 300, "interval": 20, "recsys": True, "sparse": True}

# The Trace Event Format's JSON object form, as documented by Chrome's trace viewer (and read by Perfetto):
# complete events ("X") need ts and dur in microseconds, metadata events ("M") name processes and threads.
TRACE_EVENT_FORMAT = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {"type": "array", "items": {
            "type": "object",
            "required": ["name", "ph", "pid", "tid"],
            "properties": {
                "name": {"type": "string"}, "cat": {"type": "string"},
                "ph": {"enum": ["B", "E", "X", "i", "I", "C", "M", "b", "e", "n", "s", "t", "f", "P", "O", "N", "D"]},
                "ts": {"type": "number", "minimum": 0}, "dur": {"type": "number", "minimum": 0},
                "pid": {"type": "integer"}, "tid": {"type": "integer"}, "args": {"type": "object"},
            },
            "allOf": [
                {"if": {"properties": {"ph": {"const": "X"}}}, "then": {"required": ["ts", "dur"]}},
                {"if": {"properties": {"ph": {"const": "M"}}},
                 "then": {"properties": {"name": {"enum": ["process_name", "process_sort_index", "thread_name",
                                                            "thread_sort_index", "process_labels"]}},
                          "required": ["args"]}},
            ],
        }},
    },
}


async def _mcp_capture(url: str, run: str, launcher: subprocess.Popen) -> dict:
    """An agent, connected before the job starts, asks for a capture as soon as the run is live."""
    from agent_examples.scripted_agent import connect

    async with connect(f"{url}/mcp") as client:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and launcher.poll() is None:
            runs = (await client.call_tool("list_runs", {})).structured_content["runs"]
            if any(r["run"] == run and r["status"] == "active" for r in runs):
                result = await client.call_tool("capture", {"run": run, "steps": 3})
                assert not result.is_error, result
                return result.structured_content
            await anyio.sleep(0.05)
    raise AssertionError(f"{run} never became active")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the module: each test uses runs of its own."""
    server = make_server(tmp_path_factory.mktemp("server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def jobs(srv: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("distributed")
    todo = [{**j, "server": srv.url} for j in JOBS]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINDX_SPOOL": str(tmp / "spool"), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, str(ROOT / "tests" / "ddp_job.py"), json.dumps(todo)], cwd=tmp,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        srv.capture = anyio.run(_mcp_capture, srv.url, "torchrun-cap2", launcher)
        out, _ = launcher.communicate(timeout=240)
        assert launcher.returncode == 0, out.decode()[-3000:]
        srv.job_dir = tmp
        srv.sparse_run = _run_apart(srv, SPARSE_RECSYS, tmp, env)
        yield srv
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _run_apart(srv: ServerProcess, job: dict, cwd: Path, env: dict, attempts: int = 2) -> str:
    """Run ``job`` in a launcher of its own; its run's name. torch 2.13's sparse all-reduce under DDP on gloo
    has aborted a rank on a corrupted heap ("malloc(): unaligned tcache chunk detected"), with no probe
    attached too (tests/ddp_job.py _exit_rank): 2 CI runs of the 4 that ran this job. A rank killed by a
    signal runs the job again, once, under another run name (said on stdout); any other failure fails."""
    out = ""
    for k in range(attempts):
        rdzv = job["rdzv_id"] if k == 0 else f"{job['rdzv_id']}-again{k}"
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "ddp_job.py"),
                               json.dumps([{**job, "rdzv_id": rdzv, "server": srv.url}])],
                              cwd=cwd, env=env, capture_output=True, timeout=240)
        out = (done.stdout + done.stderr).decode()
        if done.returncode == 0:
            return f"torchrun-{rdzv}"
        if "terminated with signal" not in out:
            break
        print(f"{rdzv}: a rank was killed by a signal; running the job again\n{out[-1500:]}")
    raise AssertionError(out[-3000:])


def _get(srv: ServerProcess, path: str, **params) -> dict:
    r = httpx.get(f"{srv.url}{path}", headers=AUTH, params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _anomalies(srv: ServerProcess, run: str) -> list[dict]:
    return _get(srv, f"/v1/runs/{run}/anomalies", limit=200)["anomalies"]


def test_every_rank_streams_into_one_run_named_by_torchrun(jobs: ServerProcess) -> None:
    runs = {r["run"]: r for r in _get(jobs, "/v1/runs")["runs"]}
    assert {f"torchrun-{j['rdzv_id']}" for j in SERVED} <= set(runs)
    assert all(runs[f"torchrun-{j['rdzv_id']}"]["status"] == "ended" for j in SERVED)  # only once every rank ended
    tl = _get(jobs, "/v1/runs/torchrun-ok4/timeline")
    assert [(r["rank"], r["local_rank"], r["world_size"]) for r in tl["ranks"]] == [(i, i, 4) for i in range(4)]
    assert all(r["host"] and r["last_step"] >= 22 for r in tl["ranks"])
    loss = _get(jobs, "/v1/runs/torchrun-ok4/series/loss")["points"]
    assert len(loss) == 4 * 24  # every rank's loss at every step, none lost or doubled


def test_healthy_multi_rank_runs_raise_nothing(jobs: ServerProcess) -> None:
    found = _anomalies(jobs, "torchrun-ok4")
    assert found == [], [a["message"] for a in found]
    # The 2-rank job was captured: the profiler really does slow its steps and grow its memory, which the
    # single-process rules may say on rank 0; no cross-rank rule may blame a rank for it.
    from diag_server.fixes.distributed import RULES

    found = [a for a in _anomalies(jobs, "torchrun-cap2") if a["rule"] in RULES]
    assert found == [], [a["message"] for a in found]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_under_ddp_rows_other_ranks_look_up_are_not_dead_and_rows_no_rank_looks_up_are(jobs: ServerProcess,
                                                                                      sparse: bool) -> None:
    """Each rank looks up its own half of the items, and DDP's all-reduce moves every row any rank looked up.
    Before, each rank counted the other half as never updated (210 rows), and since those rows had a
    gradient, said the table learns outside its lookups: the 20 items no rank's data holds were an info
    with the wrong cause (with sparse gradients, the other half was dead: a warning on 220 rows). Now every
    rank counts the rows the optimizer moves, and names those 20. Nothing else fires: the other half's
    rows have no energy per lookup here, and counted in its median (0) they made every row this rank looks
    up a critical zombie "1e28x" its peers (from step ~150)."""
    from tests.ddp_job import RECSYS_DEAD

    run = jobs.sparse_run if sparse else "torchrun-recsys2"
    found = _anomalies(jobs, run)
    assert {a["rule"] for a in found} == {"dead_embedding"}, [(a["rule"], a["message"][:120]) for a in found]
    dead = [a for a in found if a["rule"] == "dead_embedding"]
    assert [(a["severity"], a["evidence"]["table"]) for a in dead] == [("warning", "module.item.weight")], dead
    e = dead[0]["evidence"]
    assert (e["never_updated"], e["rows"], e["learns_outside_lookups"]) == (20, [float(i) for i in RECSYS_DEAD], False)
    assert "Cold-start ids" in dead[0]["message"]
    tables = _get(jobs, f"/v1/runs/{run}/embeddings", table="module.item", rows=50)["tables"]
    assert [t["rank"] for t in tables] == [0, 1]
    for t in tables:  # every rank says the same of the rows
        assert t["summary"]["never_updated"] == 20 and t["summary"]["dead_ids"] == list(RECSYS_DEAD)
        assert not t["summary"].get("learns_outside_lookups")


def _fix_sync(jobs: ServerProcess, job: str) -> list[dict]:
    return [json.loads((jobs.job_dir / f"fixsync-{job}.rank{r}.json").read_text()) for r in range(2)]


def test_ranks_that_pick_a_fix_up_at_different_steps_apply_it_after_the_same_one(jobs: ServerProcess) -> None:
    """DDP averages the gradients, never the parameters: a replica that applies a fix a few steps before
    another stays apart from it. The ranks picked embedding_grad_scale up 100 steps apart; they agreed on
    one step, computed the same factors for the same rows there, and end with the same weights. Without
    the agreement, the same job's ranks applied it after steps 68 and 156, to 6 rows and to 2, and ended
    apart (probes/agreement.py)."""
    ranks = _fix_sync(jobs, "fixsync")
    acks = [r["acks"] for r in ranks]
    assert [[a["status"] for a in x] for x in acks] == [["scheduled", "applied"]] * 2, acks
    (s0, a0), (s1, a1) = acks
    assert s0["step"] == s1["step"] == a0["step"] == a1["step"] > 150  # said ahead, then done, after one step
    assert a0["after"] == a1["after"] and a0["after"]["rows"] > 0
    assert ranks[0]["params"] == ranks[1]["params"]


def test_a_fix_not_every_rank_picked_up_in_time_is_refused_and_no_rank_applies_it(jobs: ServerProcess) -> None:
    """Rank 1 never got it: rank 0 held it for the step the ranks would have applied it at, then refused it,
    saying why; the replicas did not part."""
    ranks = _fix_sync(jobs, "fixone")
    (scheduled, ack), none = ranks[0]["acks"], ranks[1]["acks"]
    assert none == [] and scheduled["status"] == "scheduled" and scheduled["step"] == ack["step"]
    assert ack["status"] == "rejected" and "only 1 of 2 ranks had it" in ack["reason"], ack
    assert ranks[0]["params"] == ranks[1]["params"]


def test_fsdp2_ranks_report_the_shards_they_hold_and_together_the_whole_tensors(jobs: ServerProcess) -> None:
    """Under FSDP2 a parameter is a DTensor sharded across the ranks. Each rank's statistics are of its own
    shard (a DTensor's reductions would be collectives, and mixing the shard's sums with the whole
    tensor's size gave wrong means and zero fractions), and the shards' norms add up to the whole tensor's,
    which the job itself logged at the sampled steps."""
    run = "torchrun-fsdp2"
    summary = _get(jobs, f"/v1/runs/{run}")
    assert summary["run"]["status"] == "ended"
    assert not [m["text"] for m in summary["messages"] if m["level"] == "error"]  # no hook failed
    steps_checked = 0
    for collection, logged in (("weights", "full_norm"), ("gradients", "full_grad_norm")):
        # Sharded on their first dimension: Linear(64, 1)'s (1, 64) weight is all on rank 0, rank 1's is empty.
        for name, sizes in (("1.weight", (32 * 32, 32 * 32)), ("1.bias", (32, 32)), ("3.weight", (64, 0))):
            per_rank = []
            for rank, numel in enumerate(sizes):
                shard = _get(jobs, f"/v1/runs/{run}/series/{name}", collection=collection, rank=rank)["points"]
                size = _get(jobs, f"/v1/runs/{run}/series/{name}", collection=collection, field="numel",
                            rank=rank)["points"]
                assert {p["value"] for p in size} == {numel}, (collection, name, rank, size)
                per_rank.append({p["step"]: p["value"] for p in shard})
            whole = {p["step"]: p["value"] for p in
                     _get(jobs, f"/v1/runs/{run}/series/{logged}/{name}", rank=0)["points"]}
            assert set(whole) == set(per_rank[0]) == set(per_rank[1]) and len(whole) == 6
            # Read without a rank, the server merges the shards into the whole tensor, one point a step.
            merged = _get(jobs, f"/v1/runs/{run}/series/{name}", collection=collection)["points"]
            assert [p["step"] for p in merged] == sorted(whole)
            sizes_merged = _get(jobs, f"/v1/runs/{run}/series/{name}", collection=collection, field="numel")["points"]
            assert {p["value"] for p in sizes_merged} == {sum(sizes)}
            for step, norm in whole.items():
                assert (per_rank[0][step] ** 2 + per_rank[1][step] ** 2) ** 0.5 == pytest.approx(norm, rel=1e-4)
                steps_checked += 1
            assert {p["step"]: p["value"] for p in merged} == pytest.approx(whole, rel=1e-4)
            assert per_rank[0] != per_rank[1]  # two different halves, not one tensor seen twice
    assert steps_checked == 36
    ratios = _get(jobs, f"/v1/runs/{run}/series/1.weight", collection="updates", field="update_ratio", rank=1)["points"]
    assert len(ratios) == 6 and all(0 < p["value"] < 1 for p in ratios)
    # The dashboard's charts and heat map read the merged rows too.
    chart = _get(jobs, f"/v1/runs/{run}/stats", collection="gradients", tensor="1.weight")["series"][0]["points"]
    whole = {p["step"]: p["value"] for p in _get(jobs, f"/v1/runs/{run}/series/full_grad_norm/1.weight")["points"]}
    assert {p["step"]: p["value"] for p in chart} == pytest.approx(whole, rel=1e-4)
    heat = _get(jobs, f"/v1/runs/{run}/heatmap", collection="gradients")
    row = heat["values"][heat["tensors"].index("1.weight")]
    assert dict(zip(heat["steps"], row)) == pytest.approx(whole, rel=1e-4)
    # The compression recipe (from the summary statistics) sizes layers by the whole tensors.
    recipe = _get(jobs, f"/v1/runs/{run}/compression", target_sparsity=0.5)
    assert {layer["name"]: layer["numel"] for layer in recipe["layers"]} == {"1.weight": 32 * 64, "3.weight": 64}
    # A data-parallel run's replicas are not added up: every rank's points, as before.
    ddp = _get(jobs, "/v1/runs/torchrun-ok4/series/module.1.weight", collection="weights", field="numel")["points"]
    assert {p["value"] for p in ddp} == {32 * 64} and len(ddp) == 4 * 12


def test_a_straggler_rank_is_named_with_its_phase(jobs: ServerProcess) -> None:
    found = _anomalies(jobs, "torchrun-strag2")
    assert [(a["kind"], a["evidence"]["rank"], a["evidence"]["phase"]) for a in found] == [
        ("straggler_rank", 1, "forward")]
    assert "Rank 1" in found[0]["message"] and "forward" in found[0]["message"]
    # The other rank's time is spent waiting at the all-reduce, and the timeline shows it.
    ranks = {r["rank"]: r["phases"] for r in _get(jobs, "/v1/runs/torchrun-strag2/timeline")["ranks"]}
    assert ranks[0]["comm_wait"] > ranks[1]["comm_wait"] and ranks[1]["forward"] > ranks[0]["forward"]
    diagnosis = _get(jobs, "/v1/runs/torchrun-strag2/diagnosis")
    assert diagnosis["causes"][0]["kind"] == "straggler_rank" and "Rank 1" in diagnosis["report"]


def test_a_slow_data_loader_on_one_rank_is_named(jobs: ServerProcess) -> None:
    found = {(a["kind"], a["evidence"]["rank"], a["evidence"]["phase"]) for a in _anomalies(jobs, "torchrun-data4")}
    assert found == {("straggler_rank", 2, "data_wait"), ("dataloader_bottleneck", 2, "data_wait")}
    # Without the communication hook, the wait at the all-reduce comes from the gradient-ready marks.
    ranks = {r["rank"]: r["phases"] for r in _get(jobs, "/v1/runs/torchrun-data4/timeline")["ranks"]}
    assert "allreduce" not in ranks[0] and all(ranks[r]["comm_wait"] > ranks[2]["comm_wait"] for r in (0, 1, 3))


def test_straggler_fixes_are_advice_with_exact_instructions(jobs: ServerProcess) -> None:
    run = "torchrun-data4"
    a = next(a for a in _anomalies(jobs, run) if a["kind"] == "straggler_rank")
    r = httpx.post(f"{jobs.url}/v1/runs/{run}/anomalies/{a['id']}/propose", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    fixes = r.json()["fixes"]
    advice = fixes[0]
    assert advice["action"] == "advice" and not advice["live"] and advice["status"] == "advice"
    assert "rank 2" in advice["params"]["instructions"] and "num_workers=" in advice["params"]["instructions"]
    closer = [f for f in fixes if f["action"] == "set_probe"]
    assert closer == [] or "does not fix" in closer[0]["rationale"]  # interval 2 is already close: none offered
    r = httpx.post(f"{jobs.url}/v1/runs/{run}/fixes/{advice['id']}/apply", headers=AUTH, timeout=30)
    assert r.status_code == 409 and r.json()["error"] == "not_live"  # never pretends to apply advice


def test_timeline_exports_a_valid_chrome_trace_whose_spans_line_up(jobs: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    result = CliRunner().invoke(cli_main, ["timeline", "torchrun-strag2", "-o", str(out), "--server", jobs.url])
    assert result.exit_code == 0, result.output
    trace = json.loads(out.read_text())
    jsonschema.validate(trace, TRACE_EVENT_FORMAT)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {n.split(" (")[0] for n in names} == {"rank 0", "rank 1"}
    spans: dict[tuple[int, int], dict[str, tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] != "user":
            spans.setdefault((e["pid"], e["args"]["step"]), {})[e["name"]] = (e["ts"], e["ts"] + e["dur"])
    steps = sorted({s for _, s in spans})
    assert len(steps) >= 10
    eps = 1.0  # microseconds of rounding
    for (rank, step), ph in spans.items():
        s0, s1 = ph["step"]
        order = [ph[p] for p in ("data_wait", "forward", "backward", "optimizer")]
        assert all(s0 - eps <= a and b <= s1 + eps for a, b in order), (rank, step, ph)
        assert all(order[i][1] <= order[i + 1][0] + eps for i in range(3)), (rank, step, ph)
        assert ph["allreduce"][0] >= ph["forward"][1] - eps  # gradients are reduced during the backward
    for step in steps:
        (a0, a1), (b0, b1) = spans[(0, step)]["allreduce"], spans[(1, step)]["allreduce"]
        assert a0 <= b1 and b0 <= a1, step  # one collective: both ranks are in it at once, on one clock


def test_an_agent_reads_the_ranks_phases_over_mcp_and_people_get_xml(jobs: ServerProcess) -> None:
    from lxml import etree

    from diag_server.api.xml import xsd_schema
    from agent_examples.scripted_agent import connect

    async def read() -> dict:
        async with connect(f"{jobs.url}/mcp") as client:
            result = await client.call_tool("get_timeline", {"run": "torchrun-strag2", "limit": 50})
            assert not result.is_error, result
            return result.structured_content

    tl = anyio.run(read)
    assert len(tl["spans"]) == 50 and tl["truncated"]
    slow = max(tl["ranks"], key=lambda r: r["phases"]["forward"])
    assert slow["rank"] == 1 and slow["host"] and slow["world_size"] == 2
    r = httpx.get(f"{jobs.url}/v1/runs/torchrun-strag2/timeline", headers=AUTH, params={"format": "xml", "limit": 20})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/xml")
    xsd_schema().assertValid(etree.fromstring(r.content))


def test_capture_over_mcp_records_operators_and_shapes_on_every_rank(jobs: ServerProcess) -> None:
    capture = jobs.capture
    assert capture["status"] == "pending" and capture["steps"] == 3
    done = _get(jobs, f"/v1/runs/torchrun-cap2/captures/{capture['id']}")
    assert done["status"] == "done" and [r["rank"] for r in done["ranks"]] == [0, 1]
    for r in done["ranks"]:
        assert r["status"] == "done" and r["profiled"] and r["last_step"] - r["first_step"] == 2
        assert any(op["name"] == "aten::addmm" for op in r["ops"])
        assert {"module": "module.1", "type": "Linear", "inputs": [[16, 32]], "outputs": [[16, 64]]} in r["shapes"]
        assert r["trace_available"]
    trace = httpx.get(f"{jobs.url}/v1/runs/torchrun-cap2/captures/{capture['id']}/trace", headers=AUTH, params={"rank": 1}).json()
    assert any(e.get("name") == "aten::addmm" for e in trace["traceEvents"])
    # During the capture every step was recorded; before and after it, every 10th. Each rank starts at
    # its next step boundary after it hears of the capture.
    for r in done["ranks"]:
        points = _get(jobs, "/v1/runs/torchrun-cap2/series/sys/step_time", rank=r["rank"])["points"]
        first = r["first_step"]
        assert [p["step"] for p in points if p["step"] % 10] == [s for s in range(first, first + 3) if s % 10]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, probe: probes.Probe, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)


def test_eval_latency_is_tracked_apart_and_its_spikes_flagged(srv: ServerProcess) -> None:
    server = srv
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with probes.attach(model, opt, server=server.url, run="eval-1", interval=5) as probe:
        _train(model, opt, probe, 10)
        for block in range(3):
            with probe.mode("eval"), torch.no_grad():
                for i in range(10):
                    with probe.span("preprocess"):
                        x = torch.randn(8, 4)
                    if block == 2 and i == 4:
                        time.sleep(0.2)  # one slow inference step
                    probe.step(loss=model(x).pow(2).mean())
            _train(model, opt, probe, 5)
    found = [a for a in _anomalies(server, "eval-1") if a["kind"] == "step_time_outlier" and "mode" in a["evidence"]]
    assert [(a["rule"], a["evidence"]["mode"]) for a in found] == [("mode_step_time_outlier", "eval")]
    assert _get(server, "/v1/runs/eval-1")["run"]["last_step"] == 25  # eval steps are not training steps
    steps = _get(server, "/v1/runs/eval-1/series/sys/eval/steps")["points"]
    assert [p["value"] for p in steps] == [10.0, 10.0, 10.0]
    tl = _get(server, "/v1/runs/eval-1/timeline")
    assert {(s["mode"], s["name"]) for s in tl["spans"] if s["category"] == "user"} >= {("eval", "eval"),
                                                                                      ("eval", "preprocess")}


def test_capture_over_http_in_a_single_process_run(srv: ServerProcess) -> None:
    server = srv
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with probes.attach(model, opt, server=server.url, run="cap-1", interval=50, flush_interval=0.05) as probe:
        _train(model, opt, probe, 3)
        probe.flush()
        r = httpx.post(f"{server.url}/v1/runs/cap-1/captures", headers=AUTH, params={"steps": 2, "profile": "false"})
        assert r.status_code == 201, r.text
        cid = r.json()["id"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            _train(model, opt, probe, 1)
            probe.flush()
            if _get(server, f"/v1/runs/cap-1/captures/{cid}")["status"] == "done":
                break
    cap = _get(server, f"/v1/runs/cap-1/captures/{cid}")
    assert cap["status"] == "done" and cap["ranks"][0]["profiled"] is False and cap["ranks"][0]["ops"] == []
    assert [s["module"] for s in cap["ranks"][0]["shapes"]] == ["0", "1", "2"]
    r = httpx.get(f"{server.url}/v1/runs/cap-1/captures/{cid}/trace", headers=AUTH)
    assert r.status_code == 404 and "profiling was off" in r.json()["message"]
    bad = httpx.post(f"{server.url}/v1/runs/cap-1/captures", headers=AUTH, params={"steps": 0})
    assert bad.status_code == 422
    ended = httpx.post(f"{server.url}/v1/runs/cap-1/captures", headers=AUTH, params={"steps": 2})
    assert ended.status_code == 409 and ended.json()["error"] == "job_unavailable"
