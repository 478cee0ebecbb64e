"""MCP tools over a run's measurements: one metric over steps, the embedding tables' reports."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import Context
from pydantic import Field

from schemas.events import MAX_EMBEDDING_ROWS, MAX_WORLD_SIZE
from schemas.records import EmbeddingTables, Series

from ...read import queries
from .server import READ, RunArg, call, services


async def get_series(
    run: RunArg,
    name: Annotated[str, Field(description="A scalar such as 'loss', 'val_loss', 'sys/step_time', or a "
                                           "tensor name when collection is given.")],
    ctx: Context,
    collection: Annotated[str | None, Field(description="weights, gradients, updates or activations.")] = None,
    field: Annotated[str, Field(description="Statistic of the tensor: norm, mean, std, ...")] = "norm",
    max_points: Annotated[int, Field(ge=2, le=2000)] = 100,
    rank: Annotated[int | None, Field(ge=0, le=MAX_WORLD_SIZE - 1, description="In a distributed run, only this "
                                                                              "rank's points.")] = None,
) -> Series:
    """One metric over steps, downsampled to at most max_points."""
    return await call(queries.series, services(ctx).store, run, name, collection=collection, field=field,
                      max_points=max_points, rank=rank)


async def get_embeddings(
    run: RunArg,
    ctx: Context,
    table: Annotated[str | None, Field(description="One table: 'item.weight' or 'item'; omit for every table.")] = None,
    rows: Annotated[int, Field(ge=0, le=MAX_EMBEDDING_ROWS, description="Most rows listed per list.")] = 20,
) -> EmbeddingTables:
    """The run's embedding tables (nn.Embedding / EmbeddingBag, the 'embeddings' collection) as their latest
    report described them: rows touched and never updated, non-finite rows, median update count, the
    effective rank and mean pairwise cosine of sampled rows (collapse), and the worst rows of each kind with
    their update frequency, velocity, direction consistency, temporal SNR and per-lookup noise: 'zombies'
    (noisy rows whose updates reverse, worst first), 'rarest', 'conflicted' (rows whose data has pulled them
    harder than their peers' over the whole run, 'run_score': conflicting or corrupted labels, even once the
    model has memorised them), 'dead_ids', 'nonfinite_ids'. Use it to look at a table a zombie_embedding,
    dead_embedding or embedding_collapse anomaly names, or to audit a table's data."""
    return await call(queries.embeddings, services(ctx).store, run, table=table, rows=rows)


TOOLS = ((get_series, READ), (get_embeddings, READ))
