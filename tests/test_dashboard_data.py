"""What the dashboard's pages read, without a browser: a run's config from probes.attach(config=...) and the
Hugging Face Trainer, the quantiles the probe estimates, runs searched and filtered, and runs compared."""

from __future__ import annotations

import dataclasses
import enum
import math
from pathlib import Path

import pytest
import torch

import probes
from probes import quantiles
from probes.run_config import flatten
from probes.sinks import MemorySink
from schemas.events import MAX_CONFIG_KEYS, QUANTILE_LEVELS, RunStart


class Act(enum.Enum):
    gelu = "gelu"


@dataclasses.dataclass
class Optim:
    name: str = "adamw"
    lr: float = 3e-4
    betas: tuple = (0.9, 0.95)


def mlp(seed: int = 0, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def train(probe: probes.Probe, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, scale: float = 1.0) -> None:
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True) * scale
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)


def test_config_is_flattened_into_what_the_wire_takes() -> None:
    config = {"optim": Optim(), "model": {"act": Act.gelu, "layers": 12, "dtype": torch.bfloat16,
                                          "path": Path("/data/wiki"), "empty": {}},
              "lr_tensor": torch.tensor(0.5), "nan": float("nan"), "huge": 2**80, "text": "x" * 5000,
              "mixed": [1, "a"], "long": list(range(100)), "ctrl\nkey": 1}
    flat, dropped = flatten(config)
    assert dropped == 0
    assert flat["optim.name"] == "adamw" and flat["optim.lr"] == 3e-4 and flat["optim.betas"] == [0.9, 0.95]
    assert flat["model.act"] == "gelu" and flat["model.layers"] == 12 and flat["model.dtype"] == "torch.bfloat16"
    assert flat["model.path"] == "/data/wiki" and flat["model.empty"] is None and flat["lr_tensor"] == 0.5
    assert flat["nan"] is None and flat["huge"] == float(2**80) and len(flat["text"]) == 1024
    assert flat["mixed"] == "[1, 'a']" and flat["long"].startswith("[0, 1, 2")
    assert "ctrl key" in flat
    RunStart(time=1.0, run_config=flat)  # the server takes it: a refused run start would lose the run
    many, dropped = flatten({f"k{i}": i for i in range(MAX_CONFIG_KEYS + 7)})
    assert len(many) == MAX_CONFIG_KEYS and dropped == 7
    RunStart(time=1.0, run_config=many)
    with pytest.raises(TypeError, match="config must be a mapping"):
        flatten(["lr", 0.1])


def test_attach_sends_the_config_and_refuses_what_is_not_one() -> None:
    model = mlp()
    sink = MemorySink()
    probe = probes.attach(model, sink=sink, config={"optim": {"lr": 0.1}, "seed": 3})
    probe.close()
    start = next(e for e in sink.events if e["kind"] == "run_start")
    assert start["run_config"] == {"optim.lr": 0.1, "seed": 3}
    assert start["config"]["quantile_sample"] == quantiles.SAMPLE
    with pytest.raises(TypeError, match="config must be a mapping"):
        probes.attach(model, sink=MemorySink(), config="lr=0.1")


def test_quantiles_match_torch_and_come_on_sampled_steps_at_most_every_100() -> None:
    big = torch.randn(100_000)
    big[:10] = float("nan")
    small = torch.tensor([3.0, 1.0, 2.0, float("inf")])
    [q_big, q_small] = zip(*quantiles.of([big, small]))
    exact = torch.quantile(big[10:], torch.tensor(QUANTILE_LEVELS)).tolist()
    # a 512-element sample: within ~3 standard errors of the rank (sqrt(q(1-q)/512) ~ 2.2 points at the median)
    ranks = [float((big[10:] <= v).float().mean()) for v in q_big]
    assert all(abs(r - level) < 0.07 for r, level in zip(ranks, QUANTILE_LEVELS)), (ranks, exact)
    assert q_small == pytest.approx(torch.quantile(torch.tensor([1.0, 2.0, 3.0]), torch.tensor(QUANTILE_LEVELS)).tolist())
    assert all(math.isnan(v) for v in quantiles.of([torch.tensor([float("nan")])])[0])
    # the device path (a batched torch sort, no host read), as it runs on CUDA or without numpy: the same values
    tensors = [big, small, torch.randn(300, dtype=torch.float64), torch.tensor([float("nan")])]
    on_device = quantiles.quantiles([torch.from_numpy(quantiles.sample(t)) for t in tensors])
    assert isinstance(on_device, torch.Tensor)
    assert torch.allclose(on_device, torch.tensor(quantiles.of(tensors), dtype=on_device.dtype), equal_nan=True)

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = MemorySink()
    probe = probes.attach(model, opt, sink=sink, interval=50)
    train(probe, model, opt, 251)
    probe.close()
    with_q = {}
    for e in sink.events:
        if e["kind"] == "tensor_stats":
            for r in e["rows"]:
                if r.get("quantiles"):
                    with_q.setdefault(e["collection"], set()).add(e["step"])
                    assert len(r["quantiles"]) == len(QUANTILE_LEVELS)
                    assert r["min"] <= r["quantiles"][0] and r["quantiles"][-1] <= r["max"]
    assert with_q == {c: {0, 100, 200} for c in ("weights", "gradients", "activations")}


def test_runs_are_searched_filtered_and_compared(session_server) -> None:
    url, headers = session_server.url, session_server.headers
    runs = {}
    for name, lr, hidden, scale in (("cmp-slow", 0.001, 16, 1.0), ("cmp-fast", 0.05, 32, 1.0)):
        model = mlp(hidden=hidden)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        probe = probes.attach(model, opt, server=url, run=name, interval=5,
                              config={"optim": {"lr": lr}, "model": {"hidden": hidden}, "data": "sum-of-8"})
        train(probe, model, opt, 60, scale)
        assert probe.flush()
        probe.close()
        runs[name] = probe
    import httpx

    with httpx.Client(base_url=url, headers=headers) as http:
        found = http.get("/v1/runs", params={"search": "CMP-", "limit": 50}).json()
        assert {r["run"] for r in found["runs"]} == {"cmp-slow", "cmp-fast"}
        none_open = http.get("/v1/runs", params={"search": "cmp-", "open_anomalies": "false"}).json()
        assert all(r["open_anomalies"] == 0 for r in none_open["runs"])
        assert http.get("/v1/runs/cmp-slow").json()["config"] == {"optim.lr": 0.001, "model.hidden": 16,
                                                                   "data": "sum-of-8"}
        cmp = http.get("/v1/compare", params=[("run", "cmp-slow"), ("run", "cmp-fast"), ("metric", "loss")]).json()
        assert [r["run"]["run"] for r in cmp["runs"]] == ["cmp-slow", "cmp-fast"] and cmp["metric"] == "loss"
        for r in cmp["runs"]:
            assert len(r["points"]) == 60 and r["points"][0]["seconds"] == 0.0
            assert all(b["seconds"] >= a["seconds"] for a, b in zip(r["points"], r["points"][1:]))
        diffs = {d["key"]: d["values"] for d in cmp["config_differences"]}
        assert diffs["optim.lr"] == {"cmp-slow": 0.001, "cmp-fast": 0.05}
        assert diffs["model.hidden"] == {"cmp-slow": 16, "cmp-fast": 32}
        assert diffs["run.optimizer.lr"] == {"cmp-slow": 0.001, "cmp-fast": 0.05}  # from the run start itself
        assert diffs["run.total_params"] == {"cmp-slow": 161, "cmp-fast": 321}
        assert "data" not in diffs and cmp["config_same"] >= 3 and "loss" == cmp["metrics"][0]
        xml = http.get("/v1/compare", params=[("run", "cmp-slow"), ("run", "cmp-fast"), ("format", "xml")])
        assert xml.status_code == 200 and xml.text.startswith("<?xml")
        for bad, status in (([("run", "cmp-slow")] * 1 + [("run", f"r{i}") for i in range(8)], 422),
                            ([("run", "cmp-slow"), ("run", "no-such-run")], 404)):
            assert http.get("/v1/compare", params=bad).status_code == status

        dist = http.get("/v1/runs/cmp-fast/distribution", params={"collection": "gradients"}).json()
        assert dist["tensor"] == "0.weight" and dist["tensors"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert dist["sample"] == quantiles.SAMPLE and dist["levels"] == list(QUANTILE_LEVELS)
        assert [p["step"] for p in dist["points"]] == list(range(0, 60, 5))
        assert [bool(p["quantiles"]) for p in dist["points"]] == [p["step"] == 0 for p in dist["points"]]
        few = http.get("/v1/runs/cmp-fast/distribution",
                       params={"collection": "activations", "tensor": "1", "max_points": 3}).json()
        assert few["downsampled"] and len(few["points"]) <= 3 and few["points"][0]["quantiles"]
        assert min(p["min"] for p in dist["points"]) == min(
            p["min"] for p in http.get("/v1/runs/cmp-fast/distribution",
                                       params={"collection": "gradients", "max_points": 2}).json()["points"])
        missing = http.get("/v1/runs/cmp-fast/distribution", params={"tensor": "nope"})
        assert missing.status_code == 404 and "0.weight" in missing.json()["message"]


def test_the_hf_trainer_sends_its_arguments_and_model_config(tmp_path) -> None:
    pytest.importorskip("transformers")
    from tests.test_hf import Tokens, _args, tiny_bert
    from transformers import Trainer

    from probes.hf import TraindxCallback

    sink = MemorySink()
    callback = TraindxCallback(sink=sink, run="hf-config", config={"data": {"name": "tokens-256"}})
    Trainer(model=tiny_bert(), args=_args(tmp_path, max_steps=3, hub_token="secret-hub-token"),
            train_dataset=Tokens(), callbacks=[callback]).train()
    start = next(e for e in sink.events if e["kind"] == "run_start")
    config = start["run_config"]
    assert config["args.learning_rate"] == 1e-3 and config["args.optim"] == "sgd" and config["args.max_steps"] == 3
    assert config["model.hidden_size"] == 32 and config["model.num_labels"] == 2
    assert not any(k.startswith(("model.id2label", "model.label2id")) for k in config)
    assert config["trainer.max_steps"] == 3 and config["trainer.train_batch_size"] == 8
    assert config["data.name"] == "tokens-256"  # the callback's own config= joins what the Trainer knows
    assert "secret-hub-token" not in str(config)  # transformers redacts tokens in to_sanitized_dict
    RunStart.model_validate(start)


def test_the_lightning_trainer_sends_the_modules_hparams_and_its_settings() -> None:
    L = pytest.importorskip("lightning.pytorch")
    from probes.lightning import TraindxCallback

    class Data(L.LightningDataModule):
        def __init__(self, batch_size: int = 8, source: str = "synthetic") -> None:
            super().__init__()
            self.save_hyperparameters()

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            x = torch.randn(64, 8)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                               batch_size=self.hparams.batch_size)

    class Module(L.LightningModule):
        def __init__(self, lr: float = 0.05, hidden: int = 16, optim: Optim | None = None, act: Act = Act.gelu,
                     batch_size: int = 4) -> None:
            super().__init__()
            self.save_hyperparameters({"lr": lr, "hidden": hidden, "optim": optim or Optim(), "act": act,
                                       "batch_size": batch_size})
            self.net = mlp(hidden=hidden)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    sink = MemorySink()
    callback = TraindxCallback(sink=sink, run="pl-config", config={"data": {"name": "sums-64"}, "hidden": 17})
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_steps=3,
                        accumulate_grad_batches=2, gradient_clip_val=1.0, callbacks=[callback])
    trainer.fit(Module(lr=0.02), datamodule=Data())
    start = next(e for e in sink.events if e["kind"] == "run_start")
    config = start["run_config"]
    assert config["lr"] == 0.02 and config["optim.lr"] == 3e-4 and config["optim.betas"] == [0.9, 0.95]
    assert config["act"] == "gelu" and config["source"] == "synthetic"
    assert config["batch_size"] == 4  # the module's hyper-parameter over the datamodule's, as Lightning's loggers
    assert config["trainer.max_steps"] == 3 and config["trainer.accumulate_grad_batches"] == 2
    assert config["trainer.gradient_clip_val"] == 1.0 and config["trainer.precision"] == "32-true"
    assert config["data.name"] == "sums-64" and config["hidden"] == 17  # the callback's config= wins
    RunStart.model_validate(start)
