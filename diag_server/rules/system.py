"""System rules: the input pipeline, slow steps, host memory growth, CUDA allocator fragmentation.

They read the probe's ``sys/*`` scalars, which it sends on sampled steps.
"""

from __future__ import annotations

from schemas.enums import AnomalyKind, Severity

from .base import Finding, Observations, Param, Rule, median, per_key, push, streak


def _by_step(obs: Observations, *names: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for n in names:
        for s, v in obs.series(n):
            if v is not None:
                out.setdefault(s, {})[n] = v
    return out


class DataloaderBottleneck(Rule):
    name = "dataloader_bottleneck"
    description = ("The training loop spends most of each step waiting for the next batch (the time between "
                   "one step's end and the next forward pass).")
    kinds = (AnomalyKind.dataloader_bottleneck,)
    params = {
        "fraction": Param(0.5, "smdebug IOBottleneck threshold default (50% of the time waiting)",
                          "data wait / step time above this is a bottleneck"),
        "min_wait": Param(0.005, "measurement here: in-memory batching takes < 1.5 ms in the suite",
                          "seconds of data wait below which nothing is flagged"),
        "patience": Param(3, "measurement here: on a CPU loaded 6x over, healthy runs showed 2 consecutive "
                          "samples of scheduler pauses", "consecutive samples"),
        "spread": Param(3.0, "measurement here: a 10 ms loader's wait varies < 1.3x between samples",
                        "largest / smallest wait over those samples; above it the waits are noise"),
    }

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        for step, v in sorted(_by_step(obs, "sys/data_wait", "sys/step_time").items()):
            if "sys/data_wait" not in v or not v.get("sys/step_time"):
                continue
            wait, total = v["sys/data_wait"], v["sys/step_time"]
            frac = wait / total
            # A slow input pipeline slows every step, so the interval's mean step time includes its wait;
            # a wait longer than that mean was a one-off pause on the measured step (the OS, a GC), not a
            # bottleneck (measurement here: such pauses reach 9 ms on a loaded 2-core machine).
            if frac > 1.0:
                continue  # neither evidence nor counter-evidence
            waits = state.setdefault("waits", [])
            if frac > self.p.fraction and wait > self.p.min_wait:
                push(waits, wait, int(self.p.patience))
            else:
                waits.clear()
            # A slow loader costs about the same every step; a starved CPU makes erratic pauses.
            if len(waits) < self.p.patience or max(waits) > self.p.spread * min(waits):
                continue
            out.append(Finding(AnomalyKind.dataloader_bottleneck, Severity.warning, step,
                               message=(f"{frac:.0%} of a step ({wait * 1e3:.1f} ms of {total * 1e3:.1f} ms) is spent "
                                        f"waiting for data at step {step}. Use DataLoader workers (num_workers>0, "
                                        "pin_memory, prefetch) or move decoding out of the training loop."),
                               evidence={"data_wait_s": wait, "step_time_s": total, "fraction": frac,
                                         "threshold": self.p.fraction}))
        return per_key(out, obs.interval)


class StepTimeOutlier(Rule):
    name = "step_time_outlier"
    description = ("A step took many times longer than the run's recent median step, and many times longer than "
                   "the slowest steps of its recent intervals: a stall (a GC, a checkpoint, a recompilation, "
                   "another process). On a busy machine every interval has slow steps, so the slowest of each is "
                   "typical there and none stands out. Always info: a stall costs time, not the model.")
    kinds = (AnomalyKind.step_time_outlier,)
    params = {
        "factor": Param(10.0, "measurement here: on a shared CPU healthy suite steps vary up to ~40x, hence info",
                        "slowest step / median step time above this is an outlier"),
        "spread": Param(3.0, "measurement here (benchmarks/healthy.py on a 2-core machine loaded 2-3x over): the "
                        "slowest step of an interval stays within 3x of the median slowest step of the run's "
                        "recent intervals; a checkpoint-like stall of a job is 10x and more",
                        "the slowest step must also exceed this times the median of the recent intervals' slowest"),
        "min_seconds": Param(0.1, "measurement here", "outliers shorter than this are ignored"),
        "history": Param(20, "measurement here", "samples kept"),
    }

    def initial_state(self) -> dict:
        return {"times": [], "worst": [], "stalls": []}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        keep = int(self.p.history)
        stalls = state.setdefault("stalls", [])  # [sample number, step, seconds, x median step] of recent stalls
        for step, v in sorted(_by_step(obs, "sys/step_time", "sys/step_time_max").items()):
            mean, worst = v.get("sys/step_time"), v.get("sys/step_time_max")
            if mean is None:
                continue
            state["samples"] = state.get("samples", 0) + 1
            base = median(state["times"]) if len(state["times"]) >= 3 else None
            typical = median(state.setdefault("worst", [])) if len(state["worst"]) >= 3 else None
            push(state["times"], mean, keep)
            if worst is not None:
                push(state["worst"], worst, keep)
                if (base and typical and worst > self.p.factor * base and worst > self.p.spread * typical
                        and worst > self.p.min_seconds):
                    stalls.append([state["samples"], step, worst, worst / base])
            stalls[:] = [x for x in stalls if x[0] > state["samples"] - keep]
            if not stalls:
                continue
            # One anomaly while stalls recur within `history` samples, not one per stall: on a shared machine
            # they come every few hundred steps, and a list of them would bury what matters.
            _, at, took, times = max(stalls, key=lambda x: x[2])
            out.append(Finding(
                AnomalyKind.step_time_outlier, Severity.info, step, since=stalls[0][1],
                message=(f"{len(stalls)} stall(s) in the last {keep} samples, the longest a step before step {at} "
                         f"that took {took:.3g} s, {times:.0f}x the median step and over {self.p.spread:g}x the "
                         "slowest step of a typical interval: of the job's own (a GC, a checkpoint, a recompilation) "
                         "or of the machine (another process)."),
                evidence={"stalls": len(stalls), "steps": [x[1] for x in stalls], "step_time_max_s": took,
                          "x_median": times}))
        return per_key(out, obs.interval)


class MemoryGrowth(Rule):
    name = "memory_growth"
    description = ("Host memory (RSS) or CUDA allocated memory grows steadily from sample to sample: something "
                   "keeps tensors alive across steps (a list of losses or outputs, a growing cache). A process "
                   "settling in (allocator pools, lazily built caches, a first evaluation) grows too, in steps that "
                   "shrink or in one jump, and a busy allocator's memory rises and falls; a leak keeps its pace and "
                   "never gives memory back. So the growth is counted from the run's second sample on, must exceed "
                   "the largest fall the series has shown, and every change must keep the pace.")
    kinds = (AnomalyKind.memory_growth,)
    params = {
        "samples": Param(3, "measurement here: RSS of healthy suite runs is flat after the first sample",
                         "consecutive samples of growth"),
        "min_growth_mb": Param(16.0, "measurement here: healthy suite runs grow < 3 MB over a run",
                               "growth over those samples below this is ignored"),
        "monotone": Param(0.75, "measurement here", "fraction of sample-to-sample changes that must be increases"),
        "steady": Param(0.5, "measurement here (benchmarks/healthy.py): a ViT's RSS settles in by 16.4 then 3.8 "
                        "MB over its first two intervals (the last 0.38x the pace); the suite's kept tensors grow by "
                        "the same 20 MB every sample (1.0x)", "every change per step must be at least this "
                        "fraction of the growth per step over the samples"),
    }
    series_names = ("sys/rss_mb", "sys/cuda_allocated_mb")

    def initial_state(self) -> dict:
        return {n: [] for n in self.series_names}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        n = int(self.p.samples)
        for name in self.series_names:
            hist = state.setdefault(name, [])
            # The run's own history: whether its first sample went by, and the largest fall between two samples.
            seen = state.setdefault(f"{name}:seen", {"first": False, "fall": 0.0, "last": None})
            for step, value in obs.series(name):
                if value is None:
                    continue
                if seen["last"] is not None:
                    seen["fall"] = max(seen["fall"], seen["last"] - value)
                seen["last"] = value
                # The first sample is taken before the process settled in (the first evaluation, allocator pools,
                # caches built on first use): a baseline taken after a warmup iteration, as leak checkers take it.
                # Measurement here (benchmarks/healthy.py): a GPT-2's RSS rose 12 then 7 MB over its first two
                # intervals of 100 steps, then wandered within 10 MB for the rest of the run.
                if not seen["first"]:
                    seen["first"] = True
                    continue
                push(hist, [step, value], n)
                if len(hist) < n:
                    continue
                changes = [b[1] - a[1] for a, b in zip(hist, hist[1:])]
                growth = hist[-1][1] - hist[0][1]
                ups = sum(1 for c in changes if c > 0) / len(changes)
                rate = growth / max(hist[-1][0] - hist[0][0], 1)
                # A leak keeps its pace: every change of the window, per step, is a part of the pace over it. A
                # process settling in grows in steps that shrink, and a first evaluation in one jump (measurement
                # here, tests/test_healthy.py: a ViT's RSS grew 17 MB over steps 80-100, sampled every 10, around
                # its first evaluation at step 99).
                slowest = min(c / max(b[0] - a[0], 1) for c, a, b in zip(changes, hist, hist[1:]))
                # Memory that fell by X MB between two samples rises and falls by X MB: a growth within that is
                # the allocator's, not a leak's (a leak never gives memory back).
                if (growth > self.p.min_growth_mb and growth > seen["fall"] and ups >= self.p.monotone
                        and slowest >= self.p.steady * rate):
                    what = "Host memory (RSS)" if name == "sys/rss_mb" else "CUDA allocated memory"
                    out.append(Finding(
                        AnomalyKind.memory_growth, Severity.warning, step, key=name, tensors=[name],
                        message=(f"{what} grew {growth:.0f} MB over steps {hist[0][0]}-{step} "
                                 f"({rate:.2f} MB/step) and keeps growing. Something holds tensors across steps: "
                                 "append loss.item() not loss, detach what you keep, clear caches."),
                        evidence={"series": name, "growth_mb": growth, "mb_per_step": rate, "from_step": hist[0][0],
                                  "value_mb": hist[-1][1]}))
        return per_key(out, obs.interval)


class GpuMemoryFragmentation(Rule):
    name = "gpu_memory_fragmentation"
    description = ("The CUDA caching allocator holds far more memory than the tensors use: reserved but "
                   "unallocated blocks that can make a large allocation fail with out-of-memory.")
    kinds = (AnomalyKind.gpu_memory_fragmentation,)
    params = {
        "fraction": Param(0.5, "measurement here; PyTorch's CUDA notes suggest expandable_segments when reserved "
                          "memory far exceeds allocated", "unallocated / reserved above this is fragmented"),
        "min_mb": Param(1024.0, "measurement here: below 1 GiB the waste does not matter", "unallocated MB floor"),
        "patience": Param(3, "measurement here", "consecutive samples"),
    }

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        for step, v in sorted(_by_step(obs, "sys/cuda_reserved_mb", "sys/cuda_allocated_mb").items()):
            reserved, alloc = v.get("sys/cuda_reserved_mb"), v.get("sys/cuda_allocated_mb")
            if not reserved or alloc is None:
                continue
            free = reserved - alloc
            frag = free / reserved
            if streak(state, "streak", frag > self.p.fraction and free > self.p.min_mb) < self.p.patience:
                continue
            out.append(Finding(AnomalyKind.gpu_memory_fragmentation, Severity.warning, step,
                               message=(f"The CUDA allocator reserves {reserved:.0f} MB but tensors use {alloc:.0f} MB "
                                        f"({frag:.0%} unused) at step {step}. Set PYTORCH_CUDA_ALLOC_CONF="
                                        "expandable_segments:True, or keep tensor shapes steady."),
                               evidence={"reserved_mb": reserved, "allocated_mb": alloc, "fraction": frag}))
        return per_key(out, obs.interval)
