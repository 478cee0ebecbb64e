"""Fold a table's queued tracked steps into its per-row statistics, with a fixed number of operations.

The queued path (CUDA tables, other dtypes, installs without the native kernel): a tracked step only
copies rows; here the queue becomes one entry per (row, step), sorted by row then step, each lookup's
full-width rows are reduced to what the statistics read, and maths.fold_rows applies the steps to each
row in order (a segmented parallel scan: log2(steps) rounds, whatever the number of steps). O(lookups
queued x width).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import maths

if TYPE_CHECKING:
    from .state import QueuedStep, TableState


def fold_steps(table: TableState, pending: list[QueuedStep], entries: dict | None = None,
               buf: torch.Tensor | None = None) -> None:
    """Apply ``pending`` (in step order) to ``table``'s statistics; ``buf``: the queue's buffer its copies
    lie in; ``entries``: the sorts already made for tables looked up with the same ids, shared."""
    dev, n_steps = table.weight.device, len(pending)
    ids = torch.cat([p.ids for p in pending])
    entry, inv, count = _entries(pending, ids, entries, n_steps, dev)
    e = _reduce(table, pending, buf, ids, entry, inv, n_steps)
    row = entry // n_steps
    # A looked-up row with an exactly zero gradient did not learn; a NaN gradient (NaN != 0) is a touch.
    touched = e[:, 3] != 0
    if table.padding.numel():
        touched &= ~torch.isin(row, table.padding)
    row, e, count = row[touched], e[touched], count[touched].float()
    if row.numel() == 0:
        return
    # From here on, one row per quantity and one column per entry: element-wise operations between a
    # quantity and a per-entry scalar then broadcast along the contiguous dimension (5x faster on CPU).
    e = e.t().contiguous()
    rows, seg, per_row = torch.unique_consecutive(row, return_inverse=True, return_counts=True)
    old = table.row_state.index_select(0, rows)
    new = maths.fold_rows(e, count, old, seg, per_row, n_steps, table.k)
    table.counts += maths.row_counts(new) - maths.row_counts(old)
    table.row_state.index_copy_(0, rows, new)
    table.changed.add(rows)


def _entries(pending: list[QueuedStep], ids: torch.Tensor, entries: dict | None, n_steps: int,
             dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One entry per (row, step), sorted by row, then step (a row's touches are consecutive, in order): the
    entries' keys (row x n_steps + step), each lookup's entry, and each entry's lookups here.

    Tables looked up with the same index tensors (a user table and its bias table) share the sort. The
    forward hooks keep a view of each lookup's input, so two tables' views of one input have the same
    memory, length and stride (while queued, every view holds its memory: no address reuse)."""
    ident = tuple((p.ids.data_ptr(), p.ids.numel(), p.ids.stride(0)) for p in pending)
    if entries is not None and ident in entries:
        entry, inv, count = entries[ident]
    else:
        sizes = [p.ids.numel() for p in pending]
        steps = torch.repeat_interleave(torch.arange(n_steps, device=dev), torch.tensor(sizes, device=dev))
        key = ids * n_steps + steps
        entry, inv, count = torch.unique(key, return_inverse=True, return_counts=True)
        if entries is not None:
            entries[ident] = (entry, inv, count)
    if any(p.n_local is not None for p in pending):  # rows of a step with no lookup here (gather's extra) count 0
        looked = torch.cat([(torch.arange(p.ids.numel(), device=dev) < p.n_local) if p.n_local is not None
                            else torch.ones(p.ids.numel(), dtype=torch.bool, device=dev) for p in pending])
        count = torch.zeros(entry.numel(), dtype=torch.long, device=dev).index_add_(0, inv, looked.long())
    return entry, inv, count


def _reduce(table: TableState, pending: list[QueuedStep], buf: torch.Tensor | None, ids: torch.Tensor,
            entry: torch.Tensor, inv: torch.Tensor, n_steps: int) -> torch.Tensor:
    """Each lookup's full-width rows reduced at once to what the statistics read, one row per entry: the
    row's largest |element| after the step (finiteness), the norm of its step, whether the step was
    measured, the gradient's largest |element| (zero: no gradient; NaN or inf: a non-finite gradient) and
    its sketch. (abs().amax: linalg.vector_norm with ord 1 or inf is ~10x slower on CPU.)"""
    dev, E = table.weight.device, entry.numel()
    after = joined([p.after for p in pending], buf, 2).float()
    if all(p.before is not None for p in pending):
        step_norm = (after - joined([p.before for p in pending], buf, 1).float()).pow(2).sum(dim=1).sqrt()
        has_delta = torch.ones((), device=dev)
    else:
        step_norm = torch.cat([torch.linalg.vector_norm(p.after.float() - p.before.float(), dim=1)
                               if p.before is not None else torch.zeros(p.ids.numel(), device=dev) for p in pending])
        has_delta = torch.cat([torch.full((p.ids.numel(),), float(p.before is not None), device=dev) for p in pending])
    per_lookup = [maths.max_abs(after), step_norm, has_delta.expand(after.shape[0])]
    if all(isinstance(p.grad, torch.Tensor) for p in pending):
        # A dense gradient's row is the same at every lookup of it: reduce per lookup, keep one.
        g = joined([p.grad for p in pending], buf, 0).float()
        e = torch.cat([torch.stack([*per_lookup, maths.max_abs(g)], dim=1), table.sketch(g)], dim=1)
        return torch.zeros(E, e.shape[1], device=dev).index_copy_(0, inv, e)
    g = _sparse_rows(table, pending, ids, entry, inv, n_steps)
    e = torch.zeros(E, 3, device=dev).index_copy_(0, inv, torch.stack(per_lookup, dim=1))
    return torch.cat([e, maths.max_abs(g)[:, None], table.sketch(g)], dim=1)


def _sparse_rows(table: TableState, pending: list[QueuedStep], ids: torch.Tensor, entry: torch.Tensor,
                 inv: torch.Tensor, n_steps: int) -> torch.Tensor:
    """The gradient row of each entry where steps hold sparse gradients: entries of one row and step add up
    (one per lookup), summed at full width."""
    dev, E = table.weight.device, entry.numel()
    g = torch.zeros(E, table.dim, device=dev)
    sparse = [(i, p.grad) for i, p in enumerate(pending) if not isinstance(p.grad, torch.Tensor)]
    gi = torch.cat([x[0] for _, x in sparse])
    gv = torch.cat([x[1] for _, x in sparse]).float()
    if len(sparse) == n_steps and gi.numel() == inv.numel() and torch.equal(gi, ids):
        g.index_add_(0, inv, gv)  # the usual case: one gradient entry per lookup, in lookup order
        return g
    at = 0
    for p in pending:
        if isinstance(p.grad, torch.Tensor):
            g.index_copy_(0, inv[at:at + p.ids.numel()], p.grad.float())
        at += p.ids.numel()
    gstep = torch.repeat_interleave(torch.tensor([i for i, _ in sparse], device=dev),
                                    torch.tensor([x[0].numel() for _, x in sparse], device=dev))
    gkey = gi * n_steps + gstep
    pos = torch.searchsorted(entry, gkey).clamp_max(E - 1)
    hit = entry[pos] == gkey  # a sparse gradient row no forward hook saw is not a lookup
    g.index_add_(0, pos, torch.where(hit[:, None], gv, torch.zeros((), device=dev)))
    return g


def joined(parts: list[torch.Tensor], buf: torch.Tensor | None, slot: int) -> torch.Tensor:
    """torch.cat(parts), read (not copied) from the queue's buffer when the parts lie there end to end,
    as every step's copies do unless one did not fit."""
    if buf is not None:
        whole = buf[slot]
        base, row = whole.data_ptr(), whole.stride(0) * whole.element_size()
        n = 0
        for p in parts:
            if p.dtype != whole.dtype or p.data_ptr() != base + n * row:
                break
            n += p.shape[0]
        else:
            return whole[:n]
    return torch.cat(parts)
