"""The one harness that starts a real `traindx serve` process: for tests, benchmarks, scripts and examples.

    srv = serve(tmp_path / "data")          # a server on a free loopback port, started
    httpx.get(f"{srv.url}/v1/runs", headers=srv.headers)
    srv.stop()

The server reads TRAINDX_TOKEN from the environment when it is set (the probes and MCP clients started
from the same process read it too); otherwise it writes its own token in the data directory, which
``ServerProcess.token`` reads back.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# The checkout (or site-packages) holding diag_server: a child server imports the same code as its parent.
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A loopback port nobody listens on now (the usual race: bind it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A `traindx serve` child process on ``port`` over ``data_dir``."""

    url: str
    port: int
    data_dir: Path
    proc: subprocess.Popen | None = None
    extra_args: tuple[str, ...] = ()
    env: dict | None = None  # a value of None removes the variable (e.g. TRAINDX_TOKEN: None)
    log_path: Path | None = None  # where the server's stderr goes (default: data_dir/../server.log)

    @property
    def token(self) -> str:
        """The token this server requires: the one it was given, else the one it wrote in its data dir."""
        env = {**os.environ, **(self.env or {})}
        return env.get("TRAINDX_TOKEN") or (self.data_dir / "token").read_text().strip()

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, **kwargs)

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        """Start it and wait until /health answers (generous: a loaded CI machine is slow to import)."""
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(self.env or {})}
        env = {k: v for k, v in env.items() if v is not None}
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_path or self.data_dir.parent / f"server-{self.port}.log"
        # A file, not a pipe nobody reads: a chatty server would block on a full pipe.
        log = open(log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "diag_server.cli", "serve", "--port", str(self.port),
                 "--data", str(self.data_dir), *self.extra_args],
                env=env, stdout=subprocess.DEVNULL, stderr=log)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {log_path.read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop("kill")
        raise RuntimeError(f"the server did not start within {timeout:g} s")

    def stop(self, sig: str = "term") -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if sig == "kill" else self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> "ServerProcess":
        return self if self.proc else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_server(tmp_path: Path, *args: str, env: dict | None = None) -> ServerProcess:
    """A server (not started) over ``tmp_path/data`` on a free port; ``args`` go to `traindx serve`."""
    port = free_port()
    return ServerProcess(url=f"http://127.0.0.1:{port}", port=port, data_dir=Path(tmp_path) / "data",
                         extra_args=args, env=env)


def serve(data_dir: str | os.PathLike, *args: str, port: int | None = None, env: dict | None = None,
          timeout: float = 120.0) -> ServerProcess:
    """A started server over ``data_dir``. Its token goes in this process's TRAINDX_TOKEN (made up when
    unset), which the probes, clients and child processes started from here all read."""
    os.environ.setdefault("TRAINDX_TOKEN", secrets.token_urlsafe(32))
    port = port or free_port()
    return ServerProcess(url=f"http://127.0.0.1:{port}", port=port, data_dir=Path(data_dir), extra_args=args,
                         env=env, log_path=Path(data_dir) / "server.log").start(timeout)
