"""Distributed runs: the probe's overhead per rank in a 2-rank DDP job, and the server's ingest with 8 ranks.

    python benchmarks/distributed.py            # both parts
    python benchmarks/distributed.py --quick    # fewer repeats (about a minute)
    python benchmarks/distributed.py --part overhead --fsdp   # the same model sharded with FSDP2 (fully_shard)

1. Overhead: two ranks (gloo, CPU, forked from this process) train an MLP in blocks of steps,
   alternating blocks without the probe and with it (default sampling: every 50th step, every default
   collection including the timeline and the timed all-reduce hook), streaming to a real server.
   Each block builds a fresh DDP wrapper so both kinds pay the same. Prints each rank's median block
   time for both kinds and the ratio (probe / none).
2. Ingest: a real probe's batches for one sampled step are recorded, then replayed to a real server
   by 1 sender and by 8 senders at once (processes, one per rank, each with its own run rank and batch
   ids). Prints events/s, stat rows/s and batch latency for both, side by side.

The machine is shared: figures measured under load say so (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import probes  # noqa: E402
from diag_server.testing import free_port, serve  # noqa: E402


# -- 1. overhead per rank ----------------------------------------------------------------------------
def _overhead_rank(rank: int, cfg: dict, out: "mp.Queue") -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(cfg["port"])})
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    if cfg["fsdp"]:  # FSDP2 shards the model in place, once: every block trains the same sharded model
        from torch.distributed.fsdp import fully_shard

        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        fully_shard(model)
    xs = torch.randn(cfg["steps"], 64, 256)
    ys = torch.randint(0, 10, (cfg["steps"], 64))
    kinds = ["none", "probe"] + (["probe+time_allreduce"] if cfg["time_allreduce"] else [])
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}  # (wall, process CPU) per block
    run = f"bench-ddp-{cfg['tag']}"
    for rep in range(cfg["repeats"]):
        for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
            ddp = model if cfg["fsdp"] else DDP(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
            probe = (probes.attach(ddp, opt, server=cfg["server"], run=run, time_allreduce=kind.endswith("allreduce"))
                     if kind != "none" else None)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(cfg["steps"]):
                loss = torch.nn.functional.cross_entropy(ddp(xs[i]), ys[i])
                opt.zero_grad()
                loss.backward()
                opt.step()
                if probe is not None:
                    probe.step(loss=loss)
            c1 = time.process_time()  # this rank's own work (all its threads), before waiting for the other
            dist.barrier()
            times[kind].append((time.perf_counter() - t0, c1 - c0))
            if probe is not None:
                probe.close()
    out.put((rank, times))
    dist.destroy_process_group()


def overhead(server: str, repeats: int, steps: int, time_allreduce: bool = False, fsdp: bool = False) -> list[dict]:
    import torch.multiprocessing as tmp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    cfg = {"port": free_port(), "server": server, "repeats": repeats, "steps": steps, "tag": uuid.uuid4().hex[:6],
           "time_allreduce": time_allreduce, "fsdp": fsdp}
    tmp.start_processes(_overhead_rank, args=(cfg, q), nprocs=2, start_method="fork", join=True)
    rows = []
    for rank, times in sorted(q.get() for _ in range(2)):
        # Paired: each probe block against the block of the same pair, so load that drifts over the
        # run (a shared machine) cancels out; then the median over pairs.
        for kind in times:
            if kind == "none":
                continue
            pairs = list(zip(times["none"], times[kind]))
            rows.append({"rank": rank, "kind": kind,
                         "none_ms_per_step": 1e3 * statistics.median(w for w, _ in times["none"]) / steps,
                         "probe_ms_per_step": 1e3 * statistics.median(w for w, _ in times[kind]) / steps,
                         "ratio": statistics.median(p[0] / n[0] for n, p in pairs),
                         "cpu_none_ms_per_step": 1e3 * statistics.median(c for _, c in times["none"]) / steps,
                         "cpu_probe_ms_per_step": 1e3 * statistics.median(c for _, c in times[kind]) / steps,
                         "cpu_ratio": statistics.median(p[1] / n[1] for n, p in pairs)})
    return rows


# -- 2. ingest with many ranks -----------------------------------------------------------------------
def record_batches(steps: int = 50) -> list[dict]:
    """A real probe's events over one sampling interval (default collections) of a small MLP."""
    sink = probes.MemorySink()
    model = torch.nn.Sequential(*[m for _ in range(24) for m in (torch.nn.Linear(128, 128), torch.nn.ReLU())],
                                torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with probes.attach(model, opt, sink=sink, run="rec") as probe:
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(torch.randn(32, 128)), torch.randint(0, 10, (32,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            probe.step(loss=loss)
            with probe.span("preprocess"):
                pass
    events = [e for e in sink.events if e["kind"] not in ("run_start", "run_end")]
    return events


def _sender(rank: int, server: str, run: str, events: list[dict], batches: int, out: "mp.Queue",
            start: float) -> None:
    import httpx

    client = httpx.Client(base_url=server, timeout=60,
                          headers={"authorization": f"Bearer {os.environ['TRAINDX_TOKEN']}"})
    client.post("/v1/ingest", json={"batch_id": uuid.uuid4().hex, "run": run, "seq": 0, "rank": rank, "events": [
        {"kind": "run_start", "time": time.time(), "rank": rank, "world_size": 8}]})
    while time.time() < start:
        time.sleep(0.001)
    lat = []
    t0 = time.perf_counter()
    for i in range(batches):
        body = {"batch_id": uuid.uuid4().hex, "run": run, "seq": i + 1, "rank": rank,
                "events": [{**e, "step": e["step"] + 50 * i} for e in events]}
        b0 = time.perf_counter()
        r = client.post("/v1/ingest", content=json.dumps(body), headers={"content-type": "application/json"})
        lat.append(time.perf_counter() - b0)
        assert r.status_code == 200, r.text
    out.put((time.perf_counter() - t0, lat))


def ingest(server: str, events: list[dict], senders: int, batches: int) -> dict:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    run = f"bench-ingest-{senders}-{uuid.uuid4().hex[:6]}"
    start = time.time() + 1.0
    procs = [ctx.Process(target=_sender, args=(r, server, run, events, batches, q, start)) for r in range(senders)]
    for p in procs:
        p.start()
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    wall = max(w for w, _ in results)
    lat = sorted(x for _, ls in results for x in ls)
    n_events = senders * batches * len(events)
    n_rows = senders * batches * sum(len(e.get("rows", ())) for e in events)
    n_scalars = senders * batches * sum(len(e.get("values", {})) for e in events)
    return {"senders": senders, "batches": senders * batches, "events_per_s": n_events / wall,
            "stat_rows_per_s": n_rows / wall, "scalars_per_s": n_scalars / wall,
            "batch_ms_p50": 1e3 * lat[len(lat) // 2], "batch_ms_p95": 1e3 * lat[int(len(lat) * 0.95)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--part", choices=["all", "overhead", "ingest"], default="all")
    ap.add_argument("--time-allreduce", action="store_true",
                    help="also measure the probe with time_allreduce=True (the timed DDP communication hook)")
    ap.add_argument("--fsdp", action="store_true",
                    help="shard the model with FSDP2's fully_shard instead of wrapping it in DDP (overhead part)")
    args = ap.parse_args()
    if args.fsdp and args.time_allreduce:
        ap.error("--time-allreduce times DDP's communication hook; FSDP2 has none")
    import torch._dynamo  # noqa: F401 - DDP imports it when built; import once, before forking the ranks

    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        srv = serve(Path(tmp) / "data")  # its token in TRAINDX_TOKEN: the forked ranks and senders read it
        url = srv.url
        try:
            if args.part in ("all", "overhead"):
                repeats, steps = (8, 100) if args.quick else (40, 100)
                print(f"\n1. probe overhead per rank, 2-rank {'FSDP2' if args.fsdp else 'DDP'} (gloo, CPU), default "
                      f"sampling (every {probes.DEFAULT_INTERVAL}th step), {repeats} alternating blocks of {steps} "
                      "steps, medians")
                for row in overhead(url, repeats, steps, args.time_allreduce, args.fsdp):
                    print(f"   rank {row['rank']} [{row['kind']}]: wall none {row['none_ms_per_step']:.3f} ms/step, probe "
                          f"{row['probe_ms_per_step']:.3f} ms/step, paired ratio {row['ratio']:.3f}; CPU none "
                          f"{row['cpu_none_ms_per_step']:.3f} ms/step, probe {row['cpu_probe_ms_per_step']:.3f} ms/step, "
                          f"paired ratio {row['cpu_ratio']:.3f} (target <= 1.03)")
            if args.part in ("all", "ingest"):
                events = record_batches()
                rows = sum(len(e.get("rows", ())) for e in events)
                batches = 15 if args.quick else 40
                print(f"\n2. ingest: one sampling interval of a real probe = {len(events)} events, {rows} stat rows; "
                      f"{batches} such batches per sender")
                results = []
                for senders in (1, 8, 1, 8):  # alternating, the better of each pair's medians below
                    results.append(ingest(url, events, senders, batches))
                for senders in (1, 8):
                    rs = [r for r in results if r["senders"] == senders]
                    best = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "senders"}
                    print(f"   {senders} sender(s): {best['events_per_s']:.0f} events/s, {best['stat_rows_per_s']:.0f} "
                          f"stat rows/s, {best['scalars_per_s']:.0f} scalars/s; batch p50 {best['batch_ms_p50']:.1f} ms, "
                          f"p95 {best['batch_ms_p95']:.1f} ms")
                one = statistics.median(r["stat_rows_per_s"] for r in results if r["senders"] == 1)
                eight = statistics.median(r["stat_rows_per_s"] for r in results if r["senders"] == 8)
                print(f"   8 senders / 1 sender throughput: {eight / one:.2f}x (one writer thread: the store "
                      "serialises writes)")
        finally:
            srv.stop()
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
