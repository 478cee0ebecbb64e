"""TensorBoard export: a run's scalars, tensor statistics, anomalies and fixes as TensorBoard event files.

Written with ``torch.utils.tensorboard.SummaryWriter`` (TensorBoard's own event-file writer and
protobufs underneath), read straight from the store. What lands where, under ``DIR/RUN``:

- every scalar the job sent (``loss``, ``val_loss``, ``lr/group0``, ``sys/step_time``, ``amp/skipped``,
  ...) under its own name; a NaN/Inf value (stored as null) is written as NaN;
- per-tensor statistics as scalars ``<collection>/<tensor>/<field>`` (gradient norms, weight norm and
  std, update ratios, activation mean/std/dead and saturated fractions);
- histograms ``<collection>/<field>``: at each sampled step, the distribution of that field across the
  model's tensors (say, every layer's gradient norm). The store keeps summary statistics, not raw
  values, so a per-tensor histogram of raw values cannot be rebuilt, and none is invented;
- anomalies and fixes as text at the step they began or were applied.
"""

from __future__ import annotations

import bisect
import itertools
import math
import shutil
import sqlite3
from pathlib import Path

import orjson

from .queries import require_run

# Statistics exported per collection; the first is the one whose distribution across tensors becomes
# the collection's histogram. Collections not listed export 'norm'.
FIELDS: dict[str, tuple[str, ...]] = {
    "gradients": ("norm",),
    "weights": ("norm", "std"),
    "updates": ("update_ratio",),
    "activations": ("mean", "std", "dead_frac", "saturated_frac"),
}
_ALL_FIELDS = sorted({f for fs in FIELDS.values() for f in fs} | {"norm"})


def _value(v: float | None) -> float:
    return float("nan") if v is None else float(v)


class _Clock:
    """Wall time of a step, from the times the job stamped on its scalars (stats rows carry none)."""

    def __init__(self, conn: sqlite3.Connection, run: str, default: float) -> None:
        rows = conn.execute("SELECT step, min(time) FROM scalars WHERE run=? GROUP BY step ORDER BY step",
                            (run,)).fetchall()
        self.steps = [r[0] for r in rows]
        self.times = [r[1] for r in rows]
        self.default = default

    def __call__(self, step: int) -> float:
        i = bisect.bisect_right(self.steps, step) - 1
        return self.times[i] if i >= 0 else (self.times[0] if self.times else self.default)


def export_run(conn: sqlite3.Connection, run: str, out_dir: Path) -> dict[str, int]:
    """Write ``run`` under ``out_dir/run`` (replacing an earlier export); return what was written."""
    row = require_run(conn, run)
    from torch.utils.tensorboard import SummaryWriter

    logdir = Path(out_dir) / run
    if logdir.exists():
        shutil.rmtree(logdir)  # a second export would otherwise add every point twice
    clock = _Clock(conn, run, row["created_at"])
    counts = {"scalars": 0, "tensor_scalars": 0, "histograms": 0, "texts": 0}
    writer = SummaryWriter(log_dir=str(logdir), max_queue=1000, flush_secs=3600)
    try:
        for step, name, value, t in conn.execute(
                "SELECT step, name, value, time FROM scalars WHERE run=? ORDER BY step, rowid", (run,)):
            writer.add_scalar(name, _value(value), step, walltime=t)
            counts["scalars"] += 1

        import numpy as np

        cur = conn.execute(f"SELECT collection, step, tensor, {', '.join(_ALL_FIELDS)} FROM stats WHERE run=? "
                           "ORDER BY collection, step, rowid", (run,))
        for (collection, step), rows in itertools.groupby(cur, key=lambda r: (r["collection"], r["step"])):
            rows = list(rows)
            fields = FIELDS.get(collection, ("norm",))
            when = clock(step)
            for r in rows:
                for f in fields:
                    # A null norm or mean means NaN/Inf was in the tensor: written as NaN. Other fields
                    # are null where they do not apply (dead_frac of a tanh layer, say): skipped.
                    if r[f] is not None or f in ("norm", "mean"):
                        writer.add_scalar(f"{collection}/{r['tensor']}/{f}", _value(r[f]), step, walltime=when)
                        counts["tensor_scalars"] += 1
            values = np.array([r[fields[0]] for r in rows if r[fields[0]] is not None
                               and math.isfinite(r[fields[0]])], dtype=np.float64)
            if values.size:
                writer.add_histogram(f"{collection}/{fields[0]}", values, step, walltime=when)
                counts["histograms"] += 1

        for a in conn.execute("SELECT * FROM anomalies WHERE run=? ORDER BY first_step, seq", (run,)):
            evidence = orjson.loads(a["evidence"]) if a["evidence"] else {}
            text = (f"**{a['id']} {a['kind']}** ({a['severity']}, {a['status']}), steps {a['first_step']}-"
                    f"{a['last_step']}: {a['message']}  \nevidence: `{orjson.dumps(evidence).decode()}`")
            writer.add_text("anomalies", text, a["first_step"], walltime=a["created_at"])
            counts["texts"] += 1
        for f in conn.execute("SELECT * FROM fixes WHERE run=? AND applied_step IS NOT NULL ORDER BY seq", (run,)):
            text = (f"**{f['id']} {f['action']}** {f['params']} for {f['anomaly_id']}: {f['status']}; "
                    f"before {f['before']}, after {f['after']}")
            writer.add_text("fixes", text, f["applied_step"], walltime=f["updated_at"])
            counts["texts"] += 1
    finally:
        writer.close()
    return counts


def open_store_readonly(data_dir: Path) -> sqlite3.Connection:
    path = Path(data_dir) / "traindx.sqlite"
    if not path.exists():
        raise FileNotFoundError(f"no traindx store at {path} (pass --data, or set TRAINDX_DATA)")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    conn.row_factory = sqlite3.Row
    return conn
