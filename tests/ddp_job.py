"""Small DistributedDataParallel jobs on the CPU (gloo), launched with torch.multiprocessing by the tests.

``python tests/ddp_job.py '[{"rdzv_id": "a", "nproc": 2, "server": URL, ...}, ...]'`` runs each job in
turn (``"fsdp": true`` shards the model with FSDP2's ``fully_shard`` instead of wrapping it in DDP). Faults
are injected on one rank: ``"slow_forward": "R:S"`` sleeps S seconds in rank R's forward (a
straggler), ``"slow_data": "R:S"`` sleeps S seconds in rank R's data loader for every batch. ``"pace": S``
sleeps S seconds in every rank's forward, the same everywhere, so a job lasts long enough to be
watched. ``"recsys": true`` trains a matrix factorisation on each rank's half of the items instead (see
recsys()). Each rank gets the environment torchrun would give it. Not a test module (no test_ prefix).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path, where tests/probes/ (the probe's tests)
# would shadow the probes package: the checkout's root goes first instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

import probes  # noqa: E402


class Sleep(torch.nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return x


def _fault(spec: str | None, rank: int) -> float:
    if not spec:
        return 0.0
    who, _, seconds = spec.partition(":")
    return float(seconds) if int(who) == rank else 0.0


class MF(torch.nn.Module):
    """A recommender's tables: users and items, a dot product."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.user = torch.nn.Embedding(200, 16, sparse=sparse)
        self.item = torch.nn.Embedding(RECSYS_ITEMS, 16, sparse=sparse)

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return (self.user(u) * self.item(i)).sum(1)


RECSYS_ITEMS = 400
RECSYS_DEAD = range(100, 120)  # items no rank's data holds


def _recsys(rank: int, job: dict, noisy: bool = False) -> tuple:
    """Data-parallel matrix factorisation where each rank's data holds its own half of the items (rank 0
    the ids below 200, rank 1 the rest), but for RECSYS_DEAD, in no rank's data: a rank looks up only its
    half, and DDP's all-reduce moves every row any rank looked up. ``"sparse": true``: sparse gradients
    (reduced as the union of the ranks' rows) and SparseAdam. ``noisy``: items below 40 get a target of
    -2 or 4 at random (rows whose updates reverse). The model, its optimizer, and a batch's loss."""
    sparse = job.get("sparse", False)
    model = DDP(MF(sparse))
    opt = (torch.optim.SparseAdam if sparse else torch.optim.Adam)(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    half = RECSYS_ITEMS // job["nproc"]
    items = torch.tensor([i for i in range(rank * half, (rank + 1) * half) if i not in RECSYS_DEAD])

    def batch_loss() -> torch.Tensor:
        u = torch.randint(0, 200, (128,), generator=g)
        i = items[torch.randint(0, len(items), (128,), generator=g)]
        target = 1.0 + (i < 40).float() * (torch.randint(0, 2, (128,), generator=g).float() * 6 - 3) if noisy else 1.0
        return ((model(u, i) - target) ** 2).mean()
    return model, opt, batch_loss


def train_steps(opt: torch.optim.Optimizer, probe: probes.Probe, steps: int, batch_loss, before=None) -> None:  # noqa: ANN001
    """``steps`` training steps of ``batch_loss()`` (``before(step)`` first, when given), then the probe closed
    (tests/probes/embeddings/test_collection.py uses it too)."""
    for step in range(steps):
        if before is not None:
            before(step)
        loss = batch_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
    probe.close()


def recsys(rank: int, job: dict) -> None:
    """The recommender of _recsys, its probe sending to the job's server."""
    model, opt, batch_loss = _recsys(rank, job)
    probe = probes.attach(model, opt, server=job["server"], collections={"embeddings": job.get("interval", 20)},
                          flush_interval=0.1)
    train_steps(opt, probe, job.get("steps", 100), batch_loss)
    dist.destroy_process_group()
    _exit_rank()


def fix_sync(rank: int, job: dict) -> None:
    """The recsys model with noisy rows, a fix picked up by the ranks at different steps (``"inject": [step
    of rank 0, step of rank 1]``, -1: never), from a MemorySink: each rank writes what it acknowledged and a
    checksum of its parameters to fixsync-<rdzv_id>.rank<rank>.json in the working directory. Its lead is
    short (``LEAD_S``), so that the agreed step comes within the job's steps. ``"agreement": false``: each
    rank applies the fix when it picks it up, as before the ranks agreed (benchmarks/embeddings.py ddp-fix)."""
    import hashlib
    import json

    from probes import agreement

    agreement.LEAD_S = 0.5
    if not job.get("agreement", True):
        agreement.Agreement.for_job = classmethod(lambda cls, run, world_size: None)
    model, opt, batch_loss = _recsys(rank, job, noisy=True)
    sink = probes.MemorySink()
    probe = probes.attach(model, opt, sink=sink, collections={"embeddings": 5}, flush_interval=0.05,
                          allow=["embedding_grad_scale"])
    cmd = {"fix_id": "f-sync", "op": "apply", "action": "embedding_grad_scale",
           "params": {"table": "module.item.weight", "mode": "update", "min_factor": 0.1}}

    def inject(step: int) -> None:
        if step == job["inject"][rank]:
            sink.commands = [cmd]
    train_steps(opt, probe, job["steps"], batch_loss, inject)
    digest = hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    acks = [e for e in sink.events if e["kind"] == "fix_ack"]
    with open(f"fixsync-{job['rdzv_id']}.rank{rank}.json", "w") as f:
        json.dump({"acks": acks, "params": digest}, f)
    dist.destroy_process_group()
    _exit_rank()


def _exit_rank() -> None:
    """End the rank here, its probe closed (all it sends is sent) and its process group destroyed, before its
    model is freed. torch 2.13 tears down a DDP model with sparse gradients on gloo unreliably, with no probe
    attached (the recsys job's sparse configuration, on this machine): freed as the rank's function returns,
    2 runs in 6 hung (the process group's destructor joins its work threads with the GIL held, and they wait
    for it); freed before destroy_process_group, 1 in 8 aborted with "malloc(): unaligned tcache chunk
    detected", the abort a CI run hit. (A later CI run hit it again with this exit in place, so not only at
    the end: test_distributed.py runs that job apart, and once more if a rank is killed by a signal.)
    Nothing after this point is what the tests are about."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(rank: int, job: dict) -> None:
    """One rank of one job. Runs in a forked child: the launcher imported torch once for all of them."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(job["nproc"]),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job["port"]),
                       "TORCHELASTIC_RUN_ID": job["rdzv_id"]})  # what torchrun sets: all ranks agree on the run
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if job.get("recsys"):
        recsys(rank, job)
        return
    if job.get("fix_sync"):
        fix_sync(rank, job)
        return
    data_sleep = _fault(job.get("slow_data"), rank)
    model = torch.nn.Sequential(Sleep(job.get("pace", 0.0) + _fault(job.get("slow_forward"), rank)),
                                torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if job.get("fsdp"):
        # FSDP2: every Linear's parameters (and the root's) sharded across the ranks, as DTensors.
        from torch.distributed.fsdp import fully_shard

        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        ddp = fully_shard(model)
    else:
        ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randn(4096, 1, generator=g))

    def collate(batch: list) -> list:
        if data_sleep:
            time.sleep(data_sleep)
        return default_collate(batch)

    loader = iter(DataLoader(data, batch_size=16, collate_fn=collate))
    probe = probes.attach(ddp, opt, server=job["server"], interval=job.get("interval", 2), flush_interval=0.1,
                          time_allreduce=job.get("time_allreduce", False),
                          **({"run": job["run"]} if job.get("run") else {}))
    eval_every = job.get("eval_every", 0)
    until_capture = job.get("until_capture", False)
    for step in range(job.get("steps", 24) if not until_capture else 5000):
        if until_capture and step >= job.get("steps", 24):
            # Train on until every rank has finished a capture. The ranks agree through a collective,
            # so none stops while another still waits for it at an all-reduce.
            done = torch.tensor([float(probe.captures_done > 0)])
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item():
                break
        x, y = next(loader)
        with probe.span("preprocess"):
            x = (x - x.mean(0)) / (x.std(0) + 1e-6)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if job.get("fsdp") and step % job.get("interval", 2) == 0:
            # The whole tensors' norms at a sampled step (an all-gather, on every rank at once), logged for
            # the test to check the ranks' shard statistics against.
            full = {f"full_norm/{n}": p.full_tensor().norm().item() for n, p in model.named_parameters()}
            full.update({f"full_grad_norm/{n}": p.grad.full_tensor().norm().item() for n, p in model.named_parameters()})
            probe.log(step=step, **full)
        probe.step(loss=loss)
        if eval_every and (step + 1) % eval_every == 0:
            with probe.mode("eval"), torch.no_grad():
                for _ in range(3):
                    probe.step(loss=torch.nn.functional.mse_loss(model(x), y))
    probe.close()
    dist.destroy_process_group()
    _exit_rank()


def main() -> None:
    """Run each job of the JSON list in argv[1], one after the other, each on its own forked ranks."""
    import json
    import socket
    import sys

    import torch._dynamo  # noqa: F401 - DDP imports it when built: seconds, paid once here and not per rank
    import torch.multiprocessing as mp

    for job in json.loads(sys.argv[1]):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            job["port"] = sock.getsockname()[1]
        # fork: the children share the launcher's imported torch (no import per rank), and the launcher
        # has run no torch op, so there is no OpenMP state to inherit.
        mp.start_processes(train, args=(job,), nprocs=job["nproc"], start_method="fork", join=True)
        print(f"done {job['rdzv_id']}", flush=True)


if __name__ == "__main__":
    main()
