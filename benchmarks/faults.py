"""The fault-injection suite: small real CPU training runs, one per fault, plus healthy runs.

Each fault is injected the way it happens in practice (a learning rate raised too far, a NaN in one
batch, a layer left out of the optimizer, ...). ``record(case, seed)`` trains the run with a probe
writing to a ``MemorySink`` and returns its events; ``replay(events, data_dir)`` feeds them, one step
at a time, through the real ingest and rules engine into a real SQLite store and returns the
anomalies with the step at which each one opened. tests/test_fault_suite.py and
benchmarks/detection.py both use this module, so the test and the figures measure the same runs.
"""

from __future__ import annotations

import math
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from agent_examples.jobs import ReverseTransformer

INTERVAL = 5  # the suite samples every 5th step so that a few seconds of training give enough samples


@dataclass
class Case:
    name: str
    train: Callable[[Callable[..., Any], int], None]  # train(attach, seed)
    expect: tuple[str, ...] = ()  # anomaly kinds any one of which counts as detecting the fault; () = healthy
    onset: int = 0  # the step at which the fault begins
    what: str = ""
    settle: int = 0  # steps the fault takes to show at all after its onset (a physical lag, not the rules')


# -- data --------------------------------------------------------------------------------------------
def _regression(seed: int, n: int = 1024, d: int = 16, scale: float = 1.0, shift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g) / math.sqrt(d)
    y = torch.sin(2 * x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return x * scale + shift, y


def _classification(seed: int, n: int = 1024, d: int = 20, classes: int = 4, spread: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, d, generator=g) * spread
    labels = torch.randint(0, classes, (n,), generator=g)
    x = centers[labels] + torch.randn(n, d, generator=g)
    return x, labels


def _batches(x: torch.Tensor, y: torch.Tensor, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    while True:
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x) - batch + 1, batch):
            idx = perm[i:i + batch]
            yield x[idx], y[idx]


def _mlp(d: int, hidden: int, out: int, act: type[nn.Module] = nn.ReLU, depth: int = 2) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(d if i == 0 else hidden, hidden), act()]
    layers.append(nn.Linear(hidden, out))
    return nn.Sequential(*layers)


def _loop(attach, model, opt, loss_fn, data, steps, *, before_step=None, val=None, val_every=INTERVAL,
          after_backward=None) -> None:
    probe = attach(model, opt)
    try:
        for step in range(steps):
            if before_step:
                before_step(step, opt)
            x, y = next(data)
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()
            if after_backward:
                after_backward(step, out)
            opt.step()
            extra = {}
            if val is not None and step % val_every == 0:
                with torch.no_grad():
                    model.eval()
                    extra["val_loss"] = float(loss_fn(model(val[0]), val[1]))
                    model.train()
            probe.step(loss=loss, **extra)
    finally:
        probe.close()


# -- faults ------------------------------------------------------------------------------------------
def too_high_lr(attach, seed):
    torch.manual_seed(seed)
    x, y = _regression(seed)
    model = _mlp(16, 64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    def raise_lr(step, opt):
        if step == 100:  # someone "speeds up" training mid-run
            for g in opt.param_groups:
                g["lr"] = 2.0
    _loop(attach, model, opt, nn.MSELoss(), _batches(x, y, 64, seed), 130, before_step=raise_lr)


def nan_batch(attach, seed):
    torch.manual_seed(seed)
    x, y = _regression(seed)
    model = _mlp(16, 64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    clean = _batches(x, y, 64, seed)

    def data():
        for step, (xb, yb) in enumerate(clean):
            if step == 60:  # one corrupt record (a division by zero upstream, say)
                xb = xb.clone()
                xb[3, 5] = float("nan")
            yield xb, yb
    _loop(attach, model, opt, nn.MSELoss(), data(), 90)


def deep_sigmoid(attach, seed):
    torch.manual_seed(seed)
    x, y = _classification(seed, d=32)
    model = _mlp(32, 32, 4, act=nn.Sigmoid, depth=12)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _loop(attach, model, opt, nn.CrossEntropyLoss(), _batches(x, y, 64, seed), 80)


def dead_relu_bias(attach, seed):
    torch.manual_seed(seed)
    x, y = _regression(seed)
    model = _mlp(16, 64, 1)
    with torch.no_grad():
        model[2].bias.fill_(-10.0)  # a bad custom init (or a large negative update) kills the units
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    _loop(attach, model, opt, nn.MSELoss(), _batches(x, y, 64, seed), 60)


def tanh_raw_inputs(attach, seed):
    torch.manual_seed(seed)
    x, y = _regression(seed, scale=150.0, shift=800.0)  # raw feature scale, e.g. areas in square feet
    model = _mlp(16, 64, 1, act=nn.Tanh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _loop(attach, model, opt, nn.MSELoss(), _batches(x, y, 64, seed), 60)


def layer_not_in_optimizer(attach, seed):
    torch.manual_seed(seed)
    x, y = _regression(seed)
    model = _mlp(16, 64, 1)
    # The optimizer was built before a layer was added (or from a filtered list): model[2] never learns.
    params = [*model[0].parameters(), *model[4].parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    _loop(attach, model, opt, nn.MSELoss(), _batches(x, y, 64, seed), 60)


def tiny_lr(attach, seed):
    torch.manual_seed(seed)
    x, y = _classification(seed)
    model = _mlp(20, 64, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-7)  # a typo: 1e-7 for 1e-3
    _loop(attach, model, opt, nn.CrossEntropyLoss(), _batches(x, y, 64, seed), 120)


def adam_large_lr_tiny_batch(attach, seed):
    torch.manual_seed(seed)
    x, y = _classification(seed, spread=0.3)  # overlapping classes: the loss cannot reach zero
    model = _mlp(20, 64, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _loop(attach, model, opt, nn.CrossEntropyLoss(), _batches(x, y, 2, seed), 120)


def memorise_tiny_train_set(attach, seed):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 20, generator=g)
    y = torch.randint(0, 10, (16,), generator=g)  # labels the inputs do not determine: only memorisable
    vx, vy = torch.randn(256, 20, generator=g), torch.randint(0, 10, (256,), generator=g)
    model = _mlp(20, 256, 10)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    _loop(attach, model, opt, nn.CrossEntropyLoss(), _batches(x, y, 16, seed), 120, val=(vx, vy))


def slow_data_loader(attach, seed):
    torch.manual_seed(seed)
    x, y = _regression(seed)
    model = _mlp(16, 32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    fast = _batches(x, y, 64, seed)

    def data():
        for batch in fast:
            time.sleep(0.02)  # decoding / reading each batch on the training thread
            yield batch
    _loop(attach, model, opt, nn.MSELoss(), data(), 60)


def kept_tensors(attach, seed):
    torch.manual_seed(seed)
    x, y = _regression(seed)
    model = _mlp(16, 64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list[torch.Tensor] = []

    def keep(step, out):
        # 4 MiB a step: every batch's features "kept for analysis later", never released
        kept.append(torch.empty(1 << 20).fill_(step))
    _loop(attach, model, opt, nn.MSELoss(), _batches(x, y, 64, seed), 60, after_backward=keep)
    kept.clear()


def softmax_into_cross_entropy(attach, seed):
    torch.manual_seed(seed)
    x, y = _classification(seed, classes=6)
    model = nn.Sequential(_mlp(20, 64, 6), nn.Softmax(dim=1))  # CrossEntropyLoss applies log-softmax itself
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _loop(attach, model, opt, nn.CrossEntropyLoss(), _batches(x, y, 64, seed), 60)


# -- transformer faults: a 2-layer nn.TransformerEncoder reversing sequences, under Adam -------------------
def _reverse_batches(seed: int, vocab: int = 16, length: int = 12, batch: int = 32):
    g = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (batch, length), generator=g)
        yield tokens, tokens.flip(1)


def _sequence_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


TRANSFORMER_FAULT = 150  # the transformer faults strike here, after 150 healthy steps (loss ~2.5 from 2.8)


def transformer_lr_spike(attach, seed):
    torch.manual_seed(seed)
    model = ReverseTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def raise_lr(step, opt):
        if step == TRANSFORMER_FAULT:  # a schedule bug: the rate multiplied by 100
            for g in opt.param_groups:
                g["lr"] = g["lr"] * 100
    _loop(attach, model, opt, _sequence_loss, _reverse_batches(seed), 300, before_step=raise_lr)


def transformer_nan_batch(attach, seed):
    torch.manual_seed(seed)
    model = ReverseTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    clean = _reverse_batches(seed)

    def data():
        for step, (x, y) in enumerate(clean):
            if step == TRANSFORMER_FAULT:  # a batch whose targets are all padding: the mean over no token is NaN
                y = torch.full_like(y, -100)
            yield x, y
    _loop(attach, model, opt, _sequence_loss, data(), 220)


def transformer_poisoned_optimizer(attach, seed):
    torch.manual_seed(seed)
    model = ReverseTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def reload(step, opt):
        if step == TRANSFORMER_FAULT + 3:
            # The optimizer's state reloaded from a checkpoint that a mixed-precision run wrote with the moments
            # of its scaled gradients (loss scale 2^16): once the first moment has decayed, every step is
            # 65536x too small. The weights and the rate are untouched.
            for state in opt.state.values():
                state["exp_avg"].mul_(2.0 ** 16)
                state["exp_avg_sq"].mul_(2.0 ** 32)
    _loop(attach, model, opt, _sequence_loss, _reverse_batches(seed), 300, before_step=reload)


def transformer_dead_units_after_spike(attach, seed):
    torch.manual_seed(seed)
    model = ReverseTransformer(activation=nn.ReLU())  # the feed-forward ReLU as a module, as many codebases have
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def spike(step, opt):
        if step in (TRANSFORMER_FAULT, TRANSFORMER_FAULT + 10):  # a warm restart set 100x too high for 10 steps
            for g in opt.param_groups:
                g["lr"] = g["lr"] * (100 if step == TRANSFORMER_FAULT else 0.01)
    _loop(attach, model, opt, _sequence_loss, _reverse_batches(seed), 300, before_step=spike)


# -- healthy runs ------------------------------------------------------------------------------------
def healthy_mlp_regression(attach, seed):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) / 4 + 0.3 * torch.tanh(x[:, :1] * x[:, 1:2]) + 0.1 * torch.randn(2048, 1, generator=g)
    val = (x[-256:], y[-256:])
    model = _mlp(16, 64, 1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    _loop(attach, model, opt, nn.MSELoss(), _batches(x[:-256], y[:-256], 64, seed), 200, val=val)


def healthy_cnn_digits(attach, seed):
    from sklearn.datasets import load_digits  # ships with scikit-learn: nothing is downloaded

    torch.manual_seed(seed)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    val = (x[-300:], y[-300:])
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    _loop(attach, model, opt, nn.CrossEntropyLoss(), _batches(x[:-300], y[:-300], 32, seed), 150, val=val)


def healthy_transformer(attach, seed):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    vocab, length = 16, 12

    def data():
        while True:
            tokens = torch.randint(0, vocab, (32, length), generator=g)
            yield tokens, tokens.flip(1)  # learn to reverse the sequence
    model = ReverseTransformer(vocab, 32, length)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loss_fn(out, y):
        return nn.functional.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))
    _loop(attach, model, opt, loss_fn, data(), 120)


FAULTS: list[Case] = [
    Case("too_high_lr", too_high_lr, ("exploding_gradient", "loss_divergence", "nonfinite", "abnormal_update_ratio"), 100,
         "SGD learning rate raised from 0.02 to 2.0 at step 100"),
    Case("nan_batch", nan_batch, ("nonfinite",), 60, "one NaN in the inputs of the batch at step 60"),
    Case("deep_sigmoid", deep_sigmoid, ("vanishing_gradient",), 0, "12-layer sigmoid MLP"),
    Case("dead_relu_bias", dead_relu_bias, ("dead_relu",), 0, "hidden ReLU layer with bias -10"),
    Case("tanh_raw_inputs", tanh_raw_inputs, ("saturated_activation", "input_not_normalized"), 0,
         "tanh MLP fed unscaled features (mean 800, std 150)"),
    Case("layer_not_in_optimizer", layer_not_in_optimizer, ("unchanged_tensor",), 0,
         "the middle Linear layer's parameters left out of the optimizer"),
    Case("tiny_lr", tiny_lr, ("loss_not_decreasing", "abnormal_update_ratio"), 0, "SGD at lr 1e-7"),
    Case("adam_large_lr_tiny_batch", adam_large_lr_tiny_batch, ("oscillating_loss", "abnormal_update_ratio"), 0,
         "Adam at lr 0.1 with batches of 2"),
    Case("memorise_tiny_train_set", memorise_tiny_train_set, ("overfitting",), 0,
         "16 training samples with arbitrary labels, validation loss reported"),
    Case("slow_data_loader", slow_data_loader, ("dataloader_bottleneck",), 0, "20 ms of loading per batch on the training thread"),
    Case("kept_tensors", kept_tensors, ("memory_growth",), 0, "4 MiB tensor appended to a list every step"),
    Case("softmax_into_cross_entropy", softmax_into_cross_entropy, ("output_range_mismatch",), 0,
         "model ends in Softmax, trained with CrossEntropyLoss"),
    Case("transformer_lr_spike", transformer_lr_spike,
         ("abnormal_update_ratio", "exploding_gradient", "loss_divergence", "training_stalled", "nonfinite"),
         TRANSFORMER_FAULT, "2-layer transformer, Adam 1e-3 raised 100x at step 150"),
    Case("transformer_nan_batch", transformer_nan_batch, ("nonfinite",), TRANSFORMER_FAULT,
         "2-layer transformer, Adam: a batch whose targets are all padding (loss NaN) at step 150"),
    # The reloaded first moment carries the same scale as the second, so the steps keep their size until it
    # has decayed (0.9^30 = 0.04): the median update ratio is 10x down 22 steps after, 30x (training_stalled's
    # line) ~33 steps after, 100x 37 steps after (measurement here).
    Case("transformer_poisoned_optimizer", transformer_poisoned_optimizer,
         ("abnormal_update_ratio", "training_stalled", "exploding_gradient"), TRANSFORMER_FAULT + 3,
         "2-layer transformer, Adam: its state reloaded at step 153 with moments scaled by 2^16 and 2^32",
         settle=35),
    # 62-66% of the second layer's feed-forward units die (from 0%): dead_relu says so at info (its warning is
    # at 70%), and the run stalls at chance.
    Case("transformer_dead_units_after_spike", transformer_dead_units_after_spike,
         ("dead_relu", "training_stalled", "abnormal_update_ratio"), TRANSFORMER_FAULT,
         "2-layer transformer with ReLU modules, Adam 1e-3 raised 100x for steps 150-159: feed-forward units die"),
]
HEALTHY: list[Case] = [
    Case("healthy_mlp_regression", healthy_mlp_regression, what="MLP regression, Adam 1e-3, val_loss"),
    Case("healthy_cnn_digits", healthy_cnn_digits, what="small CNN on sklearn's digits, val_loss"),
    Case("healthy_transformer", healthy_transformer, what="2-layer transformer reversing sequences"),
]
CASES = {c.name: c for c in FAULTS + HEALTHY}


# -- running and replaying ---------------------------------------------------------------------------
def record(case: Case, seed: int = 0, *, interval: int = INTERVAL, **attach_kwargs: Any) -> list[dict]:
    """Train ``case`` once with a probe on a MemorySink; return the events it sent, in order."""
    import probes

    sink = probes.MemorySink()
    run = f"{case.name}-s{seed}-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as spool:
        def attach(model, opt):
            return probes.attach(model, opt, run=run, sink=sink, interval=interval, spool_dir=spool,
                                 flush_interval=0.05, **attach_kwargs)
        case.train(attach, seed)
    return sink.events


_CACHE: dict[tuple[str, int], list[dict]] = {}


def recorded(name: str, seed: int = 0) -> list[dict]:
    """``record`` once per process: tests that look at the same run share its events."""
    if (name, seed) not in _CACHE:
        _CACHE[name, seed] = record(CASES[name], seed)
    return _CACHE[name, seed]


@dataclass
class Opened:
    id: str
    kind: str
    severity: str
    opened_at: int  # the last step of the data that made the rule report it
    first_step: int
    message: str
    tensors: list[str] = field(default_factory=list)


def by_step(events: list[dict]) -> list[list[dict]]:
    """Group a run's events into one batch per step, run_start first, as a live stream delivers them."""
    groups: dict[int, list[dict]] = {}
    for ev in events:
        groups.setdefault(-1 if ev["kind"] == "run_start" else ev["step"], []).append(ev)
    return [groups[s] for s in sorted(groups)]


def replay(events: list[dict], data_dir: str | Path, *, run: str | None = None, settings: Any = None,
           services: Any = None) -> list[Opened]:
    """Feed ``events`` step by step through ingest and the engine; return anomalies as they opened."""
    from diag_server.pipeline.engine import Engine
    from diag_server.pipeline.ingest import ingest
    from diag_server.store import Store
    from schemas.events import IngestBatch

    run = run or f"replay-{uuid.uuid4().hex[:8]}"
    store = services.store if services else Store(data_dir)
    engine = services.engine if services else Engine(settings)
    seen: dict[str, Opened] = {}
    try:
        for seq, group in enumerate(by_step(events)):
            batch = IngestBatch.model_validate({"batch_id": uuid.uuid4().hex, "run": run, "seq": seq,
                                                "events": group})
            ingest(store, engine, batch)
            at = max(ev["step"] for ev in group)
            for r in store.read().execute("SELECT id, kind, severity, first_step, message, tensors FROM anomalies "
                                          "WHERE run=?", (run,)):
                if r["id"] not in seen:
                    import orjson
                    seen[r["id"]] = Opened(r["id"], r["kind"], r["severity"], at, r["first_step"], r["message"],
                                           orjson.loads(r["tensors"] or "[]"))
                else:
                    seen[r["id"]].severity = r["severity"]  # severity may rise while it holds
    finally:
        if services is None:
            store.close()
    return list(seen.values())


def alarms(opened: list[Opened]) -> list[Opened]:
    """What a person would be alerted by: warnings and criticals."""
    return [a for a in opened if a.severity in ("warning", "critical")]
