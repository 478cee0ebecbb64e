"""Root-cause diagnosis: which anomaly came first, and which later ones follow from it.

This first version orders a run's anomalies by the step they began at and by the causal order of
their kinds (a learning-rate or input problem precedes exploding gradients, which precede a diverging
loss, which precedes NaN), and links each later anomaly to the earliest one that explains it.
"""

from __future__ import annotations

from schemas.enums import AnomalyKind
from schemas.records import Anomaly, Cause, Diagnosis

from .queries import anomalies as list_anomalies
from .store import Store

# Lower comes earlier in the usual chain of events.
_CAUSAL_ORDER = {
    AnomalyKind.input_not_normalized: 0, AnomalyKind.poor_weight_init: 0, AnomalyKind.output_range_mismatch: 0,
    AnomalyKind.dataloader_bottleneck: 0, AnomalyKind.abnormal_update_ratio: 1, AnomalyKind.vanishing_gradient: 1,
    AnomalyKind.exploding_gradient: 2, AnomalyKind.dead_relu: 2, AnomalyKind.saturated_activation: 2,
    AnomalyKind.oscillating_loss: 3, AnomalyKind.loss_divergence: 3, AnomalyKind.loss_not_decreasing: 3,
    AnomalyKind.nonfinite: 4,
    # A slow rank makes the others wait at the all-reduce: the straggler comes before the waiting.
    AnomalyKind.straggler_rank: 1, AnomalyKind.comm_bottleneck: 2,
}
# An anomaly that began within this many steps after another may be its consequence.
CONSEQUENCE_WINDOW = 500


def _explains(cause: Anomaly, effect: Anomaly) -> bool:
    return (cause.id != effect.id and _CAUSAL_ORDER.get(cause.kind, 5) < _CAUSAL_ORDER.get(effect.kind, 5)
            and cause.first_step <= effect.first_step <= cause.first_step + CONSEQUENCE_WINDOW)


def diagnose(store: Store, run: str) -> Diagnosis:
    page = list_anomalies(store, run, limit=500)
    found = sorted(page.anomalies, key=lambda a: (a.first_step, _CAUSAL_ORDER.get(a.kind, 5)))
    explained: set[str] = set()
    causes: list[Cause] = []
    for a in found:
        if a.id in explained:
            continue
        effects = [b for b in found if _explains(a, b) and b.id not in explained]
        explained.update(b.id for b in effects)
        tensor = a.tensors[0] if a.tensors else None
        chain = "".join(f" -> {b.kind.value} at step {b.first_step} ({b.id})" for b in effects)
        causes.append(Cause(anomaly_id=a.id, kind=a.kind, step=a.first_step, tensor=tensor,
                            explanation=f"{a.message}{chain}", consequences=[b.id for b in effects]))
    if not causes:
        summary = f"No anomalies in run {run!r}: nothing has gone wrong that the rules can see."
    else:
        top = causes[0]
        summary = (f"{len(causes)} independent problem(s). First: {top.kind.value} at step {top.step}"
                   + (f" in '{top.tensor}'" if top.tensor else "")
                   + (f", which explains {len(top.consequences)} later anomaly(ies)" if top.consequences else "") + ".")
    lines = [f"Diagnosis of run {run}", summary, ""]
    for i, c in enumerate(causes, 1):
        lines.append(f"{i}. [{c.anomaly_id}] {c.kind.value} from step {c.step}"
                     + (f" ({c.tensor})" if c.tensor else ""))
        lines.append(f"   {c.explanation}")
    return Diagnosis(run=run, summary=summary, causes=causes, report="\n".join(lines))
