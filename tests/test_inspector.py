"""The MCP Inspector (a client this project did not write) accepts the server over HTTP and stdio.

Runs agent_examples/inspector.py, which installs the pinned Inspector from the npm registry on first use.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                 reason="Node.js and npm are needed to run the MCP Inspector")]


@pytest.mark.timeout(1200)
def test_the_inspector_accepts_every_tool_resource_and_prompt():
    out = subprocess.run([sys.executable, "-m", "agent_examples.inspector"], cwd=ROOT, capture_output=True,
                         text=True, timeout=1100)
    failures = [line for line in out.stdout.splitlines() if line.startswith("FAIL")]
    assert out.returncode == 0, "\n".join(failures) or (out.stdout + out.stderr)[-3000:]
    assert "checks passed" in out.stdout and not failures
