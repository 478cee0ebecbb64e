"""The live fix embedding_grad_scale: it damps the rows its factors name, refreshes them, reverts, refuses."""

from __future__ import annotations

import pytest
import torch

import probes
import probes.embeddings.action
from probes.embeddings import NOISE_SNR
from tests.embedding_jobs import Toy, attach, table_state, toggling_targets, train


def test_fix_scales_the_affected_rows_updates_and_reverts() -> None:
    torch.manual_seed(0)
    model = Toy(rows=12, dim=2)
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    probe, sink = attach(model, opt, allow={"embedding_grad_scale": {"min_factor": 0.05}})
    ids = torch.arange(12)
    train(model, probe, 40, ids=ids, zombies={2, 7}, opt=opt)
    t = table_state(probe)
    sink.commands.append({"fix_id": "f-1", "action": "embedding_grad_scale",
                          "params": {"table": "table.weight", "rows": [2, 7], "min_factor": 0.1}})
    probe.flush()

    def one_step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 + step)
        target = toggling_targets(step, 12, {2, 7}, gen)
        w0 = model.table.weight.detach().clone()
        loss = ((model(ids) - target) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        grad = model.table.weight.grad.detach().clone()
        opt.step()
        probe.step(loss=loss)
        return model.table.weight.detach() - w0, grad

    one_step(40)  # the command is applied at this step boundary, from the statistics as they are then
    probe.flush()
    expected = torch.ones(12)
    snr = t.snr()
    ref = min(float(snr[t.eligible()].median()), NOISE_SNR)
    for r in (2, 7):
        expected[r] = float((snr[r] / ref).clamp(0.1, 1.0))
    assert expected[2] < 0.5 and expected[7] < 0.5  # zombie rows: their gradient cancels, they are damped
    acks = [e for b in sink.batches for e in b["events"] if e["kind"] == "fix_ack"]
    assert acks and acks[-1]["status"] == "applied", acks
    assert acks[-1]["after"]["rows"] == 2 and acks[-1]["after"]["row_ids"] == ["2", "7"]
    delta, grad = one_step(41)
    assert torch.allclose(delta, -lr * grad * expected[:, None], atol=1e-7)
    sink.commands.append({"fix_id": "f-1", "op": "revert", "action": "embedding_grad_scale"})
    probe.flush()
    one_step(42)
    probe.flush()
    acks = [e for b in sink.batches for e in b["events"] if e["kind"] == "fix_ack"]
    assert acks[-1]["status"] == "reverted"
    delta, grad = one_step(43)
    assert torch.allclose(delta, -lr * grad, atol=1e-7)  # every row takes its full step again
    probe.close()


def test_fix_with_refresh_damps_a_row_that_turns_noisy_after_it_was_applied() -> None:
    """refresh=N recomputes the factors every N optimizer steps from the rows' statistics then: a row that
    was healthy when the fix was applied, and whose target starts toggling later, is damped from then on."""
    torch.manual_seed(0)
    model = Toy(rows=12, dim=2)
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    probe, sink = attach(model, opt, allow=["embedding_grad_scale"])
    ids = torch.arange(12)
    train(model, probe, 40, ids=ids, zombies={2}, opt=opt)
    sink.commands.append({"fix_id": "f-1", "action": "embedding_grad_scale",
                          "params": {"table": "table.weight", "rows": [2, 7], "min_factor": 0.1, "refresh": 10}})
    probe.flush()
    ratios = []  # row 7's step over its full step, after each optimizer step
    for step in range(40, 200):
        gen = torch.Generator().manual_seed(100 + step)
        target = toggling_targets(step, 12, {2, 7}, gen)  # from now on row 7 toggles too
        w0 = model.table.weight.detach().clone()
        loss = ((model(ids) - target) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        full = -lr * model.table.weight.grad[7].detach().clone()
        opt.step()
        probe.step(loss=loss)
        ratios.append(float((model.table.weight.detach()[7] - w0[7]).norm() / full.norm()))
        if step == 40:
            probe.flush()
    probe.close()
    ack = [e for b in sink.batches for e in b["events"] if e["kind"] == "fix_ack"][-1]
    assert ack["status"] == "applied" and ack["after"]["row_ids"] == ["2"] and ack["after"]["refresh"] == 10
    assert ratios[1:10] == pytest.approx([1.0] * 9)  # healthy when applied: its full step, until the first refresh
    assert ratios[-1] < 0.5  # noisy since: damped, by the factor its measured SNR gives
    changes = [i for i in range(1, len(ratios)) if abs(ratios[i] - ratios[i - 1]) > 1e-6]
    # The fix is applied at step 40's boundary; its factors change only every 10th step after.
    assert changes and all(i % 10 == 0 for i in changes)


def test_fix_on_a_sparse_table_scales_the_rows_the_batch_touched_and_leaves_the_others() -> None:
    torch.manual_seed(0)
    model = Toy(rows=12, dim=2, sparse=True)
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    probe, sink = attach(model, opt, allow=["embedding_grad_scale"])
    train(model, probe, 40, ids=torch.arange(12), zombies={2, 7}, opt=opt)
    sink.commands.append({"fix_id": "f-1", "action": "embedding_grad_scale",
                          "params": {"table": "table.weight", "rows": [2, 7], "min_factor": 0.1}})
    probe.flush()
    train(model, probe, 1, ids=torch.arange(12), zombies={2, 7}, opt=opt, seed=40)  # applied at this boundary
    probe.flush()
    t = table_state(probe)
    snr = t.snr()
    ref = min(float(snr[t.eligible()].median()), NOISE_SNR)
    factor = float((snr[2] / ref).clamp(0.1, 1.0))
    assert factor < 0.5
    ids = torch.arange(7)  # row 2 is looked up, row 7 is not
    w0 = model.table.weight.detach().clone()
    loss = ((model(ids) - 1.0) ** 2).sum()
    opt.zero_grad()
    loss.backward()
    grad = model.table.weight.grad.detach().to_dense()
    opt.step()
    probe.step(loss=loss)
    probe.close()
    delta = model.table.weight.detach() - w0
    expected = -lr * grad
    expected[2] *= factor
    assert torch.allclose(delta, expected, atol=1e-7)  # row 2 damped; rows 0-6 full; row 7 and up unmoved
    assert torch.equal(delta[7:], torch.zeros(5, 2))


def test_a_refresh_that_fails_keeps_the_factors_and_never_reaches_the_loop(monkeypatch) -> None:
    torch.manual_seed(0)
    model = Toy(rows=12, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, allow=["embedding_grad_scale"])
    ids = torch.arange(12)
    train(model, probe, 40, ids=ids, zombies={2}, opt=opt)
    sink.commands.append({"fix_id": "f-1", "action": "embedding_grad_scale",
                          "params": {"table": "table.weight", "rows": [2], "min_factor": 0.1, "refresh": 5}})
    probe.flush()
    train(model, probe, 1, ids=ids, zombies={2}, opt=opt, seed=40)  # applied at this boundary

    def broken(*_, **__):
        raise RuntimeError("statistics unavailable")

    monkeypatch.setattr(probes.embeddings.action, "row_factors", broken)
    w0 = model.table.weight.detach().clone()
    train(model, probe, 20, ids=ids, zombies={2}, opt=opt, seed=41)  # four refreshes fail inside opt.step()
    assert not torch.equal(model.table.weight.detach(), w0)  # training went on
    probe.close()
    texts = [e["text"] for b in sink.batches for e in b["events"] if e["kind"] == "message"]
    assert any("embedding_grad_scale refresh" in t and "statistics unavailable" in t for t in texts), texts


def test_fix_refuses_bad_parameters_and_a_missing_collection() -> None:
    torch.manual_seed(0)
    model = Toy(rows=5, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, allow=["embedding_grad_scale"])
    for fid, params in (("f-1", {"table": "nope"}), ("f-2", {"table": "table.weight", "min_factor": 0.0001}),
                        ("f-3", {"table": "table.weight", "rows": [99]})):
        sink.commands.append({"fix_id": fid, "action": "embedding_grad_scale", "params": params})
    probe.flush()
    train(model, probe, 2, ids=torch.arange(5), opt=opt)
    probe.flush()
    acks = [e for b in sink.batches for e in b["events"] if e["kind"] == "fix_ack"]
    assert [a["status"] for a in acks] == ["rejected"] * 3
    blind, sink = attach(Toy(rows=5, dim=2), None, allow=["embedding_grad_scale"])  # no optimizer, no step seen
    sink.commands.append({"fix_id": "f-4", "action": "embedding_grad_scale", "params": {"table": "table.weight"}})
    blind.flush()
    blind.step()
    blind.close()
    [ack] = [e for b in sink.batches for e in b["events"] if e["kind"] == "fix_ack"]
    assert ack["status"] == "rejected" and "no optimizer that steps 'table.weight' yet" in ack["reason"]
    assert "no embedding table" in acks[0]["reason"] and "bounds" in acks[1]["reason"]
    probe.close()
    bare = probes.attach(model, opt, sink=probes.MemorySink(), collections=["weights"], allow=["embedding_grad_scale"])
    bare._inbox.append({"fix_id": "f-9", "action": "embedding_grad_scale", "params": {"table": "table.weight"}})
    bare.step()
    bare.close()
    ack = [e for b in bare.sender.sink.batches for e in b["events"] if e["kind"] == "fix_ack"][0]
    assert ack["status"] == "rejected" and "embeddings collection" in ack["reason"]
