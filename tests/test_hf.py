"""The transformers callback on a real ``Trainer.train`` of a tiny BERT built in code (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

import probes.hf  # noqa: E402
from tests.integration_helpers import Agent, one_thread  # noqa: E402,F401
from probes.hf import TraindxCallback  # noqa: E402


@pytest.fixture
def srv(session_server):
    return session_server


pytestmark = pytest.mark.usefixtures("one_thread")


class Tokens(torch.utils.data.Dataset):
    """Sequences of token ids; the label says whether the first token is in the lower half."""

    def __init__(self, n: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, 64, (n, 12), generator=g)
        self.labels = (self.ids[:, 0] < 34).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": self.labels[i]}


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_labels=2))


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, save_strategy="no",
                report_to="none", use_cpu=True, disable_tqdm=True, logging_steps=5, optim="sgd",
                learning_rate=1e-3, lr_scheduler_type="constant", dataloader_num_workers=0)
    return TrainingArguments(**{**base, **kw})


class SpikeThenAgent(TrainerCallback):
    """Fault injection (the schedule's base rate jumps 1000x), then an agent fixing it over HTTP."""

    def __init__(self, traindx: TraindxCallback, agent: Agent, spike_at: int) -> None:
        self.traindx, self.agent, self.spike_at = traindx, agent, spike_at
        self.lr_after_fix: list[float] = []

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kw):  # noqa: ANN001
        if state.global_step == self.spike_at:
            lr_scheduler.base_lrs = [b * 1000 for b in lr_scheduler.base_lrs]
        elif state.global_step > self.spike_at and self.agent.fix is None:
            self.traindx.probe.flush()
            self.agent.try_fix({"exploding_gradient", "loss_divergence", "nonfinite"})
        elif self.agent.fix is not None:
            self.traindx.probe.flush()
            self.lr_after_fix.append(optimizer.param_groups[0]["lr"])


def test_train_sees_the_lr_spike_and_the_fix_survives_the_scheduler(srv, tmp_path):
    run = "hf-spike"
    traindx = TraindxCallback(run=run, server=srv.url, interval=1, flush_interval=0.05, spool_dir=tmp_path / "spool",
                              allow=["set_lr", "lr_scale", "grad_clip"])
    agent = Agent(srv.url, run)
    spike = SpikeThenAgent(traindx, agent, spike_at=15)
    # max_grad_norm=0: the Trainer's clipping off, so the probe sees the gradients grow (see docs).
    trainer = Trainer(model=tiny_bert(), args=_args(tmp_path, max_steps=36, max_grad_norm=0.0, eval_strategy="steps",
                                                    eval_steps=30),
                      train_dataset=Tokens(), eval_dataset=Tokens(32, seed=1), callbacks=[traindx, spike])
    trainer.train()
    assert agent.anomaly is not None, "no anomaly was raised after the learning-rate spike"
    fix = agent.wait_fix({"applied", "effective", "ineffective"})
    assert fix["status"] in {"applied", "effective", "ineffective"}, fix
    assert fix["action"] == "set_lr" and fix["after"]["lr"] == [pytest.approx(1e-3)] * 2  # two param groups
    # The Trainer's LambdaLR recomputes the rate from base_lrs every step: the fix scaled those too,
    # so the rate stays at the healthy value for every step after it, not just one.
    assert len(spike.lr_after_fix) >= 3 and all(lr == pytest.approx(1e-3) for lr in spike.lr_after_fix[1:])
    assert len(agent.scalar("loss")) == 36  # one per optimizer step
    assert agent.scalar("val_loss") and agent.scalar("learning_rate")


def test_gradient_accumulation_gives_one_probe_step_per_optimizer_step(tmp_path):
    from probes.sinks import MemorySink

    sink = MemorySink()
    traindx = TraindxCallback(run="hf-accum", sink=sink, interval=1, collections=["gradients"])
    Trainer(model=tiny_bert(), args=_args(tmp_path, max_steps=3, gradient_accumulation_steps=4),
            train_dataset=Tokens(), callbacks=[traindx]).train()
    losses = [e["step"] for e in sink.events if e["kind"] == "scalars" and "loss" in e["values"]]
    grads = [e["step"] for e in sink.events if e.get("collection") == "gradients"]
    assert losses == [0, 1, 2] and grads == [0, 1, 2]


def test_report_to_traindx(srv, tmp_path, monkeypatch):
    probes.hf.register()
    monkeypatch.setenv("TRAINDX_SERVER", srv.url)
    monkeypatch.setenv("TRAINDX_RUN", "hf-report-to")
    monkeypatch.setenv("TRAINDX_SPOOL", str(tmp_path / "spool"))
    trainer = Trainer(model=tiny_bert(), args=_args(tmp_path, max_steps=3, report_to=["traindx"]),
                      train_dataset=Tokens())
    assert any(isinstance(cb, TraindxCallback) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    assert [s for s, _ in Agent(srv.url, "hf-report-to").scalar("loss")] == [0, 1, 2]
