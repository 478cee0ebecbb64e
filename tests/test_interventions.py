"""Live fix actions as the job applies them: real training on tiny CPU models, commands through a MemorySink.

Each test feeds the probe a command the way the server's ingest reply does and checks what a user would
notice: the weights, the learning rate or the optimizer changed (or not), and the acknowledgement says so.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

import probes
from probes.rollback import RollbackBuffer

from .conftest import sharded_job


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 1))


def _train(model, opt, probe, sink, steps, *, commands=None, nan_at=None, seed=1):
    """Train on y = sum(x); ``commands`` maps a step to commands the server hands back after it."""
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        if step in (commands or {}):
            sink.commands.extend(commands[step])
            probe.log(step=step, tick=1.0)  # something to send, so that the reply carries the commands back
            probe.flush()
        x = torch.randn(32, 8, generator=g)
        if step == nan_at:
            x[0, 0] = float("nan")
        y = x.sum(1, keepdim=True)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        losses.append(loss.item())
    probe.flush()
    return losses


def _acks(sink, fix_id=None):
    return [e for e in sink.events if e["kind"] == "fix_ack" and (fix_id is None or e["fix_id"] == fix_id)]


def _cmd(fix_id, action, op="apply", **params):
    return {"fix_id": fix_id, "op": op, "action": action, "params": params}


def _attach(model, opt, sink, allow, **kw):
    # A spool directory of its own: a probe replays the spools that dead processes left in its directory,
    # and other tests' leftovers in the shared one could hold up this probe's own deliveries.
    kw.setdefault("spool_dir", tempfile.mkdtemp(prefix="traindx-interventions-"))
    return probes.attach(model, opt, run="t", sink=sink, interval=5, allow=allow, flush_interval=60, **kw)


def test_rollback_restores_the_last_good_snapshot_after_a_nan_batch():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sink = probes.MemorySink()
    probe = _attach(model, opt, sink, {"rollback": {"every": 10}})
    losses = _train(model, opt, probe, sink, 60, nan_at=33, commands={40: [_cmd("f-1", "rollback", before_step=33)]})
    probe.close()
    assert math.isnan(losses[35])  # the bad batch poisoned the weights
    (ack,) = _acks(sink, "f-1")
    assert ack["status"] == "applied"
    # The newest snapshot from before the NaN: the one at step 30 (snapshots at 40 were not finite, never kept).
    assert ack["after"]["restored_step"] == 30 and ack["after"]["skipped_steps"] == ack["step"] - 30
    assert all(math.isfinite(x) for x in losses[ack["step"] + 1:])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0] / 5  # and it went on learning


def test_rollback_keeps_the_current_learning_rate_and_at_most_two_snapshots():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sink = probes.MemorySink()
    probe = _attach(model, opt, sink, {"rollback": {"every": 5}, "set_lr": {}})
    _train(model, opt, probe, sink, 30, commands={20: [_cmd("f-1", "set_lr", lr=5e-4)],
                                                   25: [_cmd("f-2", "rollback")]})
    assert [s.step for s in probe._rollback.snapshots][-1] >= 25 and len(probe._rollback.snapshots) <= 2
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)  # the rollback restored state, not settings
    _train(model, opt, probe, sink, 10, commands={2: [_cmd("f-3", "rollback", settings=True)],
                                                   6: [_cmd("f-4", "rollback", lr=2e-4)]})
    probe.close()
    assert [_acks(sink, f)[0]["status"] for f in ("f-2", "f-3", "f-4")] == ["applied"] * 3
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-4)


def test_rollback_without_snapshots_is_rejected_with_how_to_enable_it():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = probes.MemorySink()
    probe = _attach(model, opt, sink, ["rollback"])  # allowed, but with the default period of 50
    _train(model, opt, probe, sink, 12, commands={5: [_cmd("f-1", "rollback", before_step=0)]})
    probe.close()
    (ack,) = _acks(sink, "f-1")
    assert ack["status"] == "rejected" and "no good snapshot from before step 0" in ack["reason"]
    # A job that did not allow rollback keeps no snapshots at all: no memory, no syncs.
    assert _attach(_model(), None, probes.MemorySink(), ["lr_scale"])._rollback is None


def test_rollback_cannot_be_reverted():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = probes.MemorySink()
    probe = _attach(model, opt, sink, {"rollback": {"every": 2}})
    _train(model, opt, probe, sink, 12, commands={5: [_cmd("f-1", "rollback")], 8: [_cmd("f-1", "rollback", "revert")]})
    probe.close()
    acks = _acks(sink, "f-1")
    assert [a["status"] for a in acks] == ["applied", "failed"] and "cannot be undone" in acks[1]["reason"]


def test_snapshot_is_bounded_and_on_the_host():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    buf = RollbackBuffer(model, opt, every=1, keep=2)
    for step in range(5):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        assert buf.keep(step, torch.tensor(1.0))
    assert [s.step for s in buf.snapshots] == [3, 4]
    # Besides the two newest: the first (step 0); the best (equal losses: the newest) is one of them.
    assert [s.step for s in buf.kept()] == [0, 3, 4]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert buf.nbytes == 3 * 2 * params  # weights + momentum, three times
    assert all(t.device.type == "cpu" for s in buf.kept() for t in s.model.values())
    assert not buf.keep(5, torch.tensor(float("nan")))  # a non-finite loss is never a good snapshot
    with pytest.raises(ValueError):
        RollbackBuffer(model, opt, every=0)


def test_snapshots_from_before_a_long_fault_outlive_the_newest():
    """A fault that went on for longer than the newest snapshots cover: the first state and the best one
    are still there to roll back to, and a rollback older than min_step is refused."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    buf = RollbackBuffer(model, opt, every=1, keep=2)
    losses = [5.0, 2.0, 1.0, 0.5, 1.2, 1.4, 1.3, 1.2]  # learning until step 3, then damaged (< 3x: kept)
    for step, loss in enumerate(losses):
        buf.keep(step, loss)
    assert [s.step for s in buf.kept()] == [0, 3, 6, 7]
    assert buf.latest(before_step=6).step == 3  # the best, from before the damage
    buf.drop_after(2)  # a rollback to step 2 forgets what came after it, the best included
    assert [s.step for s in buf.kept()] == [0] and buf.best.step == 0


def test_rollback_min_step_refuses_to_go_back_too_far():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = probes.MemorySink()
    probe = _attach(model, opt, sink, {"rollback": {"every": 10}})
    _train(model, opt, probe, sink, 40, commands={35: [_cmd("f-1", "rollback", before_step=25, min_step=22)],
                                                   36: [_cmd("f-2", "rollback", before_step=25, min_step=15)]})
    probe.close()
    (refused,), (applied,) = _acks(sink, "f-1"), _acks(sink, "f-2")
    assert refused["status"] == "rejected" and "older than step 22" in refused["reason"]
    assert applied["status"] == "applied" and applied["after"]["restored_step"] == 20


def test_relative_clip_follows_the_gradient_norm_down():
    """A clip relative to the running median keeps a spike at the size of an ordinary step, also once the
    ordinary steps are far below the cap; until there is a history, the cap holds."""
    from probes.fixes import Target
    from probes.registry import apply

    model = torch.nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    apply("grad_clip", Target(model, opt, None), {"relative": 1.0, "max_norm": 10.0, "window": 20}, {}, "f-1")
    norms = []
    for step in range(30):
        spike = step % 10 == 0  # the first step too: no history yet
        model.weight.grad = torch.full_like(model.weight, 100.0 if spike else 0.1)  # norm 200 or 0.2
        opt.step()
        norms.append(model.weight.grad.norm().item())
    assert norms[0] == pytest.approx(10.0, rel=1e-3)  # only the cap to go by
    assert norms[10] == pytest.approx(0.2, rel=1e-3) and norms[20] == pytest.approx(0.2, rel=1e-3)
    assert norms[5] == pytest.approx(0.2, rel=1e-3)  # ordinary steps are left alone


def _dead_model():
    model = _model()
    with torch.no_grad():
        model[2].bias.fill_(-10.0)  # the second hidden layer's ReLUs all die
    return model


@pytest.mark.parametrize("target", ["3", "2"])  # the ReLU module, or the Linear that feeds it
def test_reinit_dead_units_finds_them_on_the_next_forward_and_revives_them(target):
    model = _dead_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sink = probes.MemorySink()
    probe = _attach(model, opt, sink, ["reinit_dead_units"])
    losses = _train(model, opt, probe, sink, 80, commands={10: [_cmd("f-1", "reinit_dead_units", module=target)]})
    probe.close()
    (ack,) = _acks(sink, "f-1")
    assert ack["status"] == "applied", ack
    assert ack["before"]["module"] == "2" and ack["before"]["dead_fraction"] == 1.0
    assert ack["after"] == {"module": "2", "reinitialised": 16, "of": 16}
    assert (model[2].bias.abs() < 1).all()
    assert (model[2](torch.relu(model[0](torch.randn(256, 8)))) > 0).any(0).float().mean() > 0.5
    assert min(losses[-10:]) < 0.5 * min(losses[:10])  # it learns again


def test_reinit_only_touches_dead_units_and_can_be_reverted():
    model = _model()
    with torch.no_grad():
        model[0].bias[:4] = -100.0  # four dead units of sixteen
    before = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: only the fix changes the weights
    sink = probes.MemorySink()
    probe = _attach(model, opt, sink, {"reinit_dead_units": {"max_fraction": 0.5}})
    _train(model, opt, probe, sink, 12, commands={3: [_cmd("f-1", "reinit_dead_units", module="1")]})
    assert _acks(sink, "f-1")[0]["before"]["units"] == [0, 1, 2, 3]
    assert not torch.equal(model[0].weight[:4], before[:4]) and torch.equal(model[0].weight[4:], before[4:])
    _train(model, opt, probe, sink, 5, commands={1: [_cmd("f-1", "reinit_dead_units", "revert")]})
    probe.close()
    assert _acks(sink, "f-1")[-1]["status"] == "reverted"
    assert torch.equal(model[0].weight, before) and (model[0].bias[:4] == -100).all()


def test_reinit_bounds_and_bad_names_are_rejected():
    model = _dead_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = probes.MemorySink()
    probe = _attach(model, opt, sink, {"reinit_dead_units": {"max_fraction": 0.5}})
    _train(model, opt, probe, sink, 8, commands={1: [_cmd("f-1", "reinit_dead_units", module="3"),
                                                     _cmd("f-2", "reinit_dead_units", module="nope"),
                                                     _cmd("f-3", "reinit_dead_units", module="2", units=[99])]})
    probe.close()
    reasons = {a["fix_id"]: (a["status"], a["reason"]) for a in _acks(sink)}
    assert reasons["f-1"][0] == "rejected" and "more than the job allows" in reasons["f-1"][1]
    assert reasons["f-2"] == ("rejected", "no module named 'nope' in the model")
    assert reasons["f-3"][0] == "rejected" and "no unit [99]" in reasons["f-3"][1]


def test_unfreeze_adds_a_layer_left_out_of_the_optimizer_and_revert_removes_it():
    model = _model()
    left_out = model[2].weight.detach().clone()
    opt = torch.optim.SGD([*model[0].parameters(), *model[4].parameters()], lr=0.01)
    sink = probes.MemorySink()
    probe = _attach(model, opt, sink, ["unfreeze"])
    _train(model, opt, probe, sink, 10, commands={3: [_cmd("f-1", "unfreeze", pattern=["2.weight", "2.bias"])]})
    (ack,) = _acks(sink, "f-1")
    assert ack["after"]["added_to_optimizer"] == ["2.weight", "2.bias"] and ack["after"]["group_lr"] == 0.01
    assert not torch.equal(model[2].weight, left_out) and len(opt.param_groups) == 2
    _train(model, opt, probe, sink, 3, commands={0: [_cmd("f-1", "unfreeze", "revert")]})
    probe.close()
    assert _acks(sink, "f-1")[-1]["status"] == "reverted" and len(opt.param_groups) == 1


def test_unfreeze_a_frozen_layer():
    model = _model()
    model[2].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = probes.MemorySink()
    probe = _attach(model, opt, sink, ["unfreeze"])
    frozen = model[2].weight.detach().clone()
    _train(model, opt, probe, sink, 8, commands={2: [_cmd("f-1", "unfreeze", pattern="2")]})
    probe.close()
    (ack,) = _acks(sink, "f-1")
    assert ack["status"] == "applied" and ack["before"]["params"] == ["2.weight", "2.bias"]
    assert "added_to_optimizer" not in ack["after"]  # it was in the optimizer all along
    assert model[2].weight.requires_grad and not torch.equal(model[2].weight, frozen)



def test_on_a_sharded_model_fixes_that_need_an_all_reduce_are_refused_with_what_to_do_instead():
    """FSDP2 (a real fully_shard): clipping by the global norm and skipping non-finite steps would run
    collectives at a step each rank picks for itself, so the job refuses them and says what to put in the
    loop instead; clipping each value needs no other rank."""
    acks = sharded_job("""
        from tests.test_interventions import _cmd, _model, _train
        model = _model()
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sink = probes.MemorySink()
        probe = probes.attach(model, opt, run="sharded", sink=sink, interval=5, flush_interval=60,
                              allow=["grad_clip", "skip_nonfinite"], spool_dir=tempfile.mkdtemp())
        _train(model, opt, probe, sink, 6, commands={2: [_cmd("f-1", "grad_clip", max_norm=1.0),
                                                         _cmd("f-2", "grad_clip", relative=2.0),
                                                         _cmd("f-3", "skip_nonfinite"),
                                                         _cmd("f-4", "grad_clip", clip_value=0.5)]})
        probe.close()
        out.update({e["fix_id"]: [e["status"], e.get("reason") or ""] for e in sink.events if e["kind"] == "fix_ack"})
    """)
    for fix_id in ("f-1", "f-2"):
        assert acks[fix_id][0] == "rejected" and "sharded across ranks (FSDP2)" in acks[fix_id][1]
        assert "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)" in acks[fix_id][1]
    assert acks["f-3"][0] == "rejected" and "skip optimizer.step() on every rank" in acks["f-3"][1]
    assert acks["f-4"] == ["applied", ""]
