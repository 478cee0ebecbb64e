"""MCP tools of compression: a recipe, a prune fix from it, a sensitivity measurement in the job."""

from __future__ import annotations

from typing import Annotated, Literal

from mcp.server.mcpserver import Context
from pydantic import Field

from schemas.events import INT64_MAX, MAX_STEP
from schemas.records import CompressionRecipe, Fix

from ...compression import recipe as compression
from .server import READ, REQUEST, RunArg, actor, call, services


async def compression_recipe(
    run: RunArg,
    ctx: Context,
    target_sparsity: Annotated[float, Field(ge=0.0, lt=1.0, description="Fraction of all weights to zero.")] = 0.8,
    target_bytes: Annotated[int | None, Field(gt=0, le=INT64_MAX, description="A size budget in bytes instead.")] = None,
    structure: Annotated[Literal["unstructured", "channels"],
                         Field(description="Prune single weights or whole output channels.")] = "unstructured",
) -> CompressionRecipe:
    """A per-layer recipe (sparsity and precision fp32/fp16/bf16/int8) meeting the target sparsity or
    size at the least predicted loss increase, from the run's Fisher profiles (the 'fisher' collection;
    OBS/K-FAC saliencies) calibrated by held-batch sensitivity when measured, with the predicted size,
    loss increase and why each layer got what it got. Next: propose_prune to apply it live."""
    return await call(compression.recipe, services(ctx).store, run, target_sparsity, target_bytes=target_bytes,
                      structure=structure)


async def propose_prune(
    run: RunArg, ctx: Context,
    target_sparsity: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.8,
    target_bytes: Annotated[int | None, Field(gt=0, le=INT64_MAX)] = None,
    structure: Literal["unstructured", "channels"] = "unstructured",
    rounds: Annotated[int, Field(ge=1, le=1000, description="Gradual pruning: rounds on a cubic ramp.")] = 1,
    every: Annotated[int, Field(ge=0, le=MAX_STEP, description="Steps between two rounds; 0: all rounds at "
                                                               "once.")] = 1,
) -> Fix:
    """A 'prune' fix carrying the compression recipe's per-layer sparsities. Apply it with apply_fix: the
    job picks masks by Fisher saliency (OBS update where it has K-FAC factors) and keeps them for the
    rest of training, so it fine-tunes under them. revert_fix restores the weights."""
    return await call(compression.propose_prune, services(ctx).store, run, target_sparsity,
                      target_bytes=target_bytes, structure=structure, rounds=rounds, every=every, actor=actor(ctx))


async def measure_sensitivity(run: RunArg, ctx: Context) -> Fix:
    """Ask the job to measure, on its held batch, each layer's loss change when pruned alone and cast to
    fp16/bf16/int8 (needs probe.set_held_batch and allow=[..., 'sensitivity']). The next
    compression_recipe is calibrated by it."""
    return await call(compression.request_sensitivity, services(ctx).store, run, actor=actor(ctx))


TOOLS = ((compression_recipe, READ), (propose_prune, REQUEST), (measure_sensitivity, REQUEST))
