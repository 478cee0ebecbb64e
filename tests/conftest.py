"""Shared fixtures: a real `traindx serve` process (diag_server.testing) on a free port with its own data directory.

Every route but /health needs the server's token (docs/security.md). The test session sets one
TRAINDX_TOKEN in its environment, which the servers it starts, the probes (HttpSink) and MCP clients
read; raw HTTP calls pass ``headers=server.headers`` (or use ``server.client()``).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from diag_server.testing import ServerProcess, free_port, make_server  # noqa: F401 - tests import them here

ROOT = Path(__file__).resolve().parent.parent
TOKEN = os.environ.setdefault("TRAINDX_TOKEN", "test-" + secrets.token_urlsafe(24))
AUTH = {"authorization": f"Bearer {TOKEN}"}  # for raw HTTP calls to the servers the tests start


def sharded_job(body: str, timeout: float = 120) -> dict:
    """Run ``body`` in a process of its own on a one-rank gloo group, where ``fully_shard`` (FSDP2) makes
    real DTensor parameters (the group would leak into later tests in this one). ``body`` sees torch,
    fully_shard, probes and tempfile, and leaves what the test reads in the dict ``out``."""
    import json
    import textwrap

    code = "\n".join([
        "import json, socket, tempfile, torch, torch.distributed as dist",
        "from torch.distributed.fsdp import fully_shard",
        "import probes",
        "with socket.socket() as s:",
        "    s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]",
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)",
        "out = {}",
        textwrap.dedent(body),
        "dist.destroy_process_group()",
        "print(json.dumps(out))",
    ])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = make_server(tmp_path)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture(scope="session")
def session_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real server shared by tests that each use their own run id (starting one costs seconds)."""
    srv = make_server(tmp_path_factory.mktemp("session-server"))
    srv.start()
    yield srv
    srv.stop()


# -- one server for the people-facing tests (HTTP API, CLI, client, dashboard, fuzz) ------------------
PEOPLE_TOKEN = "people-token-for-tests"
PEOPLE_RUN = "api-run"


@pytest.fixture(scope="session")
def people_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with a bearer token, holding PEOPLE_RUN: a real training run (sampled every step, so what
    the rules see is deterministic) whose learning rate was raised 25x (exploding gradients) and whose
    loss then went NaN, and which has ended, with fixes proposed by person:ana for its exploding_gradient
    anomaly. Tests that need a live job start their own LiveRun on it under another run id. (It has a
    token, unlike session_server, so that the tests also prove that the CLI, client and page send it.)"""
    from scripts.live_run import LiveRun

    # Reads open (--open-reads), writes need the token: the tests prove the CLI, client and page send it.
    srv = make_server(tmp_path_factory.mktemp("people"), "--token", PEOPLE_TOKEN, "--open-reads")
    srv.start()
    job = LiveRun(srv.url, PEOPLE_RUN, interval=1, step_sleep=0.001, token=PEOPLE_TOKEN).start()
    job.wait_steps(120)
    job.inject("lr_spike", factor=25.0)
    job.wait_steps(20)
    job.inject("nan", steps=5)
    job.wait_steps(20)
    job.stop()
    first = httpx.get(f"{srv.url}/v1/runs/{PEOPLE_RUN}/anomalies?kind=exploding_gradient").json()["anomalies"][0]["id"]
    httpx.post(f"{srv.url}/v1/runs/{PEOPLE_RUN}/anomalies/{first}/propose",
               headers={"x-traindx-actor": "ana", "authorization": f"Bearer {PEOPLE_TOKEN}"}).raise_for_status()
    yield srv
    srv.stop()


@pytest.fixture(params=["native", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on the probe's native kernel (probes/_fastats.c) and on the torch passes it falls back
    to where no C compiler built it."""
    import probes.stats

    if request.param == "native" and probes.stats._fastats is None:
        pytest.skip("the native kernel is not built (no C compiler at install)")
    if request.param == "torch":
        monkeypatch.setattr(probes.stats, "_fastats", None)
    return request.param


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread: a job's thread, the probe's sender and an in-process server already
    share a small machine's cores, and torch's own threads on top make such runs several times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
