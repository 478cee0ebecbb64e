"""The embedding rules (zombie_embedding, dead_embedding, embedding_collapse) on reports a real probe sent,
and on reports made by hand to pin one threshold."""

from __future__ import annotations

import math

import pytest
import torch

import probes
from diag_server.fixes import embedding_scale_params
from diag_server.rules import Observations
from diag_server.rules.embeddings import DeadEmbedding, EmbeddingCollapse, ZombieEmbedding
from schemas.enums import AnomalyKind, Severity
from tests.embedding_jobs import TinyLM, Toy, attach, summaries, train, train_lm


def obs_of(sink: probes.MemorySink) -> Observations:
    obs = Observations(run="emb", interval=10)
    for step, row in summaries(sink):
        obs.stats.setdefault("embeddings", {}).setdefault(step, []).append(row)
    return obs


def test_zombie_rule_names_the_rows_whose_updates_reverse(path: str) -> None:
    torch.manual_seed(0)
    model = Toy(rows=40, dim=2)
    probe, sink = attach(model, torch.optim.SGD(model.parameters(), lr=0.05), interval=20)
    train(model, probe, 81, ids=torch.arange(40), zombies={3, 17, 29}, opt=probe.optimizer)
    probe.close()
    found = ZombieEmbedding().observe({}, obs_of(sink))
    assert len(found) == 1
    f = found[0]
    assert f.kind == AnomalyKind.zombie_embedding and f.tensors == ["table.weight"]
    assert sorted(int(r) for r in f.evidence["rows"]) == [3, 17, 29]
    assert f.evidence["fraction"] == pytest.approx(3 / 40)

    torch.manual_seed(0)
    model = Toy(rows=40, dim=2)
    probe, sink = attach(model, torch.optim.SGD(model.parameters(), lr=0.05), interval=20)
    train(model, probe, 81, ids=torch.arange(40), opt=probe.optimizer)
    probe.close()
    assert ZombieEmbedding().observe({}, obs_of(sink)) == []


@pytest.mark.parametrize("setting", ["plain", "l2", "nan"])
def test_dead_rule_names_never_updated_rows_under_l2_and_after_nan(setting: str, path: str) -> None:
    torch.manual_seed(0)
    model = Toy(rows=30, dim=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    probe, sink = attach(model, opt, interval=20)
    looked_up = torch.tensor([i for i in range(30) if i not in (4, 9, 22)])
    gen = torch.Generator().manual_seed(0)
    for step in range(61):
        ids = looked_up[torch.randint(0, len(looked_up), (16,), generator=gen)]
        loss = ((model(ids) - 1.0) ** 2).mean()
        if setting == "l2":
            loss = loss + 1e-3 * (model.table.weight ** 2).sum()  # every row gets a gradient
        if setting == "nan" and step == 45:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
    probe.close()
    found = DeadEmbedding().observe({}, obs_of(sink))
    assert len(found) == 1
    assert sorted(int(r) for r in found[0].evidence["rows"]) == [4, 9, 22]
    e = summaries(sink)[-1][1]["embedding"]
    # an L2 term gives every row a gradient, along the row itself: not learning outside the lookups
    assert found[0].severity == Severity.warning and not found[0].evidence["learns_outside_lookups"]
    assert "learns_outside_lookups" not in e
    if setting == "nan":
        assert e["nonfinite_rows"] > 0 and not set(e["nonfinite_ids"]) & {4, 9, 22}
        assert found[0].evidence["nonfinite_rows"] == e["nonfinite_rows"]
    else:
        assert e["nonfinite_rows"] == 0


@pytest.mark.parametrize("how", ["tied", "output", "untied"])
def test_rows_of_a_tied_table_never_looked_up_are_said_to_learn_through_the_tie(how: str, path: str) -> None:
    # Tokens 30-39 never appear as inputs. Tied to the output projection, or the table itself used as the
    # output matrix (a full softmax over its ids), their rows still learn (their logits are pushed down every
    # step): an info that says so, and no up-weighting proposed; untied, dead rows.
    torch.manual_seed(0)
    model = TinyLM(40, how == "tied", output=how == "output")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    probe, sink = attach(model, opt, interval=20)
    before = model.wte.weight[30:].detach().clone()
    train_lm(model, probe, 61, inputs=30)
    probe.close()
    learns = how != "untied"
    assert not torch.equal(model.wte.weight[30:], before) if learns else torch.equal(model.wte.weight[30:], before)
    reports = [row["embedding"] for _, row in summaries(sink) if row["name"] == "wte.weight"]
    e = reports[-1]
    assert e["never_updated"] == 10
    assert e.get("tied_to", []) == (["lm_head.weight"] if how == "tied" else [])
    # seen at the first step after the first report, said from the next report on
    assert [r.get("learns_outside_lookups", False) for r in reports] == [False] + [learns] * (len(reports) - 1)
    [found] = DeadEmbedding().observe({}, obs_of(sink))
    assert sorted(int(r) for r in found.evidence["rows"]) == list(range(30, 40))
    assert found.evidence["learns_outside_lookups"] == learns
    if how == "tied":
        assert found.severity == Severity.info and found.evidence["tied_to"] == ["lm_head.weight"]
        assert "tied to 'lm_head.weight'" in found.message and "looked up" in found.message
    elif how == "output":
        assert found.severity == Severity.info and found.evidence["tied_to"] == []
        assert "learns outside its lookups" in found.message and "never or almost never looked up" in found.message
    else:  # the vocabulary's last ids: a table sized past the data's ids (a non-suffix is a warning: above)
        assert found.severity == Severity.info and "never or almost never updated" in found.message
        assert found.evidence["past_data_range"] and "the table's last ids (30-39)" in found.message
    assert (embedding_scale_params(found.kind, {**found.evidence, "rare_rows": 1}) is None) == learns


@pytest.mark.parametrize("unused", ["last", "middle"])
def test_rows_never_updated_that_are_the_tables_last_ids_are_a_table_sized_past_the_data(unused: str, path: str) -> None:
    # A position table of 32 rows fed sequences of 24 (or a vocabulary padded to a round size): its last 8
    # rows are never looked up, by design: an info. The same 8 rows in the middle of the ids: a warning.
    torch.manual_seed(0)
    model = Toy(rows=32, dim=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    probe, sink = attach(model, opt, interval=20)
    used = torch.tensor([i for i in range(32) if not (24 <= i if unused == "last" else 10 <= i < 18)])
    train(model, probe, 61, ids=used, opt=opt)
    probe.close()
    [found] = DeadEmbedding().observe({}, obs_of(sink))
    assert found.evidence["never_updated"] == 8 and found.evidence["past_data_range"] == (unused == "last")
    if unused == "last":
        assert found.severity == Severity.info and "the table's last ids (24-31)" in found.message
    else:
        assert found.severity == Severity.warning and "Cold-start ids" in found.message


def test_dead_rule_waits_for_enough_updates_and_spares_a_healthy_table() -> None:
    torch.manual_seed(0)
    model = Toy(rows=10, dim=4)
    probe, sink = attach(model, torch.optim.SGD(model.parameters(), lr=0.01), interval=5)
    train(model, probe, 6, ids=torch.arange(5), opt=probe.optimizer)  # 6 updates: too early to judge
    assert DeadEmbedding().observe({}, obs_of(sink)) == []
    train(model, probe, 30, ids=torch.arange(10), opt=probe.optimizer)
    probe.close()
    assert DeadEmbedding().observe({}, obs_of(sink)) == []  # every row is updated now


def test_rare_rows_are_a_lower_bound_only_when_the_probe_list_is_full() -> None:
    """The probe lists every row updated under 2% of the median (up to 256): 40 rare rows of a shorter list are
    all of them; 256 listed, all rare, may have been cut."""
    from diag_server.rules.embeddings import LISTED_MAX

    def judge(n: int) -> dict:
        rarest = [{"row": i, "touches": 1, "velocity": 0.0, "consistency": 0.0, "snr": 0.0, "noise": 1.0}
                  for i in range(n)]
        summary = {"rows": 10_000, "median_touches": 500.0, "tracked_steps": 600, "rarest": rarest}
        [f] = DeadEmbedding().observe({}, Observations(run="r", stats={"embeddings": {600: [
            {"name": "t.weight", "embedding": summary}]}}))
        return f.evidence

    assert judge(40)["rare_rows"] == 40 and not judge(40)["fraction_is_lower_bound"]
    assert judge(LISTED_MAX)["fraction_is_lower_bound"]


def test_collapse_rule_fires_on_collapsed_rows_only() -> None:
    for collapsed in (True, False):
        torch.manual_seed(0)
        model = Toy(rows=200, dim=16)
        if collapsed:
            with torch.no_grad():
                model.table.weight.copy_(torch.randn(16) + 0.01 * torch.randn(200, 16))
        probe, sink = attach(model, torch.optim.SGD(model.parameters(), lr=1e-4), interval=5)
        train(model, probe, 6, ids=torch.arange(200), opt=probe.optimizer)
        probe.close()
        found = EmbeddingCollapse().observe({}, obs_of(sink))
        assert bool(found) == collapsed
        if collapsed:
            assert found[0].evidence["mean_cosine"] > 0.9


def test_zombie_rule_fires_on_rows_past_its_thresholds_in_consecutive_reports_only() -> None:
    """A row whose statistics cross the thresholds for one report is noise in its EMAs; a zombie stays past
    them. The rule names rows that qualify in ``reports`` consecutive reports, remembered across batches
    (the engine's JSON state), and forgets a table that stops being judged."""
    import orjson

    def report(step: int, noisy: set[int], median: float = 100.0) -> Observations:
        rows = [{"row": r, "touches": 200, "velocity": 0.1, "consistency": -0.3 if r in noisy else 0.2,
                 "snr": 0.05, "noise": 4.0 if r in noisy else 1.0} for r in range(10)]
        summary = {"rows": 1000, "median_touches": median, "zombies": sorted(rows, key=lambda r: -r["noise"])}
        return Observations(run="r", stats={"embeddings": {step: [{"name": "t.weight", "embedding": summary}]}})

    rule, state = ZombieEmbedding(), {}

    def see(obs: Observations) -> list:
        nonlocal state
        found = rule.observe(state, obs)
        state = orjson.loads(orjson.dumps(state))  # as the engine keeps it between batches
        return found

    assert see(report(100, {1, 2, 3, 4})) == []  # once: not yet
    found = see(report(200, {2, 3, 4, 5}))  # rows 2, 3, 4 qualify twice running; 1 and 5 once
    assert len(found) == 1 and sorted(found[0].evidence["rows"]) == [2, 3, 4] and found[0].evidence["zombie_rows"] == 3
    assert see(report(300, {6, 7, 8})) == []  # new rows, each once
    assert see(report(400, {6, 7, 8}, median=10.0)) == []  # too early to judge: the table's history is dropped
    assert see(report(500, {6, 7, 8})) == []
    both = report(600, {6, 7, 8})  # two reports in one batch count as two
    both.stats["embeddings"].update(report(700, {6, 7, 8}).stats["embeddings"])
    [found] = see(both)
    assert sorted(found.evidence["rows"]) == [6, 7, 8]
    # every row a warning on the table has named in the run, lowest id first: what the fault has shown so far
    assert found.evidence["rows_named_in_run"] == [2, 3, 4, 6, 7, 8] and found.evidence["rows_named_in_run_count"] == 6
    assert ZombieEmbedding(reports=1).observe({}, report(100, {1, 2, 3}))  # reports=1: one report is enough


def test_zombie_rule_tells_rows_that_stand_out_from_the_tail_the_tables_spread_gives_by_chance() -> None:
    """Ten thousand healthy rows put dozens past 2.5x the median energy per lookup: on a table of that size
    and spread, 30 rows at 3-4x are its tail (an info finding that says so), and 5 rows at 8x stand out of
    it: zombies, named alone, a warning. On a table of 200 rows the same 30 are far more than chance gives.
    A report without the spread (an older probe) is judged on the fixed thresholds."""
    tail = [3.0 + i / 30 for i in range(30)]

    def judge(noises: list[float], eligible: int, spread: float | None):
        rows = [{"row": i, "touches": 200, "velocity": 0.1, "consistency": -0.1, "snr": 0.05, "noise": x}
                for i, x in enumerate(noises)]
        summary = {"rows": max(eligible, len(rows)), "eligible_rows": eligible, "median_touches": 100.0,
                   "noise_spread": spread, "zombies": sorted(rows, key=lambda r: -r["noise"])}
        obs = Observations(run="r", stats={"embeddings": {s: [{"name": "t.weight", "embedding": summary}]
                                                          for s in (100, 200)}})
        [f] = ZombieEmbedding().observe({}, obs)
        return f, sorted(int(r) for r in f.evidence["rows"])

    f, named = judge(tail, 10_000, 0.5)
    assert f.severity == Severity.info and named == list(range(30)) and not f.evidence["stand_out"]
    assert f.evidence["expected_by_chance"] > 30 and "they are its tail, not ids with conflicting targets" in f.message
    f, named = judge(tail + [8.0] * 5, 10_000, 0.5)
    assert f.severity == Severity.warning and named == list(range(30, 35)) and f.evidence["past_thresholds"] == 35
    assert f.evidence["least_noise"] == 8.0 and f.evidence["expected_by_chance"] < 1 and "by chance" in f.message
    for eligible, spread in ((200, 0.5), (10_000, None)):
        f, named = judge(tail, eligible, spread)
        assert f.severity != Severity.info and f.evidence["stand_out"] and named == list(range(30))


def test_zombie_rule_reads_a_rows_reversal_as_well_as_its_energy_against_the_table() -> None:
    """The chance test reads the zombie score (ln(noise) - consistency, as the probe ranks the rows) against
    the table's spread of scores: of rows pulled equally hard (3-4x the median), 30 whose successive
    gradients barely disagree (-0.05, as a healthy vector row's) are the tail of a 10,000-row table, and 5
    whose updates keep reversing (-0.8: a bias row with toggling labels) stand out of it. From the
    energy alone (a probe that sends no score spread) the two cannot be told apart."""
    def judge(spreads: dict):
        rows = [{"row": i, "touches": 200, "velocity": 0.1, "consistency": -0.8 if i >= 30 else -0.05, "snr": 0.05,
                 "noise": 3.0 + (i % 30) / 30} for i in range(35)]
        summary = {"rows": 10_000, "eligible_rows": 10_000, "median_touches": 100.0, **spreads,
                   "zombies": sorted(rows, key=lambda r: r["consistency"] - math.log(r["noise"]))}
        obs = Observations(run="r", stats={"embeddings": {s: [{"name": "t.weight", "embedding": summary}]
                                                          for s in (100, 200)}})
        [f] = ZombieEmbedding().observe({}, obs)
        return f, sorted(int(r) for r in f.evidence["rows"])

    f, named = judge({"noise_spread": 0.5, "score_median": 0.0, "score_spread": 0.5})
    assert f.severity == Severity.warning and named == list(range(30, 35)) and f.evidence["score_spread"] == 0.5
    assert f.evidence["past_thresholds"] == 35 and f.evidence["expected_by_chance"] < 2.5
    assert "zombie scores" in f.message
    f, named = judge({"noise_spread": 0.5})
    assert f.severity == Severity.info and named == list(range(35))
    f, named = judge({"score_spread": 0.5})  # a spread without its median (and no noise_spread): the thresholds
    assert f.severity == Severity.warning and named == list(range(35)) and f.evidence["expected_by_chance"] is None


def test_rules_ignore_other_collections_and_round_trip_state() -> None:
    obs = Observations(run="r", stats={"weights": {0: [{"name": "w", "norm": 1.0}]}})
    for rule in (ZombieEmbedding(), DeadEmbedding(), EmbeddingCollapse()):
        assert rule.observe(rule.initial_state(), obs) == []
        assert rule.describe()["params"]  # every threshold is documented
