"""A table's report: the lists and figures it packs, the same from the kernel and from torch, and decoded."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import probes.stats
from probes.embeddings.report import ROW_KEYS, decode, pack
from tests.embedding_jobs import Toy, attach, summaries, table_state, train


@pytest.mark.skipif(probes.stats._fastats is None, reason="the native kernel is not built (no C compiler at install)")
def test_the_kernel_builds_the_listed_rows_as_the_python_decoder_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A report's listed rows become the event's dicts in the kernel (row_dicts) or in Python: the same
    dicts, row ids and touches as ints, a non-finite statistic as None; malformed arguments are refused."""
    kernel, nan, inf = probes.stats._fastats, float("nan"), float("inf")
    zombies = [[3.0, 9.0], [40.0, 21.0], [0.5, 0.25], [-0.3, nan], [0.04, 0.05], [3.5, inf]]
    rarest = [[12.0], [1.0], [0.0], [0.0], [-inf], [0.0]]
    raw = [2.0, 0.0, 2.0, 1.0, 2.0, 21.0, 0.0, 0.0, 0.0, 0.4, 0.1, 0.6] + [c for col in zombies for c in col] \
        + [c for col in rarest for c in col] + [4.0, 0.1, 2.0] + [5.0] + [nan] + [8.0, 30.0, 1.5, nan, 2.5, 4.0]
    plan = {"window": 3, "nonfinite": 0, "zombies": 2, "rarest": 1, "dead": 1, "conflicted": 1}
    t = SimpleNamespace(rows=20, dim=2, sparse=False, padding=torch.empty(0), tied=(), outside=False)
    native = decode("w", t, raw, plan, 7)
    monkeypatch.setattr(probes.stats, "_fastats", None)
    python = decode("w", t, raw, plan, 7)
    assert native == python
    assert native["embedding"]["conflicted"] == [{"row": 8, "touches": 30, "noise": 1.5, "run_noise": None,
                                                  "run_score": 2.5, "reports": 4}]
    z = native["embedding"]["zombies"]
    assert z[0] == {"row": 3, "touches": 40, "velocity": 0.5, "consistency": -0.3, "snr": 0.04, "noise": 3.5}
    assert z[1]["consistency"] is None and z[1]["noise"] is None and type(z[1]["row"]) is int
    assert native["embedding"]["rarest"] == [{"row": 12, "touches": 1, "velocity": 0.0, "consistency": 0.0,
                                              "snr": None, "noise": 0.0}]
    assert native["embedding"]["dead_ids"] == [5] and native["embedding"]["noise_spread"] == 0.4
    assert native["embedding"]["score_median"] == 0.1 and native["embedding"]["score_spread"] == 0.6
    with pytest.raises(ValueError, match="six columns"):
        kernel.row_dicts(raw, len(raw) - 5, 1, ROW_KEYS)
    with pytest.raises(TypeError):
        kernel.row_dicts(raw, 0, 1, list(ROW_KEYS))


@pytest.mark.skipif(probes.stats._fastats is None, reason="the native kernel is not built (no C compiler at install)")
@pytest.mark.parametrize("rows,dim", [(300, 16), (300, 1), (60, 3)], ids=["sketched", "bias", "small"])
def test_the_native_report_lists_what_the_torch_report_lists(rows: int, dim: int) -> None:
    """The kernel's report (report_rows) and the torch operations it replaces give the same summary from
    the same statistics: counts, medians, the zombie, rarest, conflicted, non-finite and dead lists in the same order
    (ties to the lower row id), their columns; over two reports, the second ranking the first's lists.
    A sketched table, a bias table, and one of fewer rows than a list holds (no collapse statistics)."""
    import copy

    torch.manual_seed(0)
    model = Toy(rows=rows, dim=dim)
    model.table.padding_idx = 7
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, _ = attach(model, opt, interval=10**6)
    t = table_state(probe)
    assert t.native
    gen = torch.Generator().manual_seed(1)
    zombies = set(range(0, 40, 3))
    used = torch.arange(rows)[torch.arange(rows) % 5 != 4]  # one row in five is never looked up: dead

    def run(steps: int) -> None:
        for _ in range(steps):  # a batch of popular and rare rows
            ids = torch.cat([used[torch.randint(0, min(60, len(used)), (40,), generator=gen)],
                             used[torch.randint(0, len(used), (20,), generator=gen)], torch.tensor([7])])
            train(model, probe, 1, ids=ids, zombies=zombies, opt=opt, seed=int(torch.randint(0, 10**6, (1,), generator=gen)))

    for steps, nan_row in ((120, 11), (60, 23)):
        run(steps)
        with torch.no_grad():
            model.table.weight[nan_row] = float("nan")  # goes non-finite at its next touch
        run(5)
        twin = copy.deepcopy(t)
        twin.native = False  # the torch operations, on a copy of the same statistics and lists
        want, plan_t = pack(twin)
        got, plan_n = pack(t)
        a = decode("w", twin, want.tolist(), plan_t, 0)["embedding"]
        b = decode("w", t, got.tolist(), plan_n, 0)["embedding"]
        assert plan_t == plan_n and b["window_touched_rows"] > rows // 3
        for key in ("zombies", "rarest", "conflicted"):
            assert [r["row"] for r in a[key]] == [r["row"] for r in b[key]]
            for ra, rb in zip(a[key], b[key]):
                assert ra == pytest.approx(rb, rel=1e-5, abs=1e-6)
        for key in ("dead_ids", "nonfinite_ids", "touched_rows", "never_updated", "nonfinite_rows", "eligible_rows",
                    "median_touches", "negative_consistency_rows", "sampled_rows"):
            assert a[key] == b[key], key
        for key in ("noise_spread", "score_median", "score_spread"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
        assert a["noise_spread"] > 0 and a["score_spread"] > 0
        for key in ("effective_rank", "mean_cosine"):  # None below 4 columns
            assert (a[key] is None) == (b[key] is None) == (dim < 4)
            assert a[key] is None or a[key] == pytest.approx(b[key])
        assert len(b["zombies"]) >= 5 and b["nonfinite_ids"] and 4 in b["dead_ids"] and 7 not in b["dead_ids"]
        assert b["conflicted"] and torch.allclose(twin.run_record, t.run_record, rtol=1e-5, atol=1e-6)  # the run's record
        assert t.changed.flags.sum() == 0 and t.changed.n == 0  # the window starts again
    probe.close()


def test_a_report_lists_the_worst_rows_and_every_row_past_the_floor(path: str) -> None:
    """A report lists, of each kind, the worst LISTED_ROWS rows and every further row past its floor (a zombie
    score ln(noise) - consistency of at least ln 2; touches under 2% of the median), up to TOP_ROWS: every row
    the rules could name, and no healthy filler. Of 600 rows, 60 toggle and 40 are looked up once in 100
    steps; without them, each list holds the worst 32."""
    from probes.embeddings import LISTED_ROWS, RARE_FLOOR, ZOMBIE_FLOOR

    def last_report(zombies: set[int], rare: torch.Tensor) -> dict:
        torch.manual_seed(0)
        model = Toy(rows=600, dim=2)
        probe, sink = attach(model, torch.optim.SGD(model.parameters(), lr=0.05), interval=100)
        common = torch.tensor([i for i in range(600) if i not in set(rare.tolist())])
        train(model, probe, 301, ids=lambda step: torch.cat([common, rare]) if step % 100 == 50 else common,
              zombies=zombies, opt=probe.optimizer)
        probe.close()
        return summaries(sink)[-1][1]["embedding"]

    zombies = set(range(0, 120, 2))
    e = last_report(zombies, torch.arange(500, 540))
    listed = [r["row"] for r in e["zombies"]]
    assert zombies <= set(listed) and len(zombies) <= len(listed) < 256
    assert all(math.log(r["noise"]) - r["consistency"] >= ZOMBIE_FLOOR - 1e-6 for r in e["zombies"][LISTED_ROWS:])
    assert sorted(r["row"] for r in e["rarest"]) == list(range(500, 540))
    assert all(r["touches"] < RARE_FLOOR * e["median_touches"] for r in e["rarest"])
    healthy = last_report(set(), torch.arange(0))
    assert len(healthy["zombies"]) == len(healthy["rarest"]) == LISTED_ROWS


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_rows_whose_data_pulled_hard_stay_listed_as_conflicted_once_it_no_longer_does(path: str, sparse: bool) -> None:
    """Rows 0-4 get conflicting targets (+2 and -2 in turn) for 400 steps, then the target the others have for 1200:
    their noise falls back to their peers', and the zombie list lets them go. Their run_noise keeps the record
    of the run, and their run_score its peak while their mean over the run falls; the reports list them first
    as conflicted, every other row below the list's floor (a data conflict the model has since fitted:
    benchmarks/embeddings.py, case b), on both paths, with dense gradients and sparse ones."""
    from probes.embeddings import CONFLICT_FLOOR

    torch.manual_seed(0)
    model = Toy(rows=40, dim=4, sparse=sparse)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, interval=20)
    planted, ids = set(range(5)), torch.arange(40)
    train(model, probe, 400, ids=ids, zombies=planted, opt=opt)  # then as long again as the slow averages remember
    probe.flush()
    during = [r["embedding"] for _, r in summaries(sink)][-1]
    train(model, probe, 1200, ids=ids, opt=opt, seed=1)
    probe.flush()
    last = [r["embedding"] for _, r in summaries(sink)][-1]
    assert {r["row"] for r in during["zombies"][:5]} == planted == {r["row"] for r in during["conflicted"][:5]}
    assert not planted & {r["row"] for r in last["zombies"][:8]}  # their noise now: as their peers'
    assert {r["row"] for r in last["conflicted"][:5]} == planted
    for r in last["conflicted"][:5]:
        assert r["run_noise"] > 3 * r["noise"] and r["run_noise"] > 3 and r["reports"] >= 70 and r["touches"] > 1500
        assert r["run_score"] > 2 * CONFLICT_FLOOR
    assert all(4 * r["run_score"] < last["conflicted"][4]["run_score"] and r["run_noise"] < 1.5
               for r in last["conflicted"][5:])
    then = {r["row"]: r["run_score"] for r in during["conflicted"][:5]}
    assert all(r["run_score"] >= then[r["row"]] for r in last["conflicted"][:5])  # the peak holds
    t = table_state(probe)
    mean = t.run_record[:5, 2] / t.run_record[:5, 1]
    assert (mean < t.run_record[:5, 3] - 0.3).all()  # where a mean over the run would have faded to
    by_row = sorted(last["conflicted"][:5], key=lambda r: r["row"])  # rows 0-4, as the record's
    assert torch.equal(t.conflict_score(torch.arange(5)), torch.tensor([r["run_score"] for r in by_row]))
    assert torch.allclose(t.run_noise(torch.arange(5)).double(),
                          torch.tensor([r["run_noise"] for r in by_row], dtype=torch.float64))
    probe.close()
