"""Seeded training jobs with a fault, shared by the demo, the tests and the recorded agent sessions.

Each is a real PyTorch training loop with the probe attached; the same seed gives the same run.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import probes

# What the demo job lets the server change (a job that allows nothing is read-only): the rate, a clip, a
# guard against NaN steps, and a rollback to a snapshot taken every 25 steps (two kept, plus the first and
# the best: about 4x the model and its momentum in host memory), which is what undoes the damage a fault
# did before anyone acted.
DEMO_ALLOW: dict[str, dict] = {"lr_scale": {}, "set_lr": {}, "grad_clip": {}, "skip_nonfinite": {},
                               "rollback": {"every": 25}}


@dataclass
class JobResult:
    run: str
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.time() at the end of each step
    error: BaseException | None = None
    final_loss: float | None = None  # fault_job: MSE on a fixed clean evaluation set at the end (see fault_job)
    wall: float | None = None  # fault_job: seconds from the first step to the end, probe close included

    def median(self, lo: int, hi: int) -> float:
        window = [x for x in self.losses[lo:hi] if x == x]
        return statistics.median(window) if window else float("nan")


def regression_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 1))


def lr_spike_job(*, run: str, steps: int = 1500, fault_step: int | None = 500, fault_lr: float = 0.1,
                 lr: float = 0.01, pace: float = 0.004, seed: int = 0, interval: int = 10,
                 allow: tuple[str, ...] | list[str] | dict[str, dict] = DEMO_ALLOW,
                 probe_kwargs: dict[str, Any] | None = None,
                 attach: bool = True, stop: threading.Event | None = None) -> JobResult:
    """An MLP regression trained with SGD+momentum; at ``fault_step`` a scheduler bug sets the learning
    rate 10x too high, the loss jumps ~100x and the gradients start to explode. ``pace`` seconds of
    sleep per step stand in for a real model's compute, so an agent has time to act."""
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(seed + 1)
    w = torch.linspace(-1, 1, 16)
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    result = JobResult(run=run)
    allowed = allow if isinstance(allow, dict) else list(allow)  # a dict carries an action's settings
    probe = probes.attach(model, opt, run=run, interval=interval, allow=allowed, **(probe_kwargs or {})) \
        if attach else None
    try:
        for step in range(steps):
            if stop is not None and stop.is_set():
                break
            if step == fault_step:
                for group in opt.param_groups:
                    group["lr"] = fault_lr  # the fault: a warm-up schedule that forgot to divide
            x = torch.randn(64, 16, generator=data)
            y = (x @ w).unsqueeze(1) + 0.3 * torch.sin(3 * x[:, :1])
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if pace:
                time.sleep(pace)  # stands for a real model's compute: part of the step, not data wait
            if probe is not None:
                probe.step(loss=loss)
            result.losses.append(loss.item())
            result.lrs.append(float(opt.param_groups[0]["lr"]))
            result.times.append(time.time())
    except BaseException as e:  # noqa: BLE001 - reported to the caller, who runs us in a thread
        result.error = e
    finally:
        if probe is not None:
            probe.close()
    return result


# -- the repair suite: one job per live-fixable fault ------------------------------------------------
# What the repair jobs let the server change: every live action, rollback with a snapshot every 25 steps
# (two kept: about 2x the model plus its optimizer state in host memory).
REPAIR_ALLOW: dict[str, dict] = {a: {} for a in ("lr_scale", "set_lr", "grad_clip", "skip_nonfinite", "grad_scale",
                                                 "freeze", "unfreeze", "reinit_dead_units", "set_probe")}
REPAIR_ALLOW["rollback"] = {"every": 25}
REPAIR_ALLOW["set_lr"] = {"max_lr": 1.0}


FINAL_WINDOW = 100


@dataclass
class Fault:
    name: str
    what: str
    optimizer: str = "sgd"  # sgd (momentum 0.9) or adam
    lr: float = 0.01
    batch: int = 64
    fault_step: int = 0  # when the fault begins (0: from the start)
    fault_lr: float | None = None  # the learning rate the fault sets at fault_step (or from the start)
    dead_bias: bool = False  # the first hidden layer's bias is set to -10: its ReLUs die
    frozen: bool = False  # the hidden Linear layers are left out of the optimizer
    nan_batch: bool = False  # one input value of the batch at fault_step is NaN
    outliers: int = 0  # from fault_step, every 10th batch has one label multiplied by this


REPAIR_FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("exploding_gradients", "from step 150 every 10th batch has one label 100x too large (a unit bug in "
          "some records): each such batch throws the weights off", fault_step=150, outliers=100),
    Fault("nan_batch", "one NaN in the inputs of the batch at step 200 (a corrupt record)", fault_step=200,
          nan_batch=True),
    Fault("lr_too_high", "at step 200 a scheduler bug sets the learning rate 10x too high", fault_step=200,
          fault_lr=0.1),
    Fault("lr_too_low", "the learning rate is 1e-7 instead of 1e-2 (a typo)", fault_lr=1e-7),
    Fault("dead_relu", "the first hidden layer starts with bias -10: all of its ReLUs are dead", dead_bias=True),
    Fault("oscillating_loss", "the learning rate is 0.1 instead of 0.01 from the start: the loss swings up and "
          "down instead of descending", fault_lr=0.1),
    Fault("frozen_layer", "the two hidden Linear layers were left out of the optimizer: only the head learns",
          frozen=True),
)}


@contextlib.contextmanager
def _running(result: JobResult, probe: probes.Probe | None) -> Any:
    """A job's loop: an error goes to ``result.error`` (the caller runs the job in a thread), the probe is
    closed whatever happens, and ``result.wall`` is the loop's time, the probe's close included."""
    t0 = time.time()
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - reported to the caller, who runs us in a thread
        result.error = e
    finally:
        if probe is not None:
            probe.close()
        result.wall = time.time() - t0


def _train_step(loss: torch.Tensor, opt: torch.optim.Optimizer, probe: probes.Probe | None, pace: float,
                result: JobResult) -> None:
    """A job's step once its loss is computed: the backward pass, ``pace`` seconds standing in for a real
    model's compute (inside the step, not data wait), the optimizer step, the probe, and the record."""
    opt.zero_grad()
    loss.backward()
    if pace:
        time.sleep(pace)
    opt.step()
    if probe is not None:
        probe.step(loss=loss)
    result.losses.append(loss.item())
    result.lrs.append(float(opt.param_groups[0]["lr"]))
    result.times.append(time.time())


def fault_job(fault: Fault | str, *, run: str, steps: int = 800, pace: float = 0.004, seed: int = 0,
              interval: int = 10, healthy: bool = False, allow: Any = None,
              probe_kwargs: dict[str, Any] | None = None, attach: bool = True,
              stop: threading.Event | None = None) -> JobResult:
    """The regression MLP of ``lr_spike_job`` with one fault of ``REPAIR_FAULTS`` (or none: ``healthy``).
    The same seed gives the same weights and batches with and without the fault, so a fixed run can be
    compared with the healthy one. ``final_loss`` is the MSE on a fixed clean evaluation set, the median of
    its values every 10 steps over the last ``FINAL_WINDOW`` steps (one evaluation alone moves by ~20% from
    step to step under SGD noise: measurement here)."""
    fault = REPAIR_FAULTS[fault] if isinstance(fault, str) else fault
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(seed + 1)
    w = torch.linspace(-1, 1, 16)
    gen_eval = torch.Generator().manual_seed(seed + 2)
    x_eval = torch.randn(1024, 16, generator=gen_eval)
    y_eval = (x_eval @ w).unsqueeze(1) + 0.3 * torch.sin(3 * x_eval[:, :1])
    model = regression_model()
    if fault.dead_bias and not healthy:
        with torch.no_grad():
            model[0].bias.fill_(-10.0)
    params = list(model.parameters())
    if fault.frozen and not healthy:
        params = list(model[4].parameters())
    lr = fault.lr if healthy or fault.fault_step or fault.fault_lr is None else fault.fault_lr
    opt: torch.optim.Optimizer = (torch.optim.Adam(params, lr=lr) if fault.optimizer == "adam"
                                  else torch.optim.SGD(params, lr=lr, momentum=0.9))
    result = JobResult(run=run)
    probe = probes.attach(model, opt, run=run, interval=interval,
                          allow=REPAIR_ALLOW if allow is None else allow, **(probe_kwargs or {})) if attach else None
    evals: list[float] = []
    with _running(result, probe):
        for step in range(steps):
            if stop is not None and stop.is_set():
                break
            if not healthy and fault.fault_step and step == fault.fault_step and fault.fault_lr is not None:
                for group in opt.param_groups:
                    group["lr"] = fault.fault_lr
            x = torch.randn(fault.batch, 16, generator=data)
            y = (x @ w).unsqueeze(1) + 0.3 * torch.sin(3 * x[:, :1])
            if not healthy and fault.nan_batch and step == fault.fault_step:
                x[0, 3] = float("nan")
            if not healthy and fault.outliers and step >= fault.fault_step and step % 10 == 0:
                y[0] = y[0] * fault.outliers
            _train_step(torch.nn.functional.mse_loss(model(x), y), opt, probe, pace, result)
            if step >= steps - FINAL_WINDOW and (steps - 1 - step) % 10 == 0:
                with torch.no_grad():
                    evals.append(torch.nn.functional.mse_loss(model(x_eval), y_eval).item())
        result.final_loss = statistics.median(x if x == x else float("inf") for x in evals) if evals else None
    return result


# -- a transformer: Adam and its state -----------------------------------------------------------------
class ReverseTransformer(torch.nn.Module):
    """A 2-layer ``nn.TransformerEncoder`` that learns to reverse a sequence of tokens (one output per
    position over the vocabulary)."""

    def __init__(self, vocab: int = 16, d: int = 32, length: int = 12, activation: Any = "relu") -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(length, d) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(d, 4, dim_feedforward=64, dropout=0.0, batch_first=True,
                                                 activation=activation)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.pos))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self(tokens).reshape(-1, self.vocab), tokens.flip(1).reshape(-1))


def transformer_job(*, run: str, steps: int = 1500, fault_step: int | None = 300, fault_factor: float = 100.0,
                    lr: float = 1e-3, pace: float = 0.0, seed: int = 0, interval: int = 10, healthy: bool = False,
                    allow: Any = None, probe_kwargs: dict[str, Any] | None = None, attach: bool = True,
                    stop: threading.Event | None = None) -> JobResult:
    """The transformer of issue 37: ``ReverseTransformer`` (vocabulary 16, sequences of 12) trained with Adam
    at ``lr`` on random sequences; at ``fault_step`` a schedule bug multiplies the learning rate by
    ``fault_factor``. Unfixed, the loss goes to chance (ln 16 = 2.77) and stays there; setting the rate back
    leaves Adam's second moments filled by the spike, and the run stalls at chance; a rollback to before
    the fault recovers it. ``final_loss``: cross-entropy on a fixed evaluation set of 512 sequences, the
    median of its values every 10 steps over the last ``FINAL_WINDOW`` steps."""
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(seed + 1)
    x_eval = torch.randint(0, 16, (512, 12), generator=torch.Generator().manual_seed(seed + 2))
    model = ReverseTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    result = JobResult(run=run)
    probe = probes.attach(model, opt, run=run, interval=interval,
                          allow=REPAIR_ALLOW if allow is None else allow, **(probe_kwargs or {})) if attach else None
    evals: list[float] = []
    with _running(result, probe):
        for step in range(steps):
            if stop is not None and stop.is_set():
                break
            if not healthy and step == fault_step:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * fault_factor
            tokens = torch.randint(0, 16, (32, 12), generator=data)
            _train_step(model.loss(tokens), opt, probe, pace, result)
            if step >= steps - FINAL_WINDOW and (steps - 1 - step) % 10 == 0:
                with torch.no_grad():
                    evals.append(model.loss(x_eval).item())
        result.final_loss = statistics.median(x if x == x else float("inf") for x in evals) if evals else None
    return result


# -- a recommender: embedding tables ------------------------------------------------------------------
class MatrixFactorisation(torch.nn.Module):
    """Global mean + user and item biases + the dot product of user and item vectors (four tables)."""

    def __init__(self, users: int, items: int, dim: int, mean: float) -> None:
        super().__init__()
        self.user, self.item = torch.nn.Embedding(users, dim), torch.nn.Embedding(items, dim)
        self.user_bias, self.item_bias = torch.nn.Embedding(users, 1), torch.nn.Embedding(items, 1)
        for table in (self.user, self.item):
            torch.nn.init.normal_(table.weight, std=0.1)
        for table in (self.user_bias, self.item_bias):
            torch.nn.init.zeros_(table.weight)
        self.register_buffer("mean", torch.tensor(mean))

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return (self.mean + self.user_bias(u).squeeze(1) + self.item_bias(i).squeeze(1)
                + (self.user(u) * self.item(i)).sum(1))


RECOMMENDER_ALLOW: dict[str, dict] = {"embedding_grad_scale": {}, "lr_scale": {}, "grad_clip": {}}


def toggle_labels(items: list[int], ratings: torch.Tensor, faulty: set[int], seen: dict[int, int]) -> None:
    """A broken join, in place: the rating of a ``faulty`` item becomes 6 - r at every other time the item is
    seen (``seen`` counts its appearances so far, across batches), so its target toggles between r and 6 - r."""
    for pos, item in enumerate(items):
        if item in faulty:
            k = seen.get(item, 0)
            if k % 2:
                ratings[pos] = 6 - ratings[pos]
            seen[item] = k + 1


def recommender_job(*, run: str, steps: int = 900, toggling: int = 8, pace: float = 0.004, seed: int = 0,
                    interval: int = 20, users: int = 300, items: int = 200, batch: int = 128,
                    allow: Any = None, probe_kwargs: dict[str, Any] | None = None, attach: bool = True,
                    stop: threading.Event | None = None) -> JobResult:
    """A matrix-factorisation recommender on synthetic ratings (Zipf-popular items, a hidden 8-dim taste
    per user and item, noise 0.3), trained with Adam 1e-2, the probe's default collections plus
    ``embeddings``. The fault: for the ``toggling`` most popular items a broken join alternates each
    label between r and 6 - r every time the item is seen, so those items' rows are pulled back and forth
    and learn nothing (zombies). ``final_loss``: MSE on held-out clean ratings at the end."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    taste_u, taste_i = torch.randn(users, 8, generator=gen), torch.randn(items, 8, generator=gen)
    popularity = 1.0 / torch.arange(1, items + 1, dtype=torch.float64) ** 0.6

    def ratings(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u = torch.randint(0, users, (n,), generator=g)
        i = torch.multinomial(popularity, n, replacement=True, generator=g)
        r = (3.5 + 0.35 * (taste_u[u] * taste_i[i]).sum(1) + 0.3 * torch.randn(n, generator=g)).clamp(1.0, 5.0)
        return u, i, r

    eval_u, eval_i, eval_r = ratings(2048, torch.Generator().manual_seed(seed + 2))
    model = MatrixFactorisation(users, items, 16, 3.5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    result = JobResult(run=run)
    faulty = set(range(toggling))  # item ids are in popularity order
    seen: dict[int, int] = {}
    probe = probes.attach(model, opt, run=run, interval=interval,
                          collections=[*probes.probe.DEFAULT_COLLECTIONS, "embeddings"],
                          allow=RECOMMENDER_ALLOW if allow is None else allow, **(probe_kwargs or {})) if attach else None
    with _running(result, probe):
        for _ in range(steps):
            if stop is not None and stop.is_set():
                break
            u, i, r = ratings(batch, gen)
            toggle_labels(i.tolist(), r, faulty, seen)
            _train_step(((model(u, i) - r) ** 2).mean(), opt, probe, pace, result)
        with torch.no_grad():
            result.final_loss = float(((model(eval_u, eval_i) - eval_r) ** 2).mean())
    return result
