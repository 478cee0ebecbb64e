"""The MCP tools: thin typed wrappers over the same query and fix functions the HTTP routes call.

Each tool takes and returns pydantic models, so ``tools/list`` advertises input and output schemas and
every result carries structured content. Errors come back as tool errors with a message an agent can
act on (an unknown run lists the known runs; a stale fix says why).
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Callable, Literal, TypeVar

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

from schemas.enums import AnomalyKind, AnomalyStatus, Severity
from schemas.events import MAX_EMBEDDING_ROWS
from schemas.records import (AnomalyPage, AuditPage, CompressionRecipe, Diagnosis, EmbeddingTables, Fix, FixList, RunList, RunSummary,
                             Series)

from . import compression, diagnosis, fixes, queries
from .errors import ApiError
from .services import Services

T = TypeVar("T")

INSTRUCTIONS = """traindx watches live PyTorch training runs. Typical loop: list_runs -> get_anomalies(run)
(open, critical first) -> diagnose(run) for the root cause -> propose_fix(run, anomaly_id) -> apply_fix(run,
fix_id) -> get_fix_status(run, fix_id) until it is effective or ineffective -> revert_fix if it made things
worse. Fixes are applied by the job itself between two steps, only if the job allowed that action."""

RunArg = Annotated[str, Field(description="Run id, as listed by list_runs.")]
_READ = ToolAnnotations(read_only_hint=True, open_world_hint=False)

def _actor(ctx: Context | None) -> str:
    try:
        info = ctx.session.client_params.client_info  # type: ignore[union-attr]
        return f"mcp:{info.name}" if info and info.name else "mcp"
    except Exception:  # noqa: BLE001 - stateless requests may carry no client info
        return "mcp"

async def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    except ApiError as e:
        raise ToolError(f"{e.code}: {e}") from None

def build_mcp(services: Services, version: str) -> MCPServer:
    store = services.store
    server = MCPServer("traindx", instructions=INSTRUCTIONS, version=version)

    def tool(annotations: ToolAnnotations) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register a tool; its description is its docstring without the source's indentation."""
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            return server.tool(description=inspect.cleandoc(fn.__doc__ or ""), annotations=annotations)(fn)
        return register

    @tool(_READ)
    async def list_runs() -> RunList:
        """List every run the server knows, most recently active first, with its status (active, ended,
        stale), last step and count of open anomalies. Call this first to find the run id to pass to the
        other tools."""
        return await _call(queries.list_runs, store)

    @tool(_READ)
    async def get_run(run: RunArg) -> RunSummary:
        """Summary of one run: status, last step, latest value of every scalar (loss, val_loss, sys/...),
        open anomalies by kind, fixes by status, and the run's latest messages (the probe degraded or
        skipped a hook; the job ended on an uncaught exception or was killed by a signal, named there). Use
        it to check progress after a fix, and to learn why a run ended."""
        return await _call(queries.run_summary, store, run)

    @tool(_READ)
    async def get_anomalies(
        run: RunArg,
        kind: Annotated[AnomalyKind | None, Field(description="Only this anomaly kind.")] = None,
        severity: Annotated[Severity | None, Field(description="Only this severity.")] = None,
        status: Annotated[AnomalyStatus | None, Field(description="open or resolved; default both.")] = None,
        min_step: Annotated[int | None, Field(ge=0, description="Only anomalies still holding at or after this step.")] = None,
        max_step: Annotated[int | None, Field(ge=0, description="Only anomalies that began at or before this step.")] = None,
        offset: Annotated[int, Field(ge=0)] = 0,
        limit: Annotated[int, Field(ge=1, le=200, description="Page size.")] = 20,
    ) -> AnomalyPage:
        """The run's anomalies, open and critical first: kind, severity, first and last step, tensors
        involved, a one-sentence message and the evidence numbers. Next: call diagnose(run) for how they
        relate, or propose_fix(run, anomaly_id) for the one to fix. Page with offset/next_offset."""
        return await _call(queries.anomalies, store, run, kind=kind, severity=severity, status=status,
                           min_step=min_step, max_step=max_step, offset=offset, limit=limit)

    @tool(_READ)
    async def diagnose(run: RunArg) -> Diagnosis:
        """Rank the probable root causes of what went wrong in the run, each with the anomalies it explains,
        and a readable report. Fix the first cause first: its consequences often clear with it."""
        return await _call(diagnosis.diagnose, store, run)

    @tool(ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True,
          open_world_hint=False))
    async def propose_fix(run: RunArg, anomaly_id: Annotated[str, Field(description="e.g. 'a-3'")],
                          ctx: Context) -> FixList:
        """Candidate fixes for one anomaly, best first, computed from its evidence and the run's history
        (a clip norm from the healthy gradient norms, the learning rate the run was healthy at). Each has
        an id, action, params, rationale, expected effect, risk and whether it can be applied live. Next:
        apply_fix(run, fix_id) with the first live one. Proposing again returns the same ids."""
        return await _call(fixes.propose, store, run, anomaly_id, _actor(ctx))

    @tool(ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True,
          open_world_hint=False))
    async def apply_fix(run: RunArg, fix_id: Annotated[str, Field(description="e.g. 'f-5', from propose_fix")],
                        ctx: Context) -> Fix:
        """Queue a proposed fix for the live job. The job applies it at its next step boundary (only if it
        allowed that action) and acknowledges with before/after values: status goes pending -> applied
        (or rejected/failed with the reason), then effective or ineffective once the server has watched
        the anomaly. Poll get_fix_status. Applying twice applies once."""
        return await _call(fixes.apply, store, run, fix_id, _actor(ctx))

    @tool(_READ)
    async def get_fix_status(run: RunArg, fix_id: str) -> Fix:
        """Where a fix stands: proposed, pending, applied, rejected, failed, expired, effective, ineffective
        or reverted, with the reason and the job's before/after values. Once judged, get_audit(run, fix_id) has
        the verdict's detail: call revert_fix only when it says revert_suggested (the loss got worse); an
        ineffective fix that did no harm stays, since reverting restores the state the anomaly arose in."""
        return await _call(fixes.status, store, run, fix_id)

    @tool(_READ)
    async def get_audit(
        run: RunArg,
        fix_id: Annotated[str | None, Field(description="Only this fix's entries, e.g. 'f-5'.")] = None,
        offset: Annotated[int, Field(ge=0, le=2**31)] = 0,
        limit: Annotated[int, Field(ge=1, le=queries.MAX_PAGE, description="Page size.")] = 50,
    ) -> AuditPage:
        """The run's audit trail, oldest first: who asked for what (actor), what the job answered (before/after
        values), and each verdict with its detail: loss_before, loss_after and revert_suggested (true when the
        fix left the loss worse than before it: the one case where reverting it is known to help). Page with
        offset/next_offset."""
        return await _call(queries.audit_page, store, run, fix_id=fix_id, offset=offset, limit=limit)

    @tool(ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True,
          open_world_hint=False))
    async def revert_fix(run: RunArg, fix_id: str, ctx: Context) -> Fix:
        """Undo an applied fix in the job (restore the learning rate, remove a clip, ...). The status becomes
        reverted once the job acknowledges."""
        return await _call(fixes.revert, store, run, fix_id, _actor(ctx))

    @tool(_READ)
    async def compression_recipe(
        run: RunArg,
        target_sparsity: Annotated[float, Field(ge=0.0, lt=1.0, description="Fraction of all weights to zero.")] = 0.8,
        target_bytes: Annotated[int | None, Field(gt=0, description="A size budget in bytes instead.")] = None,
        structure: Annotated[Literal["unstructured", "channels"],
                             Field(description="Prune single weights or whole output channels.")] = "unstructured",
    ) -> CompressionRecipe:
        """A per-layer recipe (sparsity and precision fp32/fp16/bf16/int8) meeting the target sparsity or
        size at the least predicted loss increase, from the run's Fisher profiles (the 'fisher' collection;
        OBS/K-FAC saliencies) calibrated by held-batch sensitivity when measured, with the predicted size,
        loss increase and why each layer got what it got. Next: propose_prune to apply it live."""
        return await _call(compression.recipe, store, run, target_sparsity, target_bytes=target_bytes,
                           structure=structure)

    @tool(ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
          open_world_hint=False))
    async def propose_prune(
        run: RunArg, ctx: Context,
        target_sparsity: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.8,
        target_bytes: Annotated[int | None, Field(gt=0)] = None,
        structure: Literal["unstructured", "channels"] = "unstructured",
        rounds: Annotated[int, Field(ge=1, le=1000, description="Gradual pruning: rounds on a cubic ramp.")] = 1,
        every: Annotated[int, Field(ge=0, description="Steps between two rounds; 0: all rounds at once.")] = 1,
    ) -> Fix:
        """A 'prune' fix carrying the compression recipe's per-layer sparsities. Apply it with apply_fix: the
        job picks masks by Fisher saliency (OBS update where it has K-FAC factors) and keeps them for the
        rest of training, so it fine-tunes under them. revert_fix restores the weights."""
        return await _call(compression.propose_prune, store, run, target_sparsity, target_bytes=target_bytes,
                           structure=structure, rounds=rounds, every=every, actor=_actor(ctx))

    @tool(ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
          open_world_hint=False))
    async def measure_sensitivity(run: RunArg, ctx: Context) -> Fix:
        """Ask the job to measure, on its held batch, each layer's loss change when pruned alone and cast to
        fp16/bf16/int8 (needs probe.set_held_batch and allow=[..., 'sensitivity']). The next
        compression_recipe is calibrated by it."""
        return await _call(compression.request_sensitivity, store, run, actor=_actor(ctx))

    @tool(_READ)
    async def get_series(
        run: RunArg,
        name: Annotated[str, Field(description="A scalar such as 'loss', 'val_loss', 'sys/step_time', or a "
                                               "tensor name when collection is given.")],
        collection: Annotated[str | None, Field(description="weights, gradients, updates or activations.")] = None,
        field: Annotated[str, Field(description="Statistic of the tensor: norm, mean, std, ...")] = "norm",
        max_points: Annotated[int, Field(ge=2, le=2000)] = 100,
        rank: Annotated[int | None, Field(ge=0, description="In a distributed run, only this rank's points.")] = None,
    ) -> Series:
        """One metric over steps, downsampled to at most max_points."""
        return await _call(queries.series, store, run, name, collection=collection, field=field,
                           max_points=max_points, rank=rank)

    @tool(_READ)
    async def get_embeddings(
        run: RunArg,
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
        return await _call(queries.embeddings, store, run, table=table, rows=rows)

    @server.resource("traindx://runs/{run}/report", mime_type="text/plain",
                     description="The run's diagnosis as a report a person can read.")
    async def run_report(run: str) -> str:
        return (await _call(diagnosis.diagnose, store, run)).report

    @server.resource("traindx://schema", mime_type="application/schema+json",
                     description="The JSON Schema of every event and record (schemas/traindx.schema.json).")
    def contract_schema() -> str:
        import json

        from schemas.export import json_schema

        return json.dumps(json_schema())

    @server.prompt(description="Find what is wrong with a training run and fix it, step by step.")
    def triage_run(run: str) -> str:
        return (f"Training run {run!r} is being watched by traindx. 1) Call get_anomalies(run={run!r}, "
                "status='open') and read the most severe. 2) Call diagnose to find the root cause. 3) Call "
                "propose_fix for the root cause's anomaly and apply_fix with the first live proposal the job allows. "
                "4) Poll get_fix_status until it is effective or ineffective; if get_audit's verdict entry for the fix "
                "says revert_suggested, revert_fix; if ineffective, try the next proposal. Report what you found, what you changed (before -> after) and the verdict.")

    from .distributed_api import register_tools
    register_tools(tool, services)
    return server
