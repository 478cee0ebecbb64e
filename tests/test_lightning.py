"""The Lightning callback on a real ``Trainer.fit``: anomaly, applied fix, gradient accumulation."""

from __future__ import annotations

import math

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

from tests.integration_helpers import Agent, one_thread  # noqa: E402,F401
from probes.lightning import TraindxCallback  # noqa: E402
from probes.sinks import MemorySink  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


def _data(n: int = 64, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_mse", loss)
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _trainer(callbacks: list, **kw) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     callbacks=callbacks, **kw)


def _loader(ds: torch.utils.data.Dataset, batch_size: int = 8) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False)


class SpikeThenAgent(L.Callback):
    """Fault injection (the learning rate jumps 40x at one step), then an agent fixing it over HTTP."""

    def __init__(self, traindx: TraindxCallback, agent: Agent, spike_at: int) -> None:
        self.traindx, self.agent, self.spike_at = traindx, agent, spike_at
        self.lr_after_fix: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        opt = trainer.optimizers[0]
        step = trainer.global_step
        if step == self.spike_at:
            for g in opt.param_groups:
                g["lr"] *= 40
        elif step > self.spike_at and self.agent.fix is None:
            self.traindx.probe.flush()
            self.agent.try_fix({"exploding_gradient", "loss_divergence", "nonfinite"})
        elif self.agent.fix is not None:
            self.traindx.probe.flush()  # the ingest reply carries the command; the next probe.step applies it
            self.lr_after_fix.append(opt.param_groups[0]["lr"])


def test_fit_sees_the_lr_spike_and_applies_the_fix_through_the_trainer(session_server, tmp_path):
    srv = session_server
    run = "lightning-spike"
    traindx = TraindxCallback(run=run, server=srv.url, interval=1, flush_interval=0.05,
                              spool_dir=tmp_path / "spool", allow=["set_lr", "lr_scale", "grad_clip"])
    agent = Agent(srv.url, run)
    spike = SpikeThenAgent(traindx, agent, spike_at=12)
    model = Regressor()
    _trainer([traindx, spike], max_steps=40, val_check_interval=8, limit_val_batches=2).fit(
        model, _loader(_data()), _loader(_data(16, seed=1)))
    assert agent.anomaly is not None, "no anomaly was raised after the learning-rate spike"
    fix = agent.wait_fix({"applied", "effective", "ineffective"})
    assert fix["status"] in {"applied", "effective", "ineffective"}, fix
    assert fix["applied_step"] is not None and fix["applied_step"] > 12
    # The fix reached the Trainer's own optimizer: the rate is back to the healthy 0.05.
    assert fix["action"] == "set_lr" and fix["before"]["lr"] == [pytest.approx(2.0)]
    assert spike.lr_after_fix[-1] == pytest.approx(0.05)
    # Training and validation losses and logged metrics reached the server.
    assert len(agent.scalar("loss")) == 40
    assert agent.scalar("val_loss") and agent.scalar("train_mse")


def test_gradient_statistics_are_of_the_accumulated_gradient():
    sink = MemorySink()
    traindx = TraindxCallback(run="lightning-accum", sink=sink, interval=1, collections=["gradients"])
    ds = _data(64)
    model = Regressor()
    reference = Regressor()  # same seed: the same initial weights
    trainer = _trainer([traindx], max_steps=2, accumulate_grad_batches=4)
    trainer.fit(model, _loader(ds))
    assert trainer.global_step == 2

    events = sink.events
    losses = [e for e in events if e["kind"] == "scalars" and "loss" in e["values"]]
    assert [e["step"] for e in losses] == [0, 1], "one probe step per optimizer step, not per micro-batch"
    grads = {e["step"]: {r["name"]: r["norm"] for r in e["rows"]} for e in events
             if e.get("collection") == "gradients"}

    # Step 0 by hand: four micro-batches of 8, each loss divided by 4, gradients summed.
    micro = [reference.training_step((ds.tensors[0][i:i + 8], ds.tensors[1][i:i + 8]), 0) for i in range(0, 32, 8)]
    reference.zero_grad()
    for loss in micro:
        (loss / 4).backward()
    accumulated = {n: p.grad.norm().item() for n, p in reference.named_parameters()}
    reference.zero_grad()
    micro[-1].detach()
    last = Regressor()
    last.training_step((ds.tensors[0][24:32], ds.tensors[1][24:32]), 0).backward()
    last_only = {n: p.grad.norm().item() for n, p in last.named_parameters()}

    for name, norm in accumulated.items():
        assert grads[0][name] == pytest.approx(norm, rel=1e-4)
    assert not all(math.isclose(grads[0][n], last_only[n], rel_tol=1e-3) for n in last_only)
    assert losses[0]["values"]["loss"] == pytest.approx(sum(x.item() for x in micro) / 4, rel=1e-5)


def test_grad_clip_fix_acts_on_the_step_it_is_applied_in():
    """Lightning runs forward and backward inside optimizer.step(closure); the clip must see those gradients."""
    sink = MemorySink()
    traindx = TraindxCallback(run="lightning-clip", sink=sink, interval=1, collections=["gradients"],
                              flush_interval=0.02, allow={"grad_clip": {"min_norm": 1e-6}})
    sink.commands.append({"fix_id": "f-1", "op": "apply", "action": "grad_clip", "params": {"max_norm": 1e-3}})

    class Wait(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            if trainer.global_step == 1:
                traindx.probe.flush()  # the reply hands the command to the probe; step 1 applies it

    _trainer([traindx, Wait()], max_steps=6).fit(Regressor(), _loader(_data()))
    acks = [e for e in sink.events if e["kind"] == "fix_ack"]
    assert acks and acks[0]["status"] == "applied"
    applied_at = acks[0]["step"]
    norms = {e["step"]: math.sqrt(sum(r["norm"] ** 2 for r in e["rows"])) for e in sink.events
             if e.get("collection") == "gradients"}
    assert all(norms[s] > 1e-2 for s in norms if s <= applied_at)
    later = [norms[s] for s in norms if s > applied_at]
    assert later and all(n == pytest.approx(1e-3, rel=1e-3) for n in later)


def test_fp16_steps_the_trainers_scaler_skips_are_not_faults(session_server, tmp_path):
    """Lightning's own GradScaler (fp16 autocast on CPU here): its overflow skips reach the server as such."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    run = "lightning-fp16"
    traindx = TraindxCallback(run=run, server=session_server.url, interval=1, flush_interval=0.05,
                              spool_dir=tmp_path / "spool")
    # A start scale of 2**24 overflows fp16 gradients for the first steps; the scaler skips them and backs off.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    trainer = _trainer([traindx], max_steps=12, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    trainer.fit(Regressor(), _loader(_data()))
    agent = Agent(session_server.url, run)
    skipped = [s for s, v in agent.scalar("amp/skipped") if v]
    assert skipped[:3] == [0, 1, 2] and len(skipped) < 12  # the first steps skip until the scale comes down
    overflowed: dict[int, bool] = {}
    for name in ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"):
        grads = agent.client.get(f"/v1/runs/{run}/series/{name}", params={"collection": "gradients"}).json()
        for p in grads["points"]:
            overflowed[p["step"]] = overflowed.get(p["step"], False) or p["value"] is None
    # Inf gradients exactly on the skipped steps (unscaled and finite on the others), and no fault raised.
    assert overflowed == {s: s in skipped for s in range(12)}
    assert agent.anomalies() == []


class Recommender(L.LightningModule):
    """A table under a linear head: Lightning runs its forward and backward inside optimizer.step(closure)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(30, 4)
        self.head = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        ids, y = batch
        return ((self.head(self.table(ids)).squeeze(1) - y) ** 2).mean()

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_embeddings_are_tracked_in_every_step_as_a_plain_loop_tracks_them() -> None:
    """The looked-up rows are read after Lightning's backward (from on_before_optimizer_step), not in the
    optimizer's pre hook, which runs before the closure: the table's statistics equal a plain loop's."""
    from probes import attach
    from probes.embeddings import Embeddings

    g = torch.Generator().manual_seed(0)
    ids = torch.arange(30).repeat(4)
    data = torch.utils.data.TensorDataset(ids, torch.randn(30, generator=g)[ids])
    cb = TraindxCallback(sink=MemorySink(), run="light-emb", collections={"embeddings": 2})
    tables: list = []

    class Keep(L.Callback):
        def on_train_end(self, trainer, pl_module):  # noqa: ANN001
            tables.extend(c.tables[0] for c in cb.probe.collections if isinstance(c, Embeddings))

    trainer = _trainer([cb, Keep()], max_epochs=3)
    trainer.fit(Recommender(), _loader(data, batch_size=30))
    model = Recommender()  # the same initialisation, batches and optimizer, in a plain loop
    opt = model.configure_optimizers()
    probe = attach(model, opt, sink=MemorySink(), run="plain-emb", collections={"embeddings": 2})
    for _ in range(3):
        for batch in _loader(data, batch_size=30):
            loss = model.training_step(batch, 0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            probe.step(loss=loss)
    plain = next(c for c in probe.collections if isinstance(c, Embeddings)).tables[0]
    probe.close()
    assert trainer.global_step == 12 and tables[0].touches.tolist() == [12.0] * 30
    assert torch.allclose(tables[0].state, plain.state, rtol=1e-5, atol=1e-7)
