"""The probe in the training process: correct statistics, bounded work, never raising into the loop."""

from __future__ import annotations

import math
import sys
import time

import pytest
import torch

import probes
from probes.sinks import MemorySink
from probes.stats import rows_from_stats, tensor_stats


def _mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _train(probe, model, opt, steps: int, **scalars) -> None:
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(16, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        probe.step(loss=loss, **scalars)


def test_statistics_match_torch():
    ts = [torch.randn(5, 7), torch.tensor([1.0, float("nan"), 0.0, float("inf")]), torch.zeros(3)]
    rows = rows_from_stats(["a", "b", "c"], tensor_stats(ts).tolist())
    a = rows[0]
    assert a["norm"] == pytest.approx(ts[0].norm().item(), rel=1e-5)
    assert a["mean"] == pytest.approx(ts[0].mean().item(), abs=1e-6)
    assert a["std"] == pytest.approx(ts[0].std(unbiased=False).item(), rel=1e-4)
    assert (a["min"], a["max"]) == pytest.approx((ts[0].min().item(), ts[0].max().item()))
    b = rows[1]
    assert (b["nan_count"], b["inf_count"], b["norm"]) == (1, 1, None)  # a non-finite tensor has no norm
    assert b["mean"] == pytest.approx(0.5) and b["zero_frac"] == pytest.approx(0.25)
    assert rows[2]["zero_frac"] == 1.0


def test_samples_on_schedule_and_sends_every_loss():
    model, opt = _mlp()
    sink = MemorySink()
    with probes.attach(model, opt, run="sched", sink=sink, interval=5) as probe:
        _train(probe, model, opt, 12)
    ev = sink.events
    assert ev[0]["kind"] == "run_start" and ev[-1]["kind"] == "run_end"
    assert ev[0]["total_params"] == sum(p.numel() for p in model.parameters())
    stats_steps = {(e["collection"], e["step"]) for e in ev if e["kind"] == "tensor_stats"}
    for c in ("weights", "gradients", "updates", "activations"):
        assert {s for col, s in stats_steps if col == c} == {0, 5, 10}
    losses = {e["step"]: e["values"]["loss"] for e in ev if e["kind"] == "scalars" and "loss" in e["values"]}
    assert sorted(losses) == list(range(12))
    sys_steps = [e["step"] for e in ev if e["kind"] == "scalars" and "sys/step_time" in e["values"]]
    assert sys_steps == [0, 5, 10]


def test_run_start_records_the_probe_configuration_whole():
    """The configuration was written as two "config" keys of one dict literal: the second hid the first,
    and a job with a GradScaler never said so."""
    model, opt = _mlp()
    sink = MemorySink()
    scaler = torch.amp.GradScaler("cpu")
    with probes.attach(model, opt, run="config", sink=sink, interval=5, scaler=scaler,
                       rules={"loss_spike": False}):
        pass
    config = sink.events[0]["config"]
    assert config["interval"] == 5 and config["amp_scaler"] is True
    assert config["rules.disable"] == ["loss_spike"]
    assert all("local_numel" not in p and "placements" not in p for p in sink.events[0]["params"])  # not sharded


def test_every_form_of_loss_is_reported_as_its_value():
    """Losses of one interval are read together: 0-d float32 tensors, a bfloat16 one, a per-sample
    tensor (reported as its mean), a float and a NaN each come out as the value the loop passed."""
    model, opt = _mlp()
    sink = MemorySink()
    given = [torch.tensor(1.5), torch.tensor(2.25, dtype=torch.bfloat16), torch.tensor([1.0, 2.0, 6.0]), 0.75,
             torch.tensor(float("nan")), torch.tensor(4.0)]
    with probes.attach(model, opt, run="losses", sink=sink, interval=10) as probe:
        for loss in given:
            probe.step(loss=loss)
    got = {e["step"]: e["values"]["loss"] for e in sink.events if e["kind"] == "scalars" and "loss" in e["values"]}
    assert got == {0: 1.5, 1: 2.25, 2: 3.0, 3: 0.75, 4: None, 5: 4.0}


def test_a_loss_is_the_value_it_had_at_its_step_and_the_probe_keeps_no_cpu_loss_tensor():
    """A CPU loss is read at its step (no host sync on the CPU): a loop that reuses the tensor in place
    does not change what was reported, and between reports the probe holds numbers, not tensors (held
    tensors fragment the heap under the step's large temporaries; docs/overhead.md)."""
    model, opt = _mlp()
    sink = MemorySink()
    loss = torch.zeros((), requires_grad=False)
    with probes.attach(model, opt, run="held", sink=sink, interval=10) as probe:
        for i in range(4):
            loss.fill_(float(i) + 0.5)  # the same tensor every step, as a loop with a preallocated loss
            probe.step(loss=loss)
        assert not any(isinstance(v, torch.Tensor) for v in probe._losses)
    got = {e["step"]: e["values"]["loss"] for e in sink.events if e["kind"] == "scalars" and "loss" in e["values"]}
    assert got == {0: 0.5, 1: 1.5, 2: 2.5, 3: 3.5}


def test_unsampled_steps_register_no_hooks():
    model, opt = _mlp()
    with probes.attach(model, opt, run="hooks", sink=MemorySink(), interval=100) as probe:
        _train(probe, model, opt, 1)  # step 0 was sampled; step 1 is not
        assert not model._forward_hooks and not model._forward_pre_hooks
        assert all(not m._forward_hooks for m in model.modules())
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_a_sampled_step_puts_one_hook_on_each_step_boundary_for_all_collections():
    """Activations, updates, system times and the timeline all act at the model's forward and the
    optimizer's step: armed for a sampled step, the model and the optimizer carry one hook per boundary,
    and each collection still gets what it measures there."""
    model, opt = _mlp()
    sink = MemorySink()
    with probes.attach(model, opt, run="phases", sink=sink, interval=5) as probe:
        _train(probe, model, opt, 5)  # steps 0-4: step 5 is armed now
        assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == (1, 1)
        assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == (1, 1)
        _train(probe, model, opt, 1)
        assert not model._forward_pre_hooks and not opt._optimizer_step_pre_hooks
        probe.flush()
    at5 = [e for e in sink.events if e.get("step") == 5]
    kinds = {e["collection"] for e in at5 if e["kind"] == "tensor_stats"}
    assert kinds == {"weights", "gradients", "updates", "activations"}
    acts = next(e for e in at5 if e["kind"] == "tensor_stats" and e["collection"] == "activations")
    assert acts["rows"][0]["name"] == "<input>" and acts["rows"][-1]["name"] == "<output>"
    values = {k: v for e in at5 if e["kind"] == "scalars" for k, v in e["values"].items()}
    assert all(values[k] > 0 for k in ("sys/forward", "sys/backward", "sys/optimizer"))
    spans = {s["name"]: s for e in at5 if e["kind"] == "spans" for s in e["spans"]}
    assert {"step", "forward", "backward", "optimizer"} <= spans.keys()
    assert spans["forward"]["duration"] == pytest.approx(values["sys/forward"])


def test_close_removes_everything_and_two_probes_share_nothing():
    m1, o1 = _mlp()
    m2, o2 = _mlp()
    s1, s2 = MemorySink(), MemorySink()
    p1 = probes.attach(m1, o1, run="one", sink=s1, interval=1, allow=["lr_scale"])
    p2 = probes.attach(m2, o2, run="two", sink=s2, interval=1)
    _train(p1, m1, o1, 3)
    _train(p2, m2, o2, 2)
    p1.close()
    p1.close()  # idempotent
    p2.close()
    assert {b["run"] for b in s1.batches} == {"one"} and {b["run"] for b in s2.batches} == {"two"}
    for m, o in ((m1, o1), (m2, o2)):
        assert all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in m.modules())
        assert not o._optimizer_step_pre_hooks and not o._optimizer_step_post_hooks
    p1.step(loss=1.0)  # after close: a no-op, not an error


def test_a_failure_inside_the_probe_never_reaches_the_loop(caplog):
    model, opt = _mlp()
    sink = MemorySink()
    with probes.attach(model, opt, run="broken", sink=sink, interval=1) as probe:
        probe.step(loss=object())  # not a number: the probe must log and carry on
        _train(probe, model, opt, 3)
    assert any(e["kind"] == "message" and e["level"] == "warning" and "not a number, dropped: loss" in e["text"]
               for e in sink.events)
    assert any(e["kind"] == "scalars" and e["values"].get("loss") is not None for e in sink.events)


def test_a_scalar_with_no_value_is_skipped_and_a_bad_one_never_switches_sampling_off():
    """``val_loss=None`` on the steps without a validation pass means no value: nothing is sent and nothing
    is wrong. A value that is not a number is the job's, not a failure of the probe: it is dropped and said
    once, and however often it comes it never counts towards switching sampling off."""
    model, opt = _mlp()
    sink = MemorySink()
    with probes.attach(model, opt, run="scalars", sink=sink, interval=1) as probe:
        for step in range(3 * probes.probe.MAX_ERRORS):
            val = 0.5 if step % 10 == 0 else None
            _train(probe, model, opt, 1, val_loss=val, note="epoch 1")
            probe.log(acc=None, top5="n/a")
        with probe.mode("eval"):
            probe.step(loss=None, val_loss=None, tag=object())
        assert probe.collections and probe._errors == 0  # still sampling
    vals = [(e["step"], e["values"]["val_loss"]) for e in sink.events if e["kind"] == "scalars" and "val_loss" in e["values"]]
    assert vals == [(s, 0.5) for s in range(0, 3 * probes.probe.MAX_ERRORS, 10)]
    assert not any("acc" in e["values"] for e in sink.events if e["kind"] == "scalars")
    said = [e["text"] for e in sink.events if e["kind"] == "message"]
    assert len(said) == 3 and all("not a number, dropped" in t for t in said)  # note, top5, tag: once each
    assert not any(e["kind"] == "message" and e["level"] == "error" for e in sink.events)


def test_a_hook_that_raises_inside_forward_or_the_optimizer_step_never_reaches_the_loop(monkeypatch):
    """The probe's hooks run inside the job's forward and optimizer step: one that fails is reported as an
    error message at the next step, the step itself completes, and what did not fail is still measured."""
    import probes.collect as collect

    def broken(*_):
        raise RuntimeError("statistics kernel failed")

    monkeypatch.setattr(collect, "_activation_stats", broken)
    monkeypatch.setattr(collect.Updates, "_pre", broken)
    model, opt = _mlp()
    sink = MemorySink()
    with probes.attach(model, opt, run="hooks-fail", sink=sink, interval=1) as probe:
        before = [p.detach().clone() for p in model.parameters()]
        _train(probe, model, opt, 3)
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # the steps happened
    errors = [e["text"] for e in sink.events if e["kind"] == "message" and e["level"] == "error"]
    assert any("fwd0 hook" in t and "statistics kernel failed" in t for t in errors)  # the model's input
    assert any("activations hook" in t for t in errors) and any("opt0 hook" in t for t in errors)
    collections = {e["collection"] for e in sink.events if e["kind"] == "tensor_stats"}
    assert {"weights", "gradients"} <= collections and "activations" not in collections
    values = {k for e in sink.events if e["kind"] == "scalars" for k in e["values"]}
    assert "loss" in values and "sys/forward" in values


def test_fixes_apply_once_within_bounds_and_revert():
    model, opt = _mlp()
    sink = MemorySink()
    probe = probes.attach(model, opt, run="fix", sink=sink, interval=1,
                          allow={"lr_scale": {"min_factor": 0.1, "max_factor": 2.0}, "grad_clip": {}})
    sink.commands = [{"fix_id": "f-1", "action": "lr_scale", "params": {"factor": 0.5}},
                     {"fix_id": "f-1", "action": "lr_scale", "params": {"factor": 0.5}},  # resent: applied once
                     {"fix_id": "f-2", "action": "lr_scale", "params": {"factor": 50.0}},  # beyond the job's bound
                     {"fix_id": "f-3", "action": "set_lr", "params": {"lr": 1.0}},  # not allowed
                     {"fix_id": "f-4", "action": "grad_clip", "params": {"max_norm": 1e-3}}]
    _train(probe, model, opt, 3)
    probe.flush()
    _train(probe, model, opt, 2)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    _train(probe, model, opt, 1)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert grads.norm().item() <= 1e-3 * 1.01  # the clip hook ran before the optimizer step
    sink.commands = [{"fix_id": "f-1", "op": "revert", "action": "lr_scale"},
                     {"fix_id": "f-4", "op": "revert", "action": "grad_clip"}]
    probe.flush()
    _train(probe, model, opt, 2)
    probe.close()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert not opt._optimizer_step_pre_hooks
    acks = {(e["fix_id"], e["op"]): e for e in sink.events if e["kind"] == "fix_ack"}
    assert acks[("f-1", "apply")]["status"] == "applied"
    assert acks[("f-1", "apply")]["before"] == {"lr": [0.05]} and acks[("f-1", "apply")]["after"] == {"lr": [0.025]}
    assert acks[("f-2", "apply")]["status"] == "rejected" and "bounds" in acks[("f-2", "apply")]["reason"]
    assert acks[("f-3", "apply")]["status"] == "rejected" and "does not allow" in acks[("f-3", "apply")]["reason"]
    assert acks[("f-1", "revert")]["status"] == "reverted" and acks[("f-4", "revert")]["status"] == "reverted"
    assert sum(1 for e in sink.events if e["kind"] == "fix_ack" and e["fix_id"] == "f-1" and e["op"] == "apply") == 1


def test_a_fix_refused_then_asked_for_again_is_a_new_request():
    """The server resends a command until it hears back (applied once), but a fix asked for again after a
    refusal comes as a new attempt, and is answered again: before, the job ignored it as a resend and the
    server expired it."""
    model, opt = _mlp()
    sink = MemorySink()
    probe = probes.attach(model, opt, run="retry", sink=sink, interval=1, allow={"lr_scale": {"max_factor": 2.0}})
    sink.commands = [{"fix_id": "f-1", "action": "lr_scale", "params": {"factor": 50.0}}]  # beyond the bound
    _train(probe, model, opt, 2)
    probe.flush()
    _train(probe, model, opt, 2)
    sink.commands = [{"fix_id": "f-1", "action": "lr_scale", "params": {"factor": 0.5}, "attempt": 2},
                     {"fix_id": "f-1", "action": "lr_scale", "params": {"factor": 0.5}, "attempt": 2}]  # resent
    probe.flush()
    _train(probe, model, opt, 2)
    probe.close()
    acks = [(e["status"], e.get("after")) for e in sink.events if e["kind"] == "fix_ack"]
    assert acks == [("rejected", None), ("applied", {"lr": [0.025]})]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_probes_does_not_import_the_server():
    import subprocess
    code = ("import sys, probes; bad = [m for m in ('diag_server', 'fastapi', 'sqlite3', 'lxml', 'uvicorn', 'mcp') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_public_api_is_honest():
    for name in probes.__all__:
        assert hasattr(probes, name), name
    assert math.isfinite(probes.DEFAULT_INTERVAL)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "10", None])
def test_a_sampling_interval_that_is_not_a_positive_whole_number_is_refused_at_attach(bad):
    model, opt = _mlp()
    if bad is not None:
        with pytest.raises(ValueError, match="positive whole number of steps"):
            probes.attach(model, opt, sink=MemorySink(), interval=bad)
    with pytest.raises(ValueError, match="collection 'weights': its interval must be a positive whole number"):
        probes.attach(model, opt, sink=MemorySink(), collections={"weights": 10, "gradients": 10} | {"weights": bad or 0})
    import numpy as np
    probe = probes.attach(model, opt, sink=MemorySink(), interval=np.int64(7), collections={"weights": np.int32(3)})
    assert [(c.name, c.interval) for c in probe.collections] == [("weights", 3)] and probe.interval == 7
    probe.close()


@pytest.mark.parametrize("run", ["a/b c", "", "-starts-with-a-dash", "x" * 129, "line\n"])
def test_a_run_id_the_server_would_refuse_is_refused_at_attach(run, monkeypatch):
    """Every batch of such a run would be refused by the server: better to say so before training starts."""
    model, opt = _mlp()
    if run:
        with pytest.raises(ValueError, match="not a valid run id"):
            probes.attach(model, opt, run=run, sink=MemorySink())
    monkeypatch.setenv("TRAINDX_RUN", run or "bad run")
    with pytest.raises(ValueError, match="TRAINDX_RUN 'bad run'|TRAINDX_RUN .* not a valid run id"):
        probes.attach(model, opt, sink=MemorySink())


def test_a_torchrun_id_becomes_a_valid_run_id(monkeypatch):
    monkeypatch.delenv("TRAINDX_RUN", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "my job/7")
    model, opt = _mlp()
    with probes.attach(model, opt, sink=MemorySink()) as probe:
        assert probe.run == "torchrun-my_job_7"


@pytest.mark.parametrize("bad", [0, -1, "1", True])
def test_a_flush_interval_that_is_not_a_positive_number_is_refused(bad):
    model, opt = _mlp()
    with pytest.raises(ValueError, match="flush_interval must be a positive number of seconds"):
        probes.attach(model, opt, sink=MemorySink(), flush_interval=bad)


_LEFT_OPEN = """
import sys, torch, probes
from probes.embeddings import Embeddings
Embeddings.background = True  # the worker thread, which must be joined before the interpreter tears down
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(500, 16), torch.nn.Flatten(), torch.nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters())
where = sys.argv[1]  # a file, or a server's URL
sink = dict(server=where, run=sys.argv[3]) if where.startswith("http") else dict(sink=probes.FileSink(where))
probe = probes.attach(model, opt, interval=50, collections={"weights": 50, "embeddings": 10}, **sink)
for step in range(203):
    loss = model(torch.randint(0, 500, (32, 4))).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step(); probe.step(loss=loss)
if sys.argv[2] == "raise":
    raise RuntimeError("boom at step 203")
"""


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_a_probe_left_open_is_closed_at_exit_and_nothing_it_held_is_lost(ending, tmp_path):
    """A job that never calls close() (or dies of an exception) still delivers every event, ends its run
    saying why, and exits with its own status, not an abort from a thread left running."""
    import subprocess

    import orjson

    out = tmp_path / "run.jsonl"
    r = subprocess.run([sys.executable, "-c", _LEFT_OPEN, str(out), ending], capture_output=True, text=True, timeout=120)
    assert r.returncode == (0 if ending == "return" else 1), r.stderr
    assert "terminate called" not in r.stderr
    events = [e for line in out.read_bytes().splitlines() for e in orjson.loads(line)["events"]]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    assert max(e["step"] for e in events if e["kind"] == "scalars") == 202  # the last step's loss too
    assert {e["step"] for e in events if e["kind"] == "tensor_stats" and e["collection"] == "embeddings"} >= {200}
    reason = events[-1]["reason"]
    assert reason == ("exit without close()" if ending == "return" else "exit after RuntimeError: boom at step 203")


_TERMINATED = """
import os, signal, sys, time, torch, probes
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mode = sys.argv[2]
stop = []
if mode == "own-handler":
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
# flush_interval=60: nothing is sent before the end unless the probe is closed
where = sys.argv[1]  # a file, or a server's URL
sink = dict(server=where, run=sys.argv[3]) if where.startswith("http") else dict(sink=probes.FileSink(where))
probe = probes.attach(model, opt, interval=10, flush_interval=60, **sink)
if mode == "composed":  # a library that installs its handler later and calls the one it found (Lightning)
    found = signal.getsignal(signal.SIGTERM)
    def composed(signum, frame):
        stop.append(1)
        found(signum, frame)
    signal.signal(signal.SIGTERM, composed)
if mode == "loop":  # a forked child (as a DataLoader worker is) stopped with SIGTERM is not its parent
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    time.sleep(0.5)
    os.kill(child, signal.SIGTERM)
    _, status = os.waitpid(child, 0)
    print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1, flush=True)
    time.sleep(3)  # longer than the watchdog would wait, had the child's signal reached it
step = 0
while not stop:
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step(); probe.step(loss=loss)
    step += 1
    if step == 50:
        print("ready", flush=True)
    if step == 50 and mode == "busy":  # one C call of minutes: the interpreter does not run in between
        torch.linalg.matrix_power(torch.rand(3000, 3000), 2 ** 62)
if mode == "composed":
    print("flushed", sum(1 for line in open(sys.argv[1])), flush=True)  # before the exit closes the probe
    time.sleep(3)  # longer than the watchdog waits: it must leave the decision to the composed handler
"""


@pytest.mark.parametrize("mode", ["loop", "busy", "own-handler", "composed"])
def test_a_job_stopped_with_sigterm_ends_its_run_saying_so_and_still_dies_of_it(mode, tmp_path):
    """SIGTERM (a scheduler's preemption or time limit, kill) used to end the job with the events the
    sender had not sent (here all of them) and no run_end. Now the probes are closed first, and the process
    then dies of SIGTERM as before; a job busy in one long C call dies within seconds too (the watchdog),
    a forked child's SIGTERM is not its parent's, and a job's own SIGTERM handler is left alone; a handler
    installed later that calls ours (as Lightning's does) decides, ours only flushes the probe."""
    import signal
    import subprocess

    import orjson

    out = tmp_path / "run.jsonl"
    job = subprocess.Popen([sys.executable, "-c", _TERMINATED, str(out), mode], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while "ready" not in lines:
            line = job.stdout.readline()
            assert line, job.stderr.read()
            lines.append(line.strip())
        time.sleep(0.5)
        sent = time.monotonic()
        job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        job.kill()
    events = [e for line in out.read_bytes().splitlines() for e in orjson.loads(line)["events"]]
    assert events[0]["kind"] == "run_start" and events[-1]["kind"] == "run_end"
    losses = sorted(e["step"] for e in events if e["kind"] == "scalars" and "loss" in e["values"])
    assert losses[:50] == list(range(50))  # nothing the job measured before the signal is lost
    if mode in ("own-handler", "composed"):  # their handler ran: the loop ended; the probe was closed at exit
        assert code == 0 and events[-1]["reason"] == "exit without close()"
        if mode == "composed":  # ours flushed what the probe held at the signal (nothing had been sent)
            assert int(job.stdout.read().split()[1]) >= 1
        return
    assert events[-1]["reason"] == "killed by SIGTERM"
    if mode == "loop":
        assert code == -signal.SIGTERM, job.stderr.read()  # died of the signal, as without the probe
        assert "child 15" in lines  # the child died of its SIGTERM, and the parent trained on
        assert events[-1]["step"] == losses[-1] + 1
    else:  # busy in matrix_power for minutes: the watchdog closed the probes and ended the process
        assert code == 128 + signal.SIGTERM and took < 15, (code, took)


def test_a_job_stopped_with_sigterm_shows_as_ended_with_a_warning_saying_so(session_server):
    import os
    import signal
    import subprocess

    run = "stopped-by-sigterm"
    job = subprocess.Popen([sys.executable, "-c", _TERMINATED, session_server.url, "loop", run], text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env={**os.environ, "TRAINDX_TOKEN": session_server.token})
    try:
        while "ready" not in job.stdout.readline():
            pass
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) == -signal.SIGTERM
    finally:
        job.kill()
    with session_server.client() as c:
        summary = c.get(f"/v1/runs/{run}").json()
    assert summary["run"]["status"] == "ended"  # not 'stale', as a job killed this way was before
    last = summary["messages"][-1]
    assert (last["level"], last["text"]) == ("warning", "the job ended: killed by SIGTERM")
    assert last["step"] == summary["run"]["last_step"] >= 50


def test_a_job_that_dies_of_an_exception_says_so_in_its_run_summary(session_server):
    """The probe closed at exit tells the server why the job ended; get_run (GET /v1/runs/{run}) shows it
    among the run's messages, with the run ended and its last loss in."""
    import os
    import subprocess

    run = "left-open-raise"
    env = {**os.environ, "TRAINDX_TOKEN": session_server.token}
    r = subprocess.run([sys.executable, "-c", _LEFT_OPEN, session_server.url, "raise", run], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 1 and "RuntimeError: boom" in r.stderr, r.stderr
    with session_server.client() as c:
        summary = c.get(f"/v1/runs/{run}").json()
    assert summary["run"]["status"] == "ended" and summary["run"]["last_step"] == 203
    assert "loss" in summary["latest"]
    assert summary["messages"][-1] == {"step": 203, "time": summary["messages"][-1]["time"], "level": "error",
                                       "text": "the job ended: exit after RuntimeError: boom at step 203", "rank": 0}
    assert summary["messages_total"] == len(summary["messages"])
