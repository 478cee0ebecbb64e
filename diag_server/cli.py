"""The ``traindx`` command: serve, open, mcp, import, demo, schemas, and reading commands for people."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

try:
    import click
except ImportError:  # the probe's install (`pip install traindx`) has no server
    sys.exit("traindx: this command is the server's; install it with: pip install 'traindx[server]'")


def _data_option(f):  # noqa: ANN001
    return click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path),
                        default=lambda: os.environ.get("TRAINDX_DATA", ".traindx"), show_default=".traindx",
                        help="Data directory (SQLite store). Env: TRAINDX_DATA.")(f)


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        from .store import SchemaError

        try:
            return super().invoke(ctx)
        except SchemaError as e:  # a store written by a newer traindx: say so, no traceback
            raise click.ClickException(str(e)) from None


@click.group(cls=_Group)
@click.version_option(package_name="traindx")
def main() -> None:
    """traindx: look inside a running PyTorch training job, find what is wrong, fix it live."""


def _token(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and (len(value) < 16 or not value.isprintable() or " " in value):
        raise click.BadParameter("a token needs at least 16 printable characters and no spaces "
                                 "(leave it out and the server generates one in DATA/token)")
    return value


def _hosts(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    from .api.security import parse_allowed_host

    for entry in value:
        if entry.strip() != "*":
            try:
                parse_allowed_host(entry)
            except ValueError as e:
                raise click.BadParameter(str(e)) from None
    return value


def _origins(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    from .api.security import parse_origin

    try:
        return tuple(parse_origin(v) for v in value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, envvar="TRAINDX_HOST",
              help="Interface to bind. Anything but loopback also needs --allow-remote. Env: TRAINDX_HOST.")
@click.option("--port", type=click.IntRange(1, 65535), default=8765, show_default=True, envvar="TRAINDX_PORT",
              help="Port. Env: TRAINDX_PORT.")
@click.option("--allow-remote", is_flag=True, envvar="TRAINDX_ALLOW_REMOTE",
              help="Allow binding to a non-loopback interface (the token is then the only thing between the "
                   "network and your training jobs). Env: TRAINDX_ALLOW_REMOTE=1.")
@click.option("--token", default=None, envvar="TRAINDX_TOKEN", callback=_token,
              help="The bearer token every route but /health needs. Default: DATA/token, generated (0600) on "
                   "first start. Env: TRAINDX_TOKEN.")
@click.option("--open-reads", is_flag=True, envvar="TRAINDX_OPEN_READS",
              help="Serve GET routes without the token (writes, ingest and /mcp still need it). "
                   "Env: TRAINDX_OPEN_READS=1.")
@click.option("--allow-host", "allow_hosts", multiple=True, envvar="TRAINDX_ALLOW_HOSTS", callback=_hosts,
              metavar="NAME[:PORT]",
              help="Another Host clients may use (DNS-rebinding check): NAME at this port or without one (behind "
                   "a proxy), NAME:PORT exactly (a forwarded port); repeatable; '*' switches the Host and Origin "
                   "checks off. Env: TRAINDX_ALLOW_HOSTS (space-separated).")
@click.option("--allow-origin", "allow_origins", multiple=True, envvar="TRAINDX_ALLOW_ORIGINS", callback=_origins,
              metavar="SCHEME://HOST[:PORT]",
              help="Another browser origin that may use the server besides its own pages (e.g. https://NAME "
                   "behind a TLS proxy); repeatable. Env: TRAINDX_ALLOW_ORIGINS (space-separated).")
@click.option("--max-age-days", type=click.FloatRange(min=0.001, max=1e6), default=None,
              envvar="TRAINDX_MAX_AGE_DAYS", help="Delete runs last heard from more than this many days ago "
              "(checked at start, then at least hourly). Env: TRAINDX_MAX_AGE_DAYS.")
@click.option("--max-data-mb", type=click.FloatRange(min=1, max=1e9), default=None, envvar="TRAINDX_MAX_DATA_MB",
              help="Size cap of the data directory: a warning from 80%, ingest refused (507; probes spool) at "
                   "the cap. Env: TRAINDX_MAX_DATA_MB.")
@click.option("--max-pending-ingest", type=click.IntRange(1, 10000), default=16, show_default=True,
              envvar="TRAINDX_MAX_PENDING_INGEST",
              help="Ingest requests waiting to be stored at once; beyond it the server answers 503 with Retry-After "
                   "and probes keep their batches in their spools. Env: TRAINDX_MAX_PENDING_INGEST.")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@click.option("--rule", "rules", multiple=True, metavar="MODULE:CLASS",
              help="Add a rule of your own (a Rule subclass). Repeatable. Env: TRAINDX_RULES (comma-separated).")
@click.option("--rule-param", "rule_params", multiple=True, metavar="RULE.PARAM=VALUE",
              help="Tune a rule, e.g. dead_relu.threshold=0.8. Repeatable. Env: TRAINDX_RULE_PARAMS.")
@click.option("--disable-rule", "disabled", multiple=True, metavar="RULE",
              help="Switch a rule off. Repeatable. Env: TRAINDX_DISABLE_RULES.")
@_data_option
def serve(host: str, port: int, allow_remote: bool, token: str | None, open_reads: bool, allow_hosts: tuple[str, ...],
          allow_origins: tuple[str, ...], max_age_days: float | None, max_data_mb: float | None,
          max_pending_ingest: int, log_level: str, rules: tuple[str, ...], rule_params: tuple[str, ...], disabled: tuple[str, ...], data_dir: Path) -> None:
    """Serve ingest, the REST API (/v1), MCP over Streamable HTTP (/mcp) and health (/health)."""
    import uvicorn

    from .api import create_app
    from .rule_config import engine_settings
    from .api.security import is_loopback
    from .pipeline.services import Settings

    if not is_loopback(host) and not allow_remote:
        raise click.UsageError(f"--host {host} would expose the server beyond this machine; pass --allow-remote "
                               "to mean it (every route but /health then needs the token)")
    try:
        engine = engine_settings(list(rules), list(rule_params), list(disabled))
    except (ValueError, ImportError) as e:
        raise click.BadParameter(str(e), param_hint="rules") from None
    settings = Settings(host=host, port=port, data_dir=data_dir, token=token, open_reads=open_reads,
                        allowed_hosts=allow_hosts, allowed_origins=allow_origins, max_pending_ingest=max_pending_ingest, engine=engine,
                        max_data_bytes=int(max_data_mb * 1e6) if max_data_mb is not None else None,
                        max_age_s=max_age_days * 86400 if max_age_days is not None else None)
    app = create_app(settings)
    services = app.state.services
    where = "(given)" if token else str(data_dir / "token")
    click.echo(f"traindx serving on http://{host}:{port} (MCP at /mcp), data in {data_dir}; store check: "
               f"{services.store_status}; token {where}", err=True)
    if is_loopback(host):
        click.echo(f"dashboard: {dashboard_link(f'http://127.0.0.1:{port}', settings.token)} "
                   "(again later: traindx open)", err=True)
    _settle_heap()
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def dashboard_link(server: str, token: str) -> str:
    from urllib.parse import quote

    return f"{server.rstrip('/')}/?token={quote(token, safe='')}"


@main.command("open")
@click.option("--server", default=lambda: os.environ.get("TRAINDX_SERVER", "http://127.0.0.1:8765"),
              show_default="$TRAINDX_SERVER or http://127.0.0.1:8765", help="The server's address.")
@click.option("--print-only", is_flag=True, help="Print the link without opening a browser.")
@_data_option
def open_(server: str, print_only: bool, data_dir: Path) -> None:
    """Open the dashboard in a browser with its token (the link `traindx serve` printed), and print the link.

    The token comes from TRAINDX_TOKEN, else from the server's data directory (DATA/token)."""
    import webbrowser

    import httpx

    from .api.security import read_token_file

    token = os.environ.get("TRAINDX_TOKEN") or read_token_file(data_dir)
    if not token:
        raise click.ClickException(f"no token in {data_dir / 'token'} nor in TRAINDX_TOKEN: start the server with "
                                   "`traindx serve` (it writes one on first start), or pass --data DATA, the "
                                   "server's data directory")
    try:
        httpx.get(f"{server.rstrip('/')}/health", timeout=3).raise_for_status()
    except httpx.HTTPError as e:
        click.echo(f"warning: {server} does not answer ({type(e).__name__}); is `traindx serve` running?", err=True)
    link = dashboard_link(server, token)
    click.echo(link)
    if not print_only:
        webbrowser.open(link)


def _settle_heap() -> None:
    """What the server process holds by now (modules, the app, its routes and schemas) lives as long as it:
    frozen out of the garbage collector's reach, so that the full collections that parsing large batches
    triggers do not walk it each time; and the young generation collected less often, since one batch
    allocates thousands of models at once. An embeddings report of four tables (2,048 listed rows, 288 KB)
    cost the server 12.7 ms of CPU, 7.0 ms with this (measured, docs/embeddings.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


@main.command()
@_data_option
def mcp(data_dir: Path) -> None:
    """Serve the MCP tools over stdio, reading the same data directory as `traindx serve`."""
    from . import __version__
    from .pipeline.services import Services, Settings
    from .api.mcp import build_mcp

    services = Services(Settings(data_dir=data_dir))
    try:
        build_mcp(services, __version__).run("stdio")
    finally:
        services.close()


@main.command("import")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_data_option
def import_(files: tuple[Path, ...], data_dir: Path) -> None:
    """Load event files (written with server=False, or a probe's spool) into the store. Idempotent."""
    from .pipeline.importer import import_file
    from .rule_config import engine_settings
    from .pipeline.services import Services, Settings

    try:
        engine = engine_settings()  # TRAINDX_RULES / TRAINDX_RULE_PARAMS / TRAINDX_DISABLE_RULES, as for serve
    except (ValueError, ImportError) as e:
        raise click.BadParameter(str(e), param_hint="TRAINDX_RULES") from None
    services = Services(Settings(data_dir=data_dir, engine=engine))
    try:
        for f in files:
            n, dup, bad = import_file(services, f)
            click.echo(f"{f}: {n} batch(es) stored, {dup} already present, {bad} refused")
    finally:
        services.close()


@main.command()
@click.argument("run")
@click.option("--jsonl", "jsonl", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
              help="Write the run as JSON lines (importable with `traindx import`); '-' for stdout.")
@click.option("--tensorboard", "tensorboard_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write TensorBoard event files under DIR/RUN (an earlier export there is replaced).")
@_data_option
def export(run: str, jsonl: Path | None, tensorboard_dir: Path | None, data_dir: Path) -> None:
    """Export a run: --jsonl (events `traindx import` loads back, then anomalies, fixes and audit) and/or
    --tensorboard (scalars, tensor statistics, histograms, anomalies and fixes)."""
    if jsonl is None and tensorboard_dir is None:
        raise click.UsageError("say where to: --jsonl FILE and/or --tensorboard DIR")
    if jsonl is not None:
        _export_jsonl(run, jsonl, data_dir)
    if tensorboard_dir is not None:
        _export_tensorboard(run, tensorboard_dir, data_dir)


def _export_jsonl(run: str, jsonl: Path, data_dir: Path) -> None:
    from .errors import ApiError
    from .pipeline.retention import export_run
    from .store import Store

    store = Store(data_dir)
    try:
        if str(jsonl) == "-":
            counts = export_run(store, run, sys.stdout.buffer)
        else:
            tmp = jsonl.with_name(jsonl.name + ".partial")
            with open(tmp, "wb") as fh:
                counts = export_run(store, run, fh)
            tmp.replace(jsonl)  # a crash mid-export leaves no file that looks complete
    except ApiError as e:
        raise click.ClickException(str(e)) from None
    finally:
        store.close()
    click.echo(f"{run}: {counts['events']} events in {counts['batches']} batches, {counts['records']} records "
               f"-> {jsonl}", err=True)


def _export_tensorboard(run: str, tensorboard_dir: Path, data_dir: Path) -> None:
    from .errors import ApiError
    from .read.tensorboard import export_run, open_store_readonly

    try:
        conn = open_store_readonly(data_dir)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    try:
        counts = export_run(conn, run, tensorboard_dir)
    except ApiError as e:
        raise click.ClickException(e.message) from None
    except ImportError as e:
        raise click.ClickException(f"{e}; the TensorBoard export needs: pip install 'traindx[tensorboard]'") from None
    finally:
        conn.close()
    click.echo(f"{tensorboard_dir / run}: {counts['scalars']} scalar points, {counts['tensor_scalars']} tensor "
               f"statistics, {counts['histograms']} histograms, {counts['texts']} anomaly/fix notes; "
               f"open with: tensorboard --logdir {tensorboard_dir}")


@main.command()
@click.argument("run")
@click.option("--force", is_flag=True, help="Delete even if the run is still streaming.")
@click.option("--server", default=None, envvar="TRAINDX_SERVER",
              help="Ask this running server to delete it (needs its token: TRAINDX_TOKEN or DATA/token); "
                   "default: delete from the data directory directly.")
@click.confirmation_option(prompt="Delete the run and everything stored about it?")
@_data_option
def delete(run: str, force: bool, server: str | None, data_dir: Path) -> None:
    """Delete a run (export it first with `traindx export RUN --jsonl FILE`)."""
    from .errors import ApiError

    if server:
        import httpx

        from .api.security import read_token_file

        token = os.environ.get("TRAINDX_TOKEN") or read_token_file(data_dir) or ""
        r = httpx.delete(f"{server.rstrip('/')}/v1/runs/{run}", params={"force": str(force).lower()},
                         headers={"authorization": f"Bearer {token}"}, timeout=60)
        if r.status_code != 204:
            raise click.ClickException(f"{server} answered {r.status_code}: {r.text[:500]}")
        click.echo(f"{run} deleted", err=True)
        return
    from .pipeline.retention import delete_run
    from .store import Store

    store = Store(data_dir)
    try:
        counts = delete_run(store, run, force=force)
    except ApiError as e:
        raise click.ClickException(str(e)) from None
    finally:
        store.close()
    click.echo(f"{run} deleted: " + ", ".join(f"{n} {t}" for t, n in counts.items() if n), err=True)


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--run", required=True, help="The run to diagnose (a file may hold several).")
def report(files: tuple[Path, ...], run: str) -> None:
    """Diagnose a run from its event files or spools, without a server (what probe.report() prints
    when the job has none): the same rules, over a throwaway store."""
    from .local import diagnose_files

    click.echo(diagnose_files(files, run))


@main.command()
@click.option("--steps", type=int, default=1500, show_default=True, help="Training steps.")
@click.option("--keep/--no-keep", default=None, help="Keep the server (and the dashboard) up at the end until "
              "Ctrl-C. Default: when the output is a terminal.")
def demo(steps: int, keep: bool | None) -> None:
    """A server, a training run that goes wrong, and an agent that finds and fixes it over MCP."""
    import subprocess

    # The demo is an example (agent_examples/demo.py), a consumer of the server: it runs in its own process.
    cmd = [sys.executable, "-m", "agent_examples.demo", "--steps", str(steps)]
    if keep is not None:
        cmd.append("--keep" if keep else "--no-keep")
    try:
        sys.exit(subprocess.run(cmd).returncode)
    except KeyboardInterrupt:  # the child got it too, and stops its server
        sys.exit(130)


@main.command("rules")
@click.option("--rule", "rules", multiple=True, metavar="MODULE:CLASS", help="Include a rule of your own.")
@click.option("--rule-param", "rule_params", multiple=True, metavar="RULE.PARAM=VALUE", help="Show tuned values.")
@click.option("--disable-rule", "disabled", multiple=True, metavar="RULE")
def rules_(rules: tuple[str, ...], rule_params: tuple[str, ...], disabled: tuple[str, ...]) -> None:
    """List the rule catalog: each rule, the anomaly kinds it raises, its parameters and their sources."""
    from .pipeline.engine import Engine
    from .rule_config import engine_settings

    try:
        engine = Engine(engine_settings(list(rules), list(rule_params), list(disabled)))
    except (ValueError, ImportError) as e:
        raise click.BadParameter(str(e), param_hint="rules") from None
    for r in engine.describe():
        click.echo(f"{r['name']}  ({', '.join(r['kinds'])})\n  {r['description']}")
        for k, p in r["params"].items():
            tuned = "" if p["value"] == p["default"] else f" (default {p['default']:g})"
            click.echo(f"    {k} = {p['value']:g}{tuned}: {p['help']} [{p['source']}]")


@main.command()
@click.argument("session", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--against", required=True, help="An MCP endpoint URL (http://HOST:PORT/mcp), or 'stdio' to launch "
              "`traindx mcp --data DATA`.")
@click.option("--run-job", is_flag=True, help="Also start the session's seeded training job against the server "
              "(URL targets only: the job posts to the same host).")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds to wait for each response "
              "to match the recording.")
@_data_option
def replay(session: Path, against: str, run_job: bool, timeout: float, data_dir: Path) -> None:
    """Re-run a recorded MCP session and report every response that differs in shape or meaning."""
    import subprocess

    # The examples are a consumer of the server, never part of it: they run in their own process.
    cmd = [sys.executable, "-m", "agent_examples.replay", str(session), "--against", against,
           "--timeout", repr(timeout), "--data", str(data_dir)] + (["--run-job"] if run_job else [])
    sys.exit(subprocess.run(cmd).returncode)


@main.command()
@click.option("--checkpoint", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A state_dict (or {'state_dict': ...}) saved with torch.save; a whole nn.Module with --trust-checkpoint.")
@click.option("--recipe", "recipe_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A CompressionRecipe as JSON (GET /v1/runs/RUN/compression, or the compression_recipe tool).")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Where to write the small file.")
@click.option("--trust-checkpoint", is_flag=True, help="Unpickle a whole nn.Module (only for files you trust); "
              "enables the latency measurement.")
def compress(checkpoint: Path, recipe_path: Path, out: Path, trust_checkpoint: bool) -> None:
    """Apply a recipe to a checkpoint: bitmask + kept values (int8 where chosen); print sizes and latency."""
    import json

    from .compression.offline import CompressError, compress as run_compress

    try:
        report = run_compress(checkpoint, recipe_path, out, trust=trust_checkpoint)
    except CompressError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(report, indent=2))
    click.echo(f"{out}: {report['compressed_bytes']} bytes, {report['ratio']:.3f}x of the dense state_dict "
               f"({report['dense_state_dict_bytes']} bytes)", err=True)


@main.command()
@click.option("--check", is_flag=True, help="Exit 1 if the checked-in schema files differ from the models.")
def schemas(check: bool) -> None:
    """Write (or --check) schemas/traindx.schema.json and schemas/traindx.xsd from the models."""
    from schemas import export

    sys.exit(export.main(["--check"] if check else []))


from .cli_distributed import capture_command, timeline_command  # noqa: E402

main.add_command(timeline_command)
main.add_command(capture_command)

from .cli_people import register as _register_people  # noqa: E402 - runs, anomalies, diagnose, fixes, ...

_register_people(main)

if __name__ == "__main__":
    main()
