"""Reading commands for people at a terminal: ``traindx runs``, ``run RUN``, ``anomalies RUN``, ``diagnose RUN``,
``fixes RUN`` (and ``propose``/``apply``/``revert`` to act). They talk to a running server over HTTP, like
the dashboard and the Python client, and print readable tables, or the server's own JSON/XML for scripts.
The token is found as the probe finds it (``schemas.auth``): $TRAINDX_TOKEN, else DATA/token.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from typing import Any, Callable, Sequence

import click

from schemas.auth import token_places
from schemas.enums import RUN_ID_PATTERN
from schemas.events import MAX_EMBEDDING_ROWS

from .client import DEFAULT_SERVER, Client, TraindxError, api_path
from .rules.embeddings import unused_tail


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(getattr(value, "value", value))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, wrap_last: bool = True) -> str:
    """Columns padded to their widest cell; the last column is cut to fit the terminal."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    room = shutil.get_terminal_size((120, 20)).columns - sum(w + 2 for w in widths[:-1])
    if wrap_last and widths:
        widths[-1] = max(min(widths[-1], max(room, 20)), len(headers[-1]))  # a narrow terminal still shows 20
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    for r in cells:
        last = r[-1] if len(r[-1]) <= widths[-1] else r[-1][: widths[-1] - 1] + "…"
        out.append("  ".join([c.ljust(w) for c, w in zip(r[:-1], widths)] + [last]).rstrip())
    return "\n".join(out)


RUN_COLUMNS = ["RUN", "STATUS", "STEP", "OPEN", "DEVICE", "PARAMS"]


def _run_row(r: Any) -> list[Any]:
    return [r.run, r.status, r.last_step, r.open_anomalies, r.device, r.total_params]


def past_conflict_floor(row: Any) -> bool:
    """Whether a conflicted row is at the list's floor of 2 or past it: its run_score, or, from a probe before
    run_score (2026-12-01), which ranked the list by run_noise, its run_noise."""
    score = row.run_score if row.run_score is not None else row.run_noise
    return score is not None and score >= 2


def _run_id(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A RUN argument is a run id as the probe sends it: anything else (``../../etc``) names no run, and is
    refused before a request is made."""
    if not re.fullmatch(RUN_ID_PATTERN, value):
        raise click.BadParameter(f"{value!r} is not a run id (a letter or digit, then letters, digits, '.', '_', "
                                 "':' or '-'; at most 128); `traindx runs` lists them")
    return value


run_argument = click.argument("run", callback=_run_id)


def _options(f: Callable) -> Callable:
    f = click.option("--server", default=lambda: os.environ.get("TRAINDX_SERVER", DEFAULT_SERVER),
                     show_default="$TRAINDX_SERVER or " + DEFAULT_SERVER, help="The traindx server to ask.")(f)
    f = click.option("--json", "fmt", flag_value="json", help="Print the server's JSON.")(f)
    f = click.option("--xml", "fmt", flag_value="xml", help="Print the server's XML (valid against the XSD).")(f)
    return f


class _Cmd:
    """One command's connection: tables through the typed client, --json/--xml straight from the server."""

    def __init__(self, server: str, fmt: str | None) -> None:
        # The token found as the probe finds it (schemas.auth); the person from $TRAINDX_ACTOR or the OS user.
        self.client = Client(server)
        self.fmt = fmt
        self.server = server

    def run(self, path: str, show: Callable[[], str], method: str = "GET", **params: Any) -> None:
        try:
            if self.fmt:
                sys.stdout.buffer.write(self.client.raw(method, path, format=self.fmt, **params))
                if self.fmt == "json":
                    sys.stdout.write("\n")
            else:
                click.echo(show())
        except TraindxError as e:
            hint = f" (the token is looked for in {token_places()})" if e.status == 401 else ""
            raise click.ClickException(f"{e.error.error}: {e.error.message}{hint}") from None
        except Exception as e:  # noqa: BLE001 - httpx transport errors: say what to do
            if type(e).__module__.startswith("httpx"):
                raise click.ClickException(f"cannot reach the traindx server at {self.server} ({e}); start one "
                                           "with `traindx serve` or pass --server / set TRAINDX_SERVER") from None
            raise
        finally:
            self.client.close()


def register(main: click.Group) -> None:
    @main.command()
    @click.option("--status", type=click.Choice(["active", "ended", "stale"]), help="Only runs in this state.")
    @_options
    def runs(status: str | None, server: str, fmt: str | None) -> None:
        """List runs, most recently active first."""
        c = _Cmd(server, fmt)

        def show() -> str:
            rs = c.client.runs(status=status)
            if not rs:
                return "no runs yet"
            return table(RUN_COLUMNS, [_run_row(r) for r in rs])

        c.run("/v1/runs", show, status=status, limit=500)

    @main.command("run")
    @run_argument
    @_options
    def run_summary(run: str, server: str, fmt: str | None) -> None:
        """One run: status, latest scalars, open anomalies by kind, fixes by status, latest messages."""
        c = _Cmd(server, fmt)

        def show() -> str:
            s = c.client.run(run)
            out = [table(RUN_COLUMNS, [_run_row(s.run)]), ""]
            out.append(table(["SCALAR", "LATEST"], sorted(s.latest.items())) if s.latest else "no scalars yet")
            counts = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"  # noqa: E731
            out += ["", f"open anomalies: {counts(s.anomalies_by_kind)}", f"fixes: {counts(s.fixes_by_status)}", ""]
            if s.messages:
                shown = len(s.messages)
                total = s.messages_total
                out.append(f"messages (latest {shown} of {total}):" if total > shown else "messages:")
                out.append(table(["STEP", "RANK", "LEVEL", "TEXT"],
                                 [[m.step, m.rank, m.level, m.text] for m in s.messages]))
            else:
                out.append("no messages")
            return "\n".join(out)

        c.run(api_path("v1", "runs", run), show)

    @main.command()
    @run_argument
    @click.option("--kind", help="Only this anomaly kind, e.g. exploding_gradient.")
    @click.option("--severity", type=click.Choice(["info", "warning", "critical"]))
    @click.option("--status", type=click.Choice(["open", "resolved"]))
    @click.option("--min-step", type=int, help="Only anomalies still holding at or after this step.")
    @click.option("--max-step", type=int, help="Only anomalies that began at or before this step.")
    @click.option("--min-step-time", type=float, help="Only anomalies during which a step took this many seconds.")
    @click.option("--limit", type=int, default=50, show_default=True)
    @_options
    def anomalies(run: str, kind: str | None, severity: str | None, status: str | None, min_step: int | None,
                  max_step: int | None, min_step_time: float | None, limit: int, server: str, fmt: str | None) -> None:
        """A run's anomalies, open and critical first."""
        c = _Cmd(server, fmt)
        filters = dict(kind=kind, severity=severity, status=status, min_step=min_step, max_step=max_step,
                       min_step_time=min_step_time)

        def show() -> str:
            items = c.client.anomalies(run, limit=limit, **filters)
            if not items:
                return f"no anomalies in {run}" + (" matching the filters" if any(filters.values()) else "")
            return table(["ID", "KIND", "SEVERITY", "STATUS", "STEPS", "MESSAGE"],
                         [[a.id, a.kind, a.severity, a.status, f"{a.first_step}-{a.last_step}", a.message]
                          for a in items])

        c.run(api_path("v1", "runs", run, "anomalies"), show, limit=limit, **filters)

    @main.command()
    @run_argument
    @_options
    def diagnose(run: str, server: str, fmt: str | None) -> None:
        """The probable root causes of what went wrong in a run, as a report."""
        c = _Cmd(server, fmt)

        def show() -> str:
            d = c.client.diagnosis(run)
            if not d.causes:
                return d.report or d.summary
            causes = table(["ANOMALY", "KIND", "STEP", "TENSOR", "EXPLAINS", "EXPLANATION"],
                           [[x.anomaly_id, x.kind, x.step, x.tensor, ", ".join(x.consequences) or "-", x.explanation]
                            for x in d.causes])
            return f"{d.summary}\n\n{causes}\n\n{d.report}"

        c.run(api_path("v1", "runs", run, "diagnosis"), show)

    @main.command()
    @run_argument
    @click.option("--status", help="Only fixes in this state (proposed, pending, applied, effective, ...).")
    @click.option("--anomaly", "anomaly_id", help="Only fixes for this anomaly id.")
    @_options
    def fixes(run: str, status: str | None, anomaly_id: str | None, server: str, fmt: str | None) -> None:
        """A run's fixes: what was proposed, applied, and how it went."""
        c = _Cmd(server, fmt)

        def show() -> str:
            fs = c.client.fixes(run, status=status, anomaly_id=anomaly_id)
            if not fs:
                return f"no fixes in {run} yet; propose some with `traindx propose {run} ANOMALY_ID`"
            return table(["ID", "ANOMALY", "ACTION", "PARAMS", "STATUS", "BY", "REASON"],
                         [[f.id, f.anomaly_id, f.action, " ".join(f"{k}={_fmt(v)}" for k, v in f.params.items()),
                           f.status, f.requested_by, f.reason or f.rationale] for f in fs])

        c.run(api_path("v1", "runs", run, "fixes"), show, status=status, anomaly_id=anomaly_id, limit=500)

    @main.command()
    @run_argument
    @click.option("--table", "table_name", help="One table: item.weight, or item.")
    @click.option("--rows", type=click.IntRange(0, MAX_EMBEDDING_ROWS), default=10, show_default=True,
                  help="Worst rows listed per table.")
    @_options
    def embeddings(run: str, table_name: str | None, rows: int, server: str, fmt: str | None) -> None:
        """A run's embedding tables as last reported: rows never updated or non-finite, update counts,
        collapse statistics, the rows most like zombies (noisy, reversing updates), and those whose data has
        pulled them hardest over the run (conflicting labels)."""
        c = _Cmd(server, fmt)

        def show() -> str:
            got = c.client.embeddings(run, table=table_name, rows=rows)
            if not got.tables:
                return (f"no embedding tables reported in {run} (the embeddings collection is off, or the model "
                        "has no nn.Embedding / nn.EmbeddingBag)")
            out = [table(["TABLE", "RANK", "STEP", "ROWS", "DIM", "UPDATED", "NEVER", "NONFINITE", "MEDIAN UPD",
                          "SCORE SPREAD", "EFF RANK", "MEAN COS"],
                         [[t.name, t.rank, t.step, t.summary.rows, t.summary.dim, t.summary.touched_rows,
                           t.summary.never_updated, t.summary.nonfinite_rows, t.summary.median_touches,
                           t.summary.score_spread, t.summary.effective_rank, t.summary.mean_cosine]
                          for t in got.tables])]
            for t in got.tables:
                if t.summary.zombies:
                    out += ["", f"{t.name} (rank {t.rank}): rows most like zombies, worst first",
                            table(["ROW", "UPDATES", "NOISE", "CONSISTENCY", "SNR", "VELOCITY"],
                                  [[r.row, r.touches, r.noise, r.consistency, r.snr, r.velocity]
                                   for r in t.summary.zombies])]
                conflicted = [r for r in t.summary.conflicted if past_conflict_floor(r)]
                if conflicted:  # the listed rows past the floor: a healthy table's filler rows are left out
                    out += ["", f"{t.name} (rank {t.rank}): rows whose data has pulled them hardest over the run "
                            "(run score >= 2 spreads above their peers: conflicting labels, even once fitted), worst "
                            "first",
                            table(["ROW", "UPDATES", "RUN SCORE", "RUN NOISE", "NOISE NOW", "REPORTS"],
                                  [[r.row, r.touches, r.run_score, r.run_noise, r.noise, r.reports]
                                   for r in conflicted])]
                if t.summary.dead_ids:
                    shown = ", ".join(str(i) for i in t.summary.dead_ids)
                    more = t.summary.never_updated - len(t.summary.dead_ids)
                    last = unused_tail(t.summary.dead_ids, t.summary.rows, t.summary.never_updated) is not None
                    what = (f"never looked up (tied to {', '.join(t.summary.tied_to)}, they learn through it)"
                            if t.summary.tied_to else
                            "never looked up (the weight learns outside its lookups, they learn there)"
                            if t.summary.learns_outside_lookups else
                            "never updated (the table's last ids: it is sized past the data's)" if last else
                            "never updated")
                    out += ["", f"{t.name}: {what}: {shown}" + (f" (+{more} more)" if more > 0 else "")]
            return "\n".join(out)

        c.run(api_path("v1", "runs", run, "embeddings"), show, table=table_name, rows=rows)

    def _fix_table(fs: list) -> str:
        return table(["ID", "ACTION", "PARAMS", "STATUS", "RATIONALE"],
                     [[f.id, f.action, " ".join(f"{k}={_fmt(v)}" for k, v in f.params.items()), f.status,
                       f.reason or f.rationale] for f in fs])

    @main.command()
    @run_argument
    @click.argument("anomaly_id")
    @_options
    def propose(run: str, anomaly_id: str, server: str, fmt: str | None) -> None:
        """Propose fixes for one anomaly, best first."""
        c = _Cmd(server, fmt)
        c.run(api_path("v1", "runs", run, "anomalies", anomaly_id, "propose"),
              lambda: _fix_table(c.client.propose(run, anomaly_id)), method="POST")

    for op in ("apply", "revert"):
        def make(op: str) -> None:
            @main.command(op, help=f"{op.capitalize()} a fix in the live job (recorded as person:<you>: "
                                   "$TRAINDX_ACTOR, else the OS user).")
            @run_argument
            @click.argument("fix_id")
            @_options
            def command(run: str, fix_id: str, server: str, fmt: str | None) -> None:
                c = _Cmd(server, fmt)
                call = c.client.apply if op == "apply" else c.client.revert
                c.run(api_path("v1", "runs", run, "fixes", fix_id, op), lambda: _fix_table([call(run, fix_id)]),
                      method="POST")

        make(op)
