"""`traindx demo`: a server, a training run that goes wrong, and an agent that finds and fixes it.

Everything is real: a `traindx serve` process on a free port with a temporary data directory, a
PyTorch training loop with the probe attached, and the scripted agent talking to the server over the
official MCP client (Streamable HTTP).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

RUN = "demo-lr-spike"
FAULT_STEP = 500
RECOVERED_WITHIN = 1.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(data_dir: str, port: int) -> subprocess.Popen:
    """`traindx serve` on loopback. Its token goes in this process's TRAINDX_TOKEN (made up when unset),
    which the server, the probes and the MCP clients started from here all read (docs/security.md)."""
    os.environ.setdefault("TRAINDX_TOKEN", secrets.token_urlsafe(32))
    # Its log goes to a file in the data directory, not a pipe: a pipe nobody reads fills up (64 KiB) and the
    # server blocks on its next log line, as it did after ~20 runs of benchmarks/repair.py.
    os.makedirs(data_dir, exist_ok=True)
    log = os.path.join(data_dir, "server.log")
    with open(log, "ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", "diag_server.cli", "serve", "--port", str(port), "--data",
                                 data_dir], stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log, "rb") as f:
                raise RuntimeError("the server exited: " + f.read().decode(errors="replace")[-2000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not start within 30 s")


def run_demo(steps: int = 1500, keep: bool = False) -> int:
    from agent_examples.jobs import lr_spike_job
    from agent_examples.scripted_agent import connect, triage

    data_dir = tempfile.mkdtemp(prefix="traindx-demo-")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"[demo] starting traindx serve on {url} (data in {data_dir})")
    server = start_server(data_dir, port)
    os.environ["TRAINDX_SERVER"] = url
    os.environ["TRAINDX_SPOOL"] = os.path.join(data_dir, "spool")
    try:
        print(f"[demo] training an MLP for {steps} steps; at step {FAULT_STEP} a scheduler bug sets the "
              "learning rate 10x too high")
        box: dict = {}
        job = threading.Thread(target=lambda: box.update(result=lr_spike_job(run=RUN, steps=steps,
                                                                             fault_step=FAULT_STEP)))
        t0 = time.monotonic()
        job.start()

        async def agent() -> object:
            async with connect(f"{url}/mcp", name="traindx-demo-agent") as client:
                return await triage(client, RUN, timeout=120, say=lambda m: print(f"[agent] {m}"))

        outcome = asyncio.run(agent())
        job.join()
        result = box["result"]
        if result.error is not None:
            raise result.error
        print(f"[demo] training finished in {time.monotonic() - t0:.1f}s; computing the same run without the fix, "
              "and without the fault")
        unfixed = lr_spike_job(run="counterfactual", steps=steps, fault_step=FAULT_STEP, pace=0, attach=False)
        healthy = lr_spike_job(run="healthy", steps=steps, fault_step=None, pace=0, attach=False)
        before = result.median(FAULT_STEP - 50, FAULT_STEP)
        worst = max(result.median(i, i + 20) for i in range(FAULT_STEP, min(steps - 20, FAULT_STEP + 300), 10))
        end, unfixed_end, healthy_end = (r.median(steps - 50, steps) for r in (result, unfixed, healthy))
        print("\n=== traindx demo ===")
        if outcome.anomaly is None and outcome.fix is None and not outcome.log:
            print("no anomaly was found")
        fix = outcome.fix or {}
        print(f"anomaly : {outcome.log[0] if outcome.log else 'none'}")
        if fix:
            print(f"fix     : {fix['id']} {fix['action']} {fix['params']} for {fix['anomaly_id']}, applied at step "
                  f"{fix['applied_step']} ({fix['before']} -> {fix['after']})")
            print(f"verdict : {fix['reason'] or fix['status']}")
        print(f"loss    : {before:.4f} before the fault, {worst:.4g} at its worst, {end:.4f} at the end (median of "
              f"the last 50 steps; without the fix: {unfixed_end:.4g}; the same job without the fault: "
              f"{healthy_end:.4f})")
        print(f"browse  : {url}/  |  {url}/v1/runs/{RUN}/anomalies  |  {url}/v1/runs/{RUN}/audit  |  MCP {url}/mcp")
        # The benchmark's test of a recovery (benchmarks/repair.py): within 1.25x of the job without the fault.
        recovered = end <= RECOVERED_WITHIN * healthy_end
        print(f"result  : {'recovered' if recovered else 'NOT recovered'} (the end within {RECOVERED_WITHIN}x of the "
              f"job without the fault); the server's verdict: {fix.get('status', 'none')}")
        ok = recovered and fix.get("status") == "effective"
        if keep:
            print("[demo] server kept running; press Ctrl-C to stop")
            try:
                server.wait()
            except KeyboardInterrupt:
                pass
        return 0 if ok else 1
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
