"""Rules over the ranks of a distributed run, and over the modes (train, eval) of any run.

Each batch comes from one rank. The cross-rank rule keeps each rank's phase times per sampled step in
its state and judges a step once every rank has reported it, so it reads the same whichever rank's
batch arrives last. "Own" time is what a rank spends on its own work: its backward minus the time it
then waited at the gradient all-reduce (``comm_wait``), which is time spent waiting for the others.
"""

from __future__ import annotations

from schemas.enums import AnomalyKind, Severity

from .base import Finding, Observations, Param, Rule, per_key, median, push

OWN_PHASES = ("data_wait", "forward", "backward", "optimizer", "other")
_PHASE_ADVICE = {
    "data_wait": "its data loader is slower (more workers, or a faster source, for that rank; check its disk and CPU)",
    "forward": "it computes more (uneven batch or sequence lengths) or runs on a slower or busier device",
    "backward": "it computes more (uneven batch or sequence lengths) or runs on a slower or busier device",
    "optimizer": "its optimizer step is slower (CPU offload, or a busy host)",
    "other": "it does extra work between steps (logging, checkpointing or evaluation on that rank only)",
}


def step_phases(spans: list[dict]) -> dict[int, dict[str, float]]:
    """Training-mode spans of one rank by step, as {phase: seconds}, with own backward and 'other' time."""
    by_step: dict[int, dict[str, float]] = {}
    for s in spans:
        if s.get("mode", "train") != "train" or s["category"] not in ("step", "phase", "comm") or s.get("capture"):
            continue  # eval steps, user stages, and steps slowed by a capture's profiler are not compared
        by_step.setdefault(s["step"], {})[s["name"]] = s["duration"]
    out = {}
    for step, ph in by_step.items():
        if "step" not in ph:
            continue
        if "backward" in ph and "comm_wait" in ph:
            ph["backward"] = max(ph["backward"] - ph["comm_wait"], 0.0)
        named = sum(ph.get(p, 0.0) for p in ("data_wait", "forward", "backward", "optimizer", "comm_wait"))
        ph["other"] = max(ph["step"] - named, 0.0)
        out[step] = ph
    return out


def _seen_enough(hits: list, who: object, need: int) -> bool:
    return sum(1 for h in hits if h == who) >= need


class CrossRankTiming(Rule):
    all_ranks = True
    name = "cross_rank_timing"
    description = ("Across the ranks of a distributed run: a straggler (one rank's own time in a phase consistently "
                   "above the others', which makes the others wait at the all-reduce; a slow data loader on one "
                   "rank is the data-wait form of it) and a communication bottleneck (every rank spends a large "
                   "share of its step waiting for the gradient all-reduce).")
    kinds = (AnomalyKind.straggler_rank, AnomalyKind.comm_bottleneck)
    params = {
        "factor": Param(1.5, "cf. smdebug's LoadBalancing rule, which flags a 50% workload difference between "
                        "workers", "a rank's phase time over the other ranks' median that counts as slow"),
        "min_excess_s": Param(0.02, "measurement here: healthy 2- and 4-rank gloo runs of the suite on a shared 2-core "
                              "machine differ by under 10 ms per phase", "ignore differences below this (seconds)"),
        "min_share": Param(0.2, "measurement here", "the excess must also be this share of the median step time"),
        "wait_share": Param(0.5, "measurement here: healthy gloo runs of the suite wait under 30% of a step",
                            "share of the step that every rank spends waiting at the all-reduce"),
        "min_wait_s": Param(0.02, "measurement here", "ignore all-reduce waits shorter than this (seconds)"),
        "window": Param(5, "cf. smdebug's StepOutlier, which needs repeated outliers", "sampled steps judged together"),
        "hits": Param(3, "measurement here: one busy moment on a shared host never repeats 3 times in 5 samples",
                      "samples within the window that must agree"),
    }

    def initial_state(self) -> dict:
        return {"pending": {}, "straggler": [], "comm": [], "last": {}}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        if obs.world_size <= 1 or not obs.spans:
            return []
        pending = state["pending"]
        for step, ph in step_phases(obs.spans).items():
            pending.setdefault(str(step), {})[str(obs.rank)] = ph
        out: list[Finding] = []
        for key in sorted(pending, key=int):
            ranks = pending[key]
            if len(ranks) < obs.world_size:
                continue
            del pending[key]
            out.extend(self._judge(state, int(key), {int(r): v for r, v in ranks.items()}))
        for key in sorted(pending, key=int)[:-16]:  # a rank that stopped reporting: do not wait forever
            del pending[key]
        return per_key(out, obs.interval)

    def _judge(self, state: dict, step: int, ranks: dict[int, dict[str, float]]) -> list[Finding]:
        p, out = self.p, []
        step_median = median([v["step"] for v in ranks.values()])
        worst = None  # (excess, rank, phase, value, others)
        for phase in OWN_PHASES:
            for r, v in ranks.items():
                others = [o.get(phase, 0.0) for q, o in ranks.items() if q != r]
                base = median(others)
                mine = v.get(phase, 0.0)
                excess = mine - base
                if (excess >= p.min_excess_s and excess >= p.min_share * step_median and mine >= p.factor * base
                        and (worst is None or excess > worst[0])):
                    worst = (excess, r, phase, mine, base)
        push(state["straggler"], [worst[1], worst[2]] if worst else None, int(p.window))
        if worst is not None and _seen_enough(state["straggler"], [worst[1], worst[2]], int(p.hits)):
            excess, r, phase, mine, base = worst
            waits = {q: o.get("comm_wait") for q, o in ranks.items() if q != r and o.get("comm_wait") is not None}
            wait = median(list(waits.values())) if waits else None
            label = "load imbalance in data loading: " if phase == "data_wait" else ""
            out.append(Finding(
                AnomalyKind.straggler_rank, Severity.warning, step, key=f"rank{r}",
                message=(f"{label}Rank {r} is a straggler in {phase}: {mine * 1e3:.1f} ms against "
                         f"{base * 1e3:.1f} ms on the other ranks (step {step}, {int(p.hits)}+ of the last "
                         f"{int(p.window)} samples)"
                         + (f"; the other ranks wait {wait * 1e3:.1f} ms for it at the gradient all-reduce"
                            if wait else "")
                         + f". Likely {_PHASE_ADVICE[phase]}."),
                evidence={"rank": r, "phase": phase, "phase_time_s": mine, "others_median_s": base,
                          "excess_s": excess, "step_time_s": ranks[r]["step"], "others_wait_s": wait,
                          "world_size": len(ranks)}))
        waits = [v.get("comm_wait") for v in ranks.values()]
        if all(w is not None for w in waits):
            shares = [w / v["step"] for w, v in zip(waits, ranks.values()) if v["step"] > 0]
            low = min(shares) if shares else 0.0
            hit = low >= p.wait_share and min(waits) >= p.min_wait_s and worst is None
            push(state["comm"], bool(hit), int(p.window))
            if hit and _seen_enough(state["comm"], True, int(p.hits)):
                ar = median([v.get("allreduce", 0.0) for v in ranks.values()])
                out.append(Finding(
                    AnomalyKind.comm_bottleneck, Severity.warning, step, key="allreduce",
                    message=(f"Every rank spends at least {low:.0%} of its step waiting for the gradient all-reduce "
                             f"(median wait {median(waits) * 1e3:.1f} ms of a {step_median * 1e3:.1f} ms step, "
                             f"all-reduce {ar * 1e3:.1f} ms) and no rank is slower than the others: communication is "
                             "the bottleneck. Larger DDP buckets, gradient compression or fewer, larger steps help."),
                    evidence={"min_wait_share": low, "median_wait_s": median(waits), "median_allreduce_s": ar,
                              "step_time_s": step_median, "world_size": len(ranks)}))
        return out


class RankDataloaderBottleneck(Rule):
    all_ranks = True
    name = "rank_dataloader_bottleneck"
    description = ("In a distributed run, one rank's training step is dominated by waiting for its next batch. "
                   "Per rank, so the diagnosis names the rank whose loader starves.")
    kinds = (AnomalyKind.dataloader_bottleneck,)
    params = {
        "share": Param(0.3, "measurement here; cf. the PyTorch profiler's TensorBoard plugin, which recommends more "
                       "DataLoader workers when data loading is a large part of the step",
                       "share of the step spent waiting for data"),
        "min_wait_s": Param(0.01, "measurement here", "ignore data waits shorter than this (seconds)"),
        "window": Param(5, "as cross_rank_timing", "sampled steps judged together"),
        "hits": Param(3, "as cross_rank_timing", "samples within the window that must agree"),
    }

    def initial_state(self) -> dict:
        return {"hits": {}}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        if obs.world_size <= 1 or not obs.spans:
            return []
        out: list[Finding] = []
        hist = state["hits"].setdefault(str(obs.rank), [])
        for step, ph in sorted(step_phases(obs.spans).items()):
            wait, total = ph.get("data_wait"), ph["step"]
            hit = wait is not None and total > 0 and wait >= self.p.min_wait_s and wait / total >= self.p.share
            push(hist, bool(hit), int(self.p.window))
            if hit and _seen_enough(hist, True, int(self.p.hits)):
                out.append(Finding(
                    AnomalyKind.dataloader_bottleneck, Severity.warning, step, key=f"rank{obs.rank}",
                    message=(f"Rank {obs.rank} waits {wait * 1e3:.1f} ms for data in a {total * 1e3:.1f} ms step "
                             f"({wait / total:.0%}) at step {step}: its data loader cannot keep up. Give its DataLoader "
                             "more workers (num_workers), pin_memory and prefetching, or a faster source."),
                    evidence={"rank": obs.rank, "phase": "data_wait", "data_wait_s": wait, "step_time_s": total,
                              "share": wait / total}))
        return per_key(out, obs.interval)


class RankMemoryGrowth(Rule):
    all_ranks = True
    name = "rank_memory_growth"
    description = ("In a distributed run, one rank's memory (host RSS, or CUDA memory allocated) keeps growing "
                   "sample after sample: a leak on that rank (tensors kept in a list, a growing cache).")
    kinds = (AnomalyKind.memory_growth,)
    params = {
        "samples": Param(8, "measurement here", "consecutive samples looked at"),
        "min_growth_mb": Param(64, "measurement here: healthy runs of the suite settle within 20 MB after warm-up",
                               "growth over the samples that counts (MB)"),
        "min_growth_frac": Param(0.1, "measurement here", "and as a fraction of the first sample"),
        "rising": Param(0.75, "measurement here", "share of sample-to-sample changes that must be increases"),
    }
    SERIES = ("sys/rss_mb", "sys/cuda_allocated_mb")

    def initial_state(self) -> dict:
        return {"series": {}}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        if obs.world_size <= 1:
            return []
        out: list[Finding] = []
        n = int(self.p.samples)
        for name in self.SERIES:
            hist = state["series"].setdefault(f"{obs.rank}:{name}", [])
            for step, value in obs.series(name):
                if value is None:
                    continue
                push(hist, [step, value], n)
                if len(hist) < n:
                    continue
                first, last = hist[0][1], hist[-1][1]
                ups = sum(1 for a, b in zip(hist, hist[1:]) if b[1] > a[1])
                growth = last - first
                if (growth >= self.p.min_growth_mb and growth >= self.p.min_growth_frac * max(first, 1e-9)
                        and ups >= self.p.rising * (n - 1)):
                    what = "host memory (RSS)" if name == "sys/rss_mb" else "CUDA memory allocated"
                    out.append(Finding(
                        AnomalyKind.memory_growth, Severity.warning, step, key=f"rank{obs.rank}:{name}",
                        message=(f"Rank {obs.rank}'s {what} grew from {first:.0f} MB to {last:.0f} MB over steps "
                                 f"{hist[0][0]}-{step} and keeps rising: something on that rank holds on to tensors "
                                 "(a list of losses not detached, a cache). Check what it keeps between steps."),
                        evidence={"rank": obs.rank, "series": name, "first_mb": first, "last_mb": last,
                                  "growth_mb": growth, "since_step": hist[0][0]}, since=hist[0][0]))
        return per_key(out, obs.interval)


class ModeStepTimeOutlier(Rule):
    all_ranks = True
    name = "mode_step_time_outlier"
    description = ("Evaluation or inference steps (probe.mode('eval')) with a latency spike: the slowest step of a "
                   "block far above the mode's usual step time. Training steps are judged by step_time_outlier.")
    kinds = (AnomalyKind.step_time_outlier,)
    params = {
        "factor": Param(5.0, "measurement here; cf. smdebug's StepOutlier (3 standard deviations)",
                        "slowest step / median step time of the mode that counts as a spike"),
        "min_spike_s": Param(0.01, "measurement here", "ignore spikes shorter than this (seconds)"),
        "history": Param(20, "measurement here", "blocks of the mode kept for the median"),
    }

    def initial_state(self) -> dict:
        return {"means": {}}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out = []
        for name in obs.scalars:
            if not (name.startswith("sys/") and name.endswith("/step_time_max")) or name.count("/") != 2:
                continue
            mode = name.split("/")[1]
            means = dict(obs.series(f"sys/{mode}/step_time"))
            for step, worst in obs.series(name):
                mean = means.get(step)
                if worst is None or mean is None:
                    continue
                hist = state["means"].setdefault(mode, [])
                push(hist, mean, int(self.p.history))
                typical = median(hist)
                if typical > 0 and worst > self.p.factor * typical and worst - typical >= self.p.min_spike_s:
                    rank = f" on rank {obs.rank}" if obs.world_size > 1 else ""
                    out.append(Finding(
                        AnomalyKind.step_time_outlier, Severity.info, step, key=f"{mode}:rank{obs.rank}",
                        message=(f"A {mode} step{rank} took {worst * 1e3:.1f} ms, {worst / typical:.1f}x the usual "
                                 f"{typical * 1e3:.1f} ms of {mode} steps (block ending at training step {step})."),
                        evidence={"mode": mode, "rank": obs.rank, "max_s": worst, "typical_s": typical,
                                  "ratio": worst / typical}))
        return per_key(out, obs.interval)


RULES = [CrossRankTiming, RankDataloaderBottleneck, RankMemoryGrowth, ModeStepTimeOutlier]
