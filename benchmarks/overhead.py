"""Step-time overhead of the probe, measured side by side against the same loop without it.

    python benchmarks/overhead.py                 # default config, MLP (~186k params) and a 2-layer transformer
    python benchmarks/overhead.py --every-step    # every collection on, every step
    python benchmarks/overhead.py --rss           # peak RSS with and without the probe (separate processes)

Arms alternate within one run (off, on, off, on, ...); each "on" arm is paired with the "off" arm just
before it, and the figure is the median of those paired ratios, so that load drifting during the run
cancels out. An arm lasts about a second or two (the MLP 300 steps of ~3 ms, the transformer 100 steps
of ~20 ms), so that the machine drifts little within a pair, and holds whole sampling intervals (at the
default interval of 100: three sampled steps, and one), as a long run does. On a shared 2-core machine one
pair moves by +-5-10%: hence 21 pairs by default, 41 for the transformer's shorter arms. Events go to a
real `traindx serve` on a free port (--sink memory keeps them in the process instead).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import probes  # noqa: E402
from probes.sinks import MemorySink  # noqa: E402


def mlp() -> tuple[torch.nn.Module, callable]:
    model = torch.nn.Sequential(torch.nn.Linear(128, 320), torch.nn.ReLU(), torch.nn.Linear(320, 320), torch.nn.ReLU(),
                                torch.nn.Linear(320, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
    return model, lambda m: torch.nn.functional.cross_entropy(m(x), y)


def transformer() -> tuple[torch.nn.Module, callable]:
    layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=256, batch_first=True, dropout=0.0)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
                                torch.nn.Linear(128, 10))
    x, y = torch.randn(16, 32, 128), torch.randint(0, 10, (16, 32))
    return model, lambda m: torch.nn.functional.cross_entropy(m(x).reshape(-1, 10), y.reshape(-1))


MODELS = {"mlp": mlp, "transformer": transformer}
# Steps per arm and pairs of arms, by model, unless given: arms of 1-2 s (see the module docstring).
STEPS = {"mlp": 300, "transformer": 100}
REPEATS = {"mlp": 21, "transformer": 41}


def time_steps(model, loss_fn, opt, probe, steps: int, cpu: list[float] | None = None) -> float:
    """Mean step time over ``steps`` steps, in seconds: the mean, not the median, so the sampled steps
    (one in a hundred by default) are paid for in the figure. ``cpu`` gets the process's CPU time per
    step (every thread: the probe's sender included)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        if probe is not None:
            probe.step(loss=loss)
    if cpu is not None:
        cpu.append((time.process_time() - c0) / steps)
    return (time.perf_counter() - t0) / steps


def measure(name: str, *, server: str | None, repeats: int, steps: int, every_step: bool,
            interval: int | None = None) -> dict[str, list[float]]:
    """Per repeat: wall and CPU seconds per step without and with the probe, measured back to back."""
    torch.manual_seed(0)
    model, loss_fn = MODELS[name]()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kwargs = {"interval": 1} if every_step else ({"interval": interval} if interval else {})
    time_steps(model, loss_fn, opt, None, 50)  # warm-up
    r: dict[str, list[float]] = {"off": [], "on": [], "off_cpu": [], "on_cpu": []}
    for _ in range(repeats):
        r["off"].append(time_steps(model, loss_fn, opt, None, steps, r["off_cpu"]))
        p = probes.attach(model, opt, run=f"overhead-{name}", **({"sink": MemorySink()} if server is None else
                                                                  {"server": server}), **kwargs)
        time_steps(model, loss_fn, opt, p, 5)
        r["on"].append(time_steps(model, loss_fn, opt, p, steps, r["on_cpu"]))
        p.close()
        gc.collect()
    return r


def peak_rss(with_probe: bool, steps: int) -> float:
    code = f"""
import sys, resource, torch
sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
from overhead import mlp, time_steps
import probes
from probes.sinks import MemorySink
torch.manual_seed(0)
model, loss_fn = mlp()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
probe = probes.attach(model, opt, run="rss", sink=MemorySink()) if {with_probe} else None
time_steps(model, loss_fn, opt, probe, {steps})
if probe: probe.close()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def cold_memory(pages: int = 500, gaps: tuple[float, ...] = (0.001, 0.3), repeats: int = 7) -> dict[float, float]:
    """Seconds to read one byte of each of ``pages`` pages last read ``gap`` seconds ago, while this thread
    kept the CPU busy with other work (as training keeps it between two sampled steps). On bare metal the
    two gaps differ by cache misses (well under a microsecond a page); on some virtual machines memory left
    alone for a fraction of a second costs tens of microseconds a page to touch again, and a sampled step,
    whose code and data were last used one interval earlier, pays that for every page it touches."""
    buf = torch.ones(pages * 4096, dtype=torch.uint8)
    view = buf[::4096]
    view.sum()
    out = {}
    for gap in gaps:
        times = []
        for _ in range(repeats):
            end = time.perf_counter() + gap
            x = 0
            while time.perf_counter() < end:
                x += 1
            t0 = time.perf_counter()
            view.sum()
            times.append(time.perf_counter() - t0)
        out[gap] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=[*MODELS, "all"], default="all")
    ap.add_argument("--repeats", type=int, default=None, help="pairs of arms (default: 21, 41 for the transformer)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per arm and repeat (default: 300, 100 for the transformer)")
    ap.add_argument("--every-step", action="store_true", help="every collection on, sampled every step")
    ap.add_argument("--interval", type=int, default=None, help="sampling interval (default: the probe's default)")
    ap.add_argument("--sink", choices=["http", "memory"], default="http")
    ap.add_argument("--rss", action="store_true", help="measure peak RSS instead (MLP, memory sink)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core per arm: the machine is small and shared
    if args.rss:
        base, with_probe = peak_rss(False, 2000), peak_rss(True, 2000)
        print(f"peak RSS, MLP, 2000 steps: without probe {base:.1f} MB, with probe {with_probe:.1f} MB, "
              f"increase {with_probe - base:+.1f} MB (target <= 50 MB)")
        return
    server_proc, server = None, None
    if args.sink == "http":
        from diag_server.testing import serve
        server_proc = serve(tempfile.mkdtemp(prefix="traindx-bench-"))
        server = server_proc.url
        os.environ["TRAINDX_SPOOL"] = tempfile.mkdtemp(prefix="traindx-spool-")
    try:
        config = ("every collection, every step" if args.every_step else
                  f"interval {args.interval}" if args.interval else f"default (interval {probes.DEFAULT_INTERVAL})")
        target = 1.5 if args.every_step else 1.02
        cold = cold_memory()
        print(f"this machine: one byte of each of 500 pages, last read 1 ms ago: {cold[0.001] * 1e3:.2f} ms; "
              f"last read 300 ms ago (about the gap between two sampled steps here): {cold[0.3] * 1e3:.2f} ms "
              f"({cold[0.3] / cold[0.001]:.0f}x; see cold_memory())")
        print(f"probe overhead, {config}, sink={args.sink}")
        for name in (MODELS if args.model == "all" else [args.model]):
            repeats, steps = args.repeats or REPEATS[name], args.steps or STEPS[name]
            print(f"  {name}: {repeats} alternating repeats x {steps} steps")
            r = measure(name, server=server, repeats=repeats, steps=steps, every_step=args.every_step,
                        interval=args.interval)
            off, on = statistics.median(r["off"]), statistics.median(r["on"])
            paired = [b / a for a, b in zip(r["off"], r["on"])]
            cpu = statistics.median(r["on_cpu"]) / statistics.median(r["off_cpu"])
            print(f"  {name:12s} no probe {off * 1e3:7.3f} ms/step   probe {on * 1e3:7.3f} ms/step   "
                  f"ratio {statistics.median(paired):.3f}  (target <= {target}; median of the paired ratios)")
            print(f"  {'':12s} paired ratios {' '.join(f'{x:.3f}' for x in paired)}; ratio of the medians {on / off:.3f}; "
                  f"CPU time ratio {cpu:.3f} (this process, every thread)")
            every = 1 if args.every_step else (args.interval or probes.DEFAULT_INTERVAL)
            print(f"  {'':12s} cost of one sampled step: {(on - off) * every * 1e3:.2f} ms "
                  f"({(on - off) * every / off:.1f} steps without the probe)")
    finally:
        if server_proc is not None:
            server_proc.stop()


if __name__ == "__main__":
    main()
