"""The ``traindx`` command: serve, mcp, import, demo, schemas, and reading commands for people."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click


def _data_option(f):  # noqa: ANN001
    return click.option("--data", "data_dir", type=click.Path(file_okay=False, path_type=Path),
                        default=lambda: os.environ.get("TRAINDX_DATA", ".traindx"), show_default=".traindx",
                        help="Data directory (SQLite store). Env: TRAINDX_DATA.")(f)


@click.group()
@click.version_option(package_name="traindx")
def main() -> None:
    """traindx: look inside a running PyTorch training job, find what is wrong, fix it live."""


@main.command()
@click.option("--host", default=lambda: os.environ.get("TRAINDX_HOST", "127.0.0.1"), show_default="127.0.0.1",
              help="Interface to bind. Env: TRAINDX_HOST.")
@click.option("--port", type=int, default=lambda: int(os.environ.get("TRAINDX_PORT", "8765")), show_default="8765",
              help="Port. Env: TRAINDX_PORT.")
@click.option("--token", default=lambda: os.environ.get("TRAINDX_TOKEN"),
              help="Require 'Authorization: Bearer TOKEN' on ingest and write routes. Env: TRAINDX_TOKEN.")
@click.option("--log-level", default="warning", show_default=True)
@_data_option
def serve(host: str, port: int, token: str | None, log_level: str, data_dir: Path) -> None:
    """Serve ingest, the REST API (/v1), MCP over Streamable HTTP (/mcp) and health (/health)."""
    import uvicorn

    from .app import create_app
    from .services import Settings

    app = create_app(Settings(host=host, port=port, data_dir=data_dir, token=token))
    click.echo(f"traindx serving on http://{host}:{port} (MCP at /mcp), data in {data_dir}", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


@main.command()
@_data_option
def mcp(data_dir: Path) -> None:
    """Serve the MCP tools over stdio, reading the same data directory as `traindx serve`."""
    from . import __version__
    from .services import Services, Settings
    from .tools import build_mcp

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
    from .importer import import_file
    from .services import Services, Settings

    services = Services(Settings(data_dir=data_dir))
    try:
        for f in files:
            n, dup, bad = import_file(services, f)
            click.echo(f"{f}: {n} batch(es) stored, {dup} already present, {bad} refused")
    finally:
        services.close()


@main.command()
@click.option("--steps", type=int, default=1500, show_default=True, help="Training steps.")
@click.option("--keep", is_flag=True, help="Keep the server running at the end so the data can be browsed.")
def demo(steps: int, keep: bool) -> None:
    """A server, a training run that goes wrong, and an agent that finds and fixes it over MCP."""
    from .demo import run_demo

    sys.exit(run_demo(steps=steps, keep=keep))


@main.command()
@click.option("--check", is_flag=True, help="Exit 1 if the checked-in schema files differ from the models.")
def schemas(check: bool) -> None:
    """Write (or --check) schemas/traindx.schema.json and schemas/traindx.xsd from the models."""
    from schemas import export

    sys.exit(export.main(["--check"] if check else []))


from .cli_people import register as _register_people  # noqa: E402 - runs, anomalies, diagnose, fixes, ...

_register_people(main)

if __name__ == "__main__":
    main()
