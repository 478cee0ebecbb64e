"""The package arrows of docs/architecture.md hold: a training job loads nothing of the server, and
import-linter's contracts (pyproject.toml) pass."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SERVER_SIDE = {"fastapi", "starlette", "mcp", "uvicorn", "lxml", "click", "sqlite3", "_sqlite3", "diag_server",
               "agent_examples"}


def test_a_training_job_loads_nothing_of_the_server(tmp_path) -> None:
    """import, attach, train, close and even report() without a server: none of the server's modules
    (nor its libraries) enter the job's process."""
    code = f"""
import sys
import torch, probes
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), 1e-3)
probe = probes.attach(model, opt, run="layout", server=False, interval=5)
for _ in range(20):
    opt.zero_grad(); loss = model(torch.randn(8, 4)).pow(2).mean(); loss.backward(); opt.step()
    probe.step(loss=loss)
text = probe.report(file=open("/dev/null", "w"))
probe.close()
print(sorted({{m.split(".")[0] for m in sys.modules}} & set({sorted(SERVER_SIDE)!r})))
print(text.splitlines()[0])
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    loaded, first = out.stdout.strip().splitlines()[-2:]
    assert loaded == "[]", f"the job loaded {loaded}"
    assert first == "Diagnosis of run layout", "report() still diagnosed the run, in a child process"


def test_the_package_arrows_hold() -> None:
    """probes never import diag_server or agent_examples; diag_server never imports them either; its
    layers import only downwards; only its api imports the web and MCP frameworks."""
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    if lint is None:
        pytest.skip("import-linter is not installed (the test extra installs it)")
    out = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]


def test_the_code_is_lint_clean() -> None:
    """ruff, with the rules pyproject.toml selects, finds nothing."""
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable))
    if ruff is None:
        pytest.skip("ruff is not installed (the test extra installs it)")
    out = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]
