"""Embedding tables end to end: a real training job, a real server, its HTTP API, MCP tools and CLI."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest
import torch

import probes
from tests.embedding_jobs import TinyLM, Toy, attach, summaries, train, train_lm


def _conflicted_heading(lines: list[str]) -> int:
    """Where `traindx embeddings` heads table.weight's conflicted rows (its table follows, after two lines)."""
    return next(i for i, line in enumerate(lines) if line.startswith("table.weight (rank 0): rows whose data has pulled"))


def test_end_to_end_dead_and_zombie_rows_through_a_real_server(server) -> None:
    torch.manual_seed(0)
    model = Toy(rows=40, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe = probes.attach(model, opt, server=server.url, run="emb-e2e", collections={"embeddings": 20},
                          allow=["embedding_grad_scale"])
    ids = torch.tensor([i for i in range(40) if i not in (5, 33)])  # rows 5 and 33: never looked up
    train(model, probe, 81, ids=ids, zombies={3, 17, 29}, opt=opt)
    assert probe.flush()
    base = f"{server.url}/v1/runs/emb-e2e"
    page = httpx.get(f"{base}/anomalies", headers=server.headers).json()
    by_kind = {a["kind"]: a for a in page["anomalies"]}
    assert sorted(int(r) for r in by_kind["dead_embedding"]["evidence"]["rows"]) == [5, 33]
    zombie = by_kind["zombie_embedding"]
    assert sorted(int(r) for r in zombie["evidence"]["rows"]) == [3, 17, 29]
    assert zombie["tensors"] == ["table.weight"]

    # The table as its latest report described it, over HTTP (JSON and XML) and MCP, its lists cut to ``rows``.
    tables = httpx.get(f"{base}/embeddings", params={"rows": 3}, headers=server.headers).json()
    assert tables["rows"] == 3 and [(t["name"], t["step"]) for t in tables["tables"]] == [("table.weight", 80)]
    summary = tables["tables"][0]["summary"]
    assert summary["rows"] == 40 and summary["never_updated"] == 2 and summary["dead_ids"] == [5, 33]
    assert sorted(r["row"] for r in summary["zombies"]) == [3, 17, 29] and len(summary["rarest"]) == 3
    assert sorted(r["row"] for r in summary["conflicted"]) == [3, 17, 29]  # and their data, over the run
    xml = httpx.get(f"{base}/embeddings", params={"table": "table", "format": "xml"}, headers=server.headers)
    assert xml.status_code == 200 and b"<EmbeddingTables" in xml.content and xml.content.count(b"<zombies") == 20
    missing = httpx.get(f"{base}/embeddings", params={"table": "user"}, headers=server.headers)
    assert missing.status_code == 404 and "it reported: table.weight" in missing.json()["message"]

    async def over_mcp() -> dict:
        from agent_examples.scripted_agent import connect
        async with connect(f"{server.url}/mcp") as mcp:
            return (await mcp.call_tool("get_embeddings", {"run": "emb-e2e", "rows": 3})).structured_content

    import asyncio
    assert asyncio.run(over_mcp()) == tables
    _assert_people_read_the_table(server)  # and for people, as a table
    fixes = httpx.post(f"{base}/anomalies/{zombie['id']}/propose", headers=server.headers).json()["fixes"]
    assert [f["action"] for f in fixes] == ["embedding_grad_scale"] * 2
    assert fixes[0]["params"]["table"] == "table.weight" and "rows" not in fixes[0]["params"]  # the whole table
    assert fixes[0]["params"]["refresh"] > 0  # its factors follow the rows as they turn noisy
    assert sorted(fixes[1]["params"]["rows"]) == [3, 17, 29]  # only the named rows
    fix_id = fixes[1]["id"]
    assert httpx.post(f"{base}/fixes/{fix_id}/apply", headers=server.headers).json()["status"] == "pending"
    status = _train_until(server, fix_id, lambda s: s not in ("pending",), model, probe, ids, opt, seed=1000)
    assert status["status"] == "applied", status
    # Named rows whose SNR is below the reference are damped (a named row with more signal keeps factor 1).
    assert 1 <= status["after"]["rows"] <= 3 and set(status["after"]["row_ids"]) <= {"3", "17", "29"}
    assert httpx.post(f"{base}/fixes/{fix_id}/revert", headers=server.headers).status_code == 200
    status = _train_until(server, fix_id, lambda s: s == "reverted", model, probe, ids, opt, seed=2000)
    assert status["status"] == "reverted"
    probe.close()
    with server.client() as c:  # deleting the run deletes its tables' reports too
        assert c.delete("/v1/runs/emb-e2e").status_code == 204
    with sqlite3.connect(server.data_dir / "traindx.sqlite") as db:
        assert db.execute("SELECT count(*) FROM embedding_tables WHERE run='emb-e2e'").fetchone() == (0,)


def _assert_people_read_the_table(server) -> None:
    """`traindx embeddings` prints emb-e2e's table, its zombie-like and conflicted rows, and its dead ids."""
    from click.testing import CliRunner
    from diag_server.cli import main
    env = {"TRAINDX_SERVER": server.url, "TRAINDX_TOKEN": server.token}
    out = CliRunner().invoke(main, ["embeddings", "emb-e2e", "--rows", "3"], env=env, catch_exceptions=False).output
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["TABLE", "RANK", "STEP"] and lines[2].split()[:8] == ["table.weight", "0", "80",
                                                                                         "40", "2", "38", "2", "0"]
    assert "SCORE SPREAD" in lines[0] and float(lines[2].split()[9]) > 0  # what a row's score is read against
    at = lines.index("table.weight (rank 0): rows most like zombies, worst first")
    assert sorted(int(line.split()[0]) for line in lines[at + 3:at + 6]) == [3, 17, 29]
    at = _conflicted_heading(lines)
    assert sorted(int(line.split()[0]) for line in lines[at + 3:at + 6]) == [3, 17, 29]
    assert lines[at + 1].split()[:5] == ["ROW", "UPDATES", "RUN", "SCORE", "RUN"]
    assert all(float(line.split()[2]) >= 2 for line in lines[at + 3:at + 6])  # RUN SCORE, at least the floor
    assert "table.weight: never updated: 5, 33" in lines


def _train_until(server, fix_id: str, done, model: Toy, probe: probes.Probe, ids: torch.Tensor,
                 opt: torch.optim.Optimizer, seed: int) -> dict:
    """Train emb-e2e one step at a time, each flushed, until the fix's status is ``done`` (200 steps at most):
    the fix travels on the ingest replies. Its last status."""
    status = None
    for step in range(200):
        train(model, probe, 1, ids=ids, zombies={3, 17, 29}, opt=opt, seed=seed + step)
        probe.flush()
        status = httpx.get(f"{server.url}/v1/runs/emb-e2e/fixes/{fix_id}", headers=server.headers).json()
        if done(status["status"]):
            break
        time.sleep(0.05)
    return status


def test_a_report_from_a_probe_before_run_score_still_shows_its_conflicted_rows(server) -> None:
    """A job on a probe from before run_score (2026-12-01) ranked the conflicted list by run_noise and sent no
    run_score: the server stores its reports as they came, and the table for people shows the rows whose
    run_noise is past the floor, as that probe meant, not an empty list."""
    torch.manual_seed(0)
    model = Toy(rows=40, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, interval=20)
    train(model, probe, 201, ids=torch.arange(40), zombies={3, 17, 29}, opt=opt)
    probe.close()
    for b in sink.batches:  # as the older probe sent them
        for ev in b["events"]:
            for r in ev.get("rows", []) if ev["kind"] == "tensor_stats" else []:
                for c in r.get("embedding", {}).get("conflicted", []):
                    del c["run_score"]
        b["run"] = "emb-old"
        r = httpx.post(f"{server.url}/v1/ingest", json=b, headers=server.headers)
        assert r.status_code == 200, r.text
    listed = summaries(sink)[-1][1]["embedding"]["conflicted"]
    past = sorted(c["row"] for c in listed if c["run_noise"] >= 2)
    assert {3, 17, 29} <= set(past)
    from click.testing import CliRunner
    from diag_server.cli import main
    env = {"TRAINDX_SERVER": server.url, "TRAINDX_TOKEN": server.token}
    lines = CliRunner().invoke(main, ["embeddings", "emb-old"], env=env, catch_exceptions=False).output.splitlines()
    at = _conflicted_heading(lines)
    shown = [line.split() for line in lines[at + 3:at + 3 + len(past)]]
    assert sorted(int(r[0]) for r in shown) == past and all(r[2] == "-" for r in shown)  # no run_score: "-"


@pytest.mark.parametrize("how", ["tied", "output", "untied"])
def test_a_tied_table_through_a_real_server(server, how: str) -> None:
    """What a person reads of a language model whose data never holds the last tenth of the vocabulary: with
    the output projection its token table (tied, or the table used as the output matrix), an info saying the
    rows learn as outputs; untied, an info saying the table is sized past the data's ids. Advice either way:
    no fix to apply."""
    torch.manual_seed(0)
    model = TinyLM(40, tie=how == "tied", output=how == "output")
    run = f"emb-{how}"
    probe = probes.attach(model, torch.optim.Adam(model.parameters(), lr=0.01), server=server.url, run=run,
                          collections={"embeddings": 20})
    train_lm(model, probe, 61, inputs=36)
    assert probe.flush()
    probe.close()
    base = f"{server.url}/v1/runs/{run}"
    learns = how != "untied"
    [dead] = [a for a in httpx.get(f"{base}/anomalies", headers=server.headers).json()["anomalies"]
              if a["kind"] == "dead_embedding"]
    assert dead["severity"] == "info" and dead["evidence"]["learns_outside_lookups"] is learns
    assert dead["evidence"]["tied_to"] == (["lm_head.weight"] if how == "tied" else [])
    assert dead["evidence"]["past_data_range"] is True  # rows 36-39: the vocabulary's last ids
    [advice] = httpx.post(f"{base}/anomalies/{dead['id']}/propose", headers=server.headers).json()["fixes"]
    assert advice["action"] == "advice"  # nothing to up-weight
    assert {"tied": "tied to lm_head.weight", "output": "also learns outside its lookups",
            "untied": "exactly its last ids (36-39)"}[how] in advice["rationale"]
    [table] = httpx.get(f"{base}/embeddings", headers=server.headers).json()["tables"]
    assert table["summary"]["learns_outside_lookups"] is learns and table["summary"]["dead_ids"] == [36, 37, 38, 39]
    assert table["summary"]["tied_to"] == (["lm_head.weight"] if how == "tied" else [])
    from click.testing import CliRunner
    from diag_server.cli import main
    env = {"TRAINDX_SERVER": server.url, "TRAINDX_TOKEN": server.token}
    out = CliRunner().invoke(main, ["embeddings", run], env=env, catch_exceptions=False).output
    what = {"tied": "never looked up (tied to lm_head.weight, they learn through it)",
            "output": "never looked up (the weight learns outside its lookups, they learn there)",
            "untied": "never updated (the table's last ids: it is sized past the data's)"}[how]
    assert f"wte.weight: {what}: 36, 37, 38, 39" in out


def test_a_recommender_with_the_default_collections_flags_its_toggling_items_and_nothing_else(session_server) -> None:
    """The recorded agent session's job (agent_examples.jobs.recommender_job): every rule of the server runs
    on a matrix factorisation with the probe's default collections; the healthy run raises nothing, and the
    faulty one raises zombie rows on its item tables only, naming only the items whose labels toggle."""
    from agent_examples.jobs import recommender_job

    url = session_server.url
    kinds = {}
    for run, toggling in (("rec-healthy", 0), ("rec-toggling", 8)):
        result = recommender_job(run=run, toggling=toggling, pace=0, probe_kwargs={"server": url})
        assert result.error is None
        kinds[run] = httpx.get(f"{url}/v1/runs/{run}/anomalies", headers=session_server.headers).json()["anomalies"]
    assert kinds["rec-healthy"] == []
    flagged = kinds["rec-toggling"]
    assert flagged and {a["kind"] for a in flagged} == {"zombie_embedding"}
    assert {a["tensors"][0] for a in flagged} <= {"item.weight", "item_bias.weight"}
    assert all(a["severity"] in ("warning", "critical") for a in flagged)  # zombies that stand out, not a tail
    assert all(a["evidence"]["stand_out"] for a in flagged if a["tensors"] == ["item.weight"])
    named = {int(r) for a in flagged for r in a["evidence"]["rows"]}
    assert len(named) >= 4 and named <= set(range(8))
    # Both item tables name mostly the same items: the diagnosis calls it one problem, not two.
    ids = [{int(r) for r in a["evidence"]["rows"]} for a in flagged]
    if len(ids) == 2 and len(ids[0] & ids[1]) >= 0.5 * min(map(len, ids)):
        causes = httpx.get(f"{url}/v1/runs/rec-toggling/diagnosis", headers=session_server.headers).json()["causes"]
        assert len(causes) == 1 and len(causes[0]["consequences"]) == 1
