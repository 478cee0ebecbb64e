"""Fix proposals for the anomalies of distributed runs and of eval/inference modes.

Most of them cannot be fixed from inside a running job: a slow rank's data loader, the DDP bucket size
and the communication hook are fixed when the job starts. Those come as advice with exact
instructions, never as a live fix. What the probe can change live is its own sampling (``set_probe``),
offered to look closer, with an expected effect that says it fixes nothing.
"""

from __future__ import annotations

import sqlite3
from typing import Callable

from schemas.enums import AnomalyKind, FixAction
from schemas.records import Anomaly

from .candidates import Candidate

# The rules whose anomalies are proposed for here (other rules of the same kinds keep their own proposers).
RULES = {"cross_rank_timing", "rank_dataloader_bottleneck", "rank_memory_growth", "mode_step_time_outlier"}
CLOSER_INTERVAL = 5


def _advice(text: str, rationale: str, effect: str) -> Candidate:
    return Candidate(FixAction.advice, {"instructions": text}, rationale, effect, "low", live=False)


def _closer_look(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    row = conn.execute("SELECT start FROM runs WHERE run=?", (a.run,)).fetchone()
    import orjson

    interval = int(orjson.loads(row[0]).get("config", {}).get("interval") or 50) if row and row[0] else 50
    if interval <= CLOSER_INTERVAL:
        return []
    return [Candidate(FixAction.set_probe, {"interval": CLOSER_INTERVAL},
                      f"Sample every {CLOSER_INTERVAL} steps instead of every {interval}, so the timeline shows every "
                      "rank's phases at a finer grain while you act on the advice. This measures; it does not fix.",
                      f"No change to the problem itself; {interval // CLOSER_INTERVAL}x more samples (and probe "
                      "overhead) until reverted.", "low")]


def _where(a: Anomaly) -> tuple[object, object]:
    return a.evidence.get("rank"), a.evidence.get("phase")


def _straggler(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    rank, phase = _where(a)
    host = conn.execute("SELECT host FROM ranks WHERE run=? AND rank=?", (a.run, rank)).fetchone()
    on = f"rank {rank}" + (f" (host {host[0]})" if host and host[0] else "")
    steps = {
        "data_wait": (f"Feed {on} faster: DataLoader(dataset, num_workers=8, pin_memory=True, persistent_workers=True, "
                      "prefetch_factor=4) on every rank (raise num_workers until that rank's data_wait on the timeline "
                      "is under 10% of its step); check that rank's storage and that its DistributedSampler shard is "
                      "not larger or slower to decode than the others'."),
        "forward": (f"Balance the work: give {on} the same batch size as the others (DistributedSampler with "
                    "drop_last=True; bucket sequences by length), and check its device: another process on it "
                    "(nvidia-smi / top), thermal throttling, or a slower GPU model."),
        "backward": (f"Balance the work: give {on} the same batch size as the others (DistributedSampler with "
                     "drop_last=True; bucket sequences by length), and check its device for other processes or "
                     "throttling."),
        "optimizer": (f"{on}'s optimizer step is slower: check for CPU offload or a busy host there; use a fused "
                      "optimizer (torch.optim.AdamW(..., fused=True)) on GPU."),
        "other": (f"{on} does work between steps that the others do not (logging, checkpointing or evaluation on "
                  "one rank): do it every N steps, asynchronously (torch.distributed.checkpoint.async_save), or "
                  "spread it over the ranks."),
    }
    text = steps.get(str(phase), f"Look at {on} in the timeline (traindx timeline RUN -o trace.json).")
    return [_advice(text, f"Rank {rank} is slow in {phase}; every other rank waits for it at each all-reduce, so the "
                          "whole job runs at its pace.",
                    "After a restart with the change, the step time falls to the other ranks' pace and their "
                    "comm_wait shrinks."),
            *_closer_look(conn, a)]


def _comm(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    text = ("Reduce or hide gradient communication, then restart: (1) larger buckets, "
            "DistributedDataParallel(model, bucket_cap_mb=100, gradient_as_bucket_view=True) (default 25 MB); "
            "(2) compress gradients with a DDP communication hook, passed through the probe so it stays timed: "
            "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks; "
            "probes.attach(ddp_model, optimizer, comm_hook=default_hooks.bf16_compress_hook) "
            "(fp16_compress_hook on older GPUs; powerSGD_hook with PowerSGDState(process_group=None, "
            "matrix_approximation_rank=1, start_powerSGD_iter=1000) for more); (3) accumulate gradients over k "
            "micro-batches and skip the all-reduce on k-1 of them with `with ddp_model.no_sync():`.")
    return [_advice(text, f"Every rank waits {a.evidence.get('min_wait_share', 0):.0%}+ of its step for the all-reduce "
                          "while no rank is slower than the others: the network, not a straggler, sets the pace.",
                    "Less exposed communication per step after the restart; watch comm_wait on the timeline."),
            *_closer_look(conn, a)]


def _dataloader(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    rank = a.evidence.get("rank")
    share = a.evidence.get("share") or 0.0
    text = (f"On rank {rank}: DataLoader(dataset, num_workers=8, pin_memory=True, persistent_workers=True, "
            "prefetch_factor=4) (start at the CPU cores per rank, at most 8-16), move decoding and augmentation into "
            "the workers (or onto the GPU), and restart. Raise num_workers until sys/data_wait is under 10% of the step.")
    return [_advice(text, f"Rank {rank} spends {share:.0%} of each step waiting for its next batch.",
                    "The waiting share falls after the restart; with DDP the other ranks stop waiting for this one.")]


def _memory(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    rank = a.evidence.get("rank")
    text = (f"On rank {rank}: look for what survives a step: losses or outputs appended to a list without "
            ".item() or .detach(), a cache keyed by batch, metrics kept on the device; profile it with "
            "`traindx capture RUN --steps 3` (memory per operator) or torch.cuda.memory._record_memory_history(). "
            "Fix the code and restart; empty_cache() does not free what is still referenced.")
    return [_advice(text, f"Rank {rank}'s memory rises steadily ({a.evidence.get('growth_mb', 0):.0f} MB so far).",
                    "Memory stays flat after the fix; left alone, the rank runs out of memory and the job stops.")]


def _mode_outlier(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    mode = a.evidence.get("mode", "eval")
    text = (f"Find what the slow {mode} step did: wrap its stages in `with probe.span(\"...\"):` and read the "
            f"timeline, or request `traindx capture RUN --steps 3` during {mode}. Usual causes: a first call that "
            "compiles or warms up (exclude it), a batch larger than the others, or a garbage-collection pause.")
    return [_advice(text, f"One {mode} step took {a.evidence.get('ratio', 0):.1f}x the usual time.",
                    "Steadier latency once the cause is removed.")]


MINE: dict[AnomalyKind, Callable[[sqlite3.Connection, Anomaly], list]] = {
    AnomalyKind.straggler_rank: _straggler,
    AnomalyKind.comm_bottleneck: _comm,
    AnomalyKind.dataloader_bottleneck: _dataloader,
    AnomalyKind.memory_growth: _memory,
    AnomalyKind.step_time_outlier: _mode_outlier,
}


def install(proposers: dict) -> None:
    """Add the proposers for this module's rules, keeping other rules' proposers for the same kinds."""
    for kind, mine in MINE.items():
        other = proposers.get(kind)

        def propose(conn: sqlite3.Connection, a: Anomaly, mine=mine, other=other) -> list:
            if a.rule in RULES or other is None:
                return mine(conn, a)
            return other(conn, a)

        proposers[kind] = propose
