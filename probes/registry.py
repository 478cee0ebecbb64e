"""What the probe can measure and what it can do, each listed once: COLLECTIONS and ACTIONS.

A collection or an action lives with the code it needs (the embeddings' with their statistics, the
compression actions with the pruning helpers); this module names them all, so that nothing registers
itself by being imported.
"""

from __future__ import annotations

from typing import Callable, Mapping

from . import fixes
from .collect import Activations, Collection, Gradients, System, Updates, Weights
from .compress_actions import prune, sensitivity
from .context import Timeline
from .embeddings import Embeddings, embedding_grad_scale
from .fisher import Fisher
from .fixes import Applied, Deferred, FixRejected, Target
from .reinit import reinit_dead_units

COLLECTIONS: dict[str, type[Collection]] = {
    c.name: c for c in (Weights, Gradients, Updates, Activations, System, Timeline, Fisher, Embeddings)
}

ACTIONS: dict[str, Callable[..., Applied | Deferred]] = {
    "lr_scale": fixes.lr_scale,
    "set_lr": fixes.set_lr,
    "grad_clip": fixes.grad_clip,
    "skip_nonfinite": fixes.skip_nonfinite,
    "grad_scale": fixes.grad_scale,
    "freeze": fixes.freeze,
    "unfreeze": fixes.unfreeze,
    "set_probe": fixes.set_probe,
    "rollback": fixes.rollback,
    "reinit_dead_units": reinit_dead_units,
    "embedding_grad_scale": embedding_grad_scale,
    "prune": prune,
    "sensitivity": sensitivity,
}
# The actions that register a hook under the fix's id, and so take it.
HOOKED = frozenset({"grad_clip", "skip_nonfinite", "grad_scale", "embedding_grad_scale", "prune"})


def apply(action: str, target: Target, params: Mapping, bounds: Mapping, fix_id: str) -> Applied | Deferred:
    """Apply ``action`` within ``bounds``; FixRejected when this probe has no such action."""
    fn = ACTIONS.get(action)
    if fn is None:
        raise FixRejected(f"this version of the probe cannot apply {action!r} live")
    if action in HOOKED:
        return fn(target, params, bounds, fix_id)
    return fn(target, params, bounds)
