"""Helpers shared by the integration tests: a scripted agent that drives the real server over HTTP."""

from __future__ import annotations

import time
from typing import Iterator

import httpx

from tests.conftest import AUTH
import pytest



@pytest.fixture
def one_thread() -> Iterator[None]:
    # The machine's cores are shared by several test runs: more torch threads than free cores makes a
    # tiny model 20x slower, so the integration tests train on one.
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Agent:
    """Does what an agent would over the HTTP API: wait for an anomaly, propose a fix, apply the best one."""

    def __init__(self, url: str, run: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=10, headers={"x-traindx-actor": "test-agent",
                                                                                  **AUTH})
        self.run = run
        self.anomaly: dict | None = None
        self.fix: dict | None = None

    def anomalies(self, **params: str) -> list[dict]:
        r = self.client.get(f"/v1/runs/{self.run}/anomalies", params=params)
        return r.json()["anomalies"] if r.status_code == 200 else []

    def try_fix(self, kinds: set[str]) -> bool:
        """One look at the run; when an anomaly of ``kinds`` is open, propose and apply its best live fix."""
        if self.fix is not None:
            return True
        found = [a for a in self.anomalies(status="open") if a["kind"] in kinds]
        if not found:
            return False
        self.anomaly = found[0]
        proposed = self.client.post(f"/v1/runs/{self.run}/anomalies/{self.anomaly['id']}/propose").json()["fixes"]
        live = [f for f in proposed if f["live"]]
        fix = live[0]
        r = self.client.post(f"/v1/runs/{self.run}/fixes/{fix['id']}/apply")
        assert r.status_code == 200, r.text
        self.fix = r.json()
        return True

    def fix_status(self) -> dict:
        assert self.fix is not None
        return self.client.get(f"/v1/runs/{self.run}/fixes/{self.fix['id']}").json()

    def wait_fix(self, statuses: set[str], timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            fix = self.fix_status()
            if fix["status"] in statuses or time.monotonic() > deadline:
                return fix
            time.sleep(0.1)

    def scalar(self, name: str) -> list[tuple[int, float | None]]:
        r = self.client.get(f"/v1/runs/{self.run}/series/{name}", params={"max_points": 10000})
        return [(p["step"], p["value"]) for p in r.json()["points"]] if r.status_code == 200 else []
