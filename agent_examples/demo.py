"""`traindx demo`: a server, a training run that goes wrong, and an agent that finds and fixes it.

Everything is real: a `traindx serve` process on a free port with a temporary data directory, a
PyTorch training loop with the probe attached, and the scripted agent talking to the server over the
official MCP client (Streamable HTTP). The traindx command starts this module in a child process
(``python -m agent_examples.demo``): the server's package never imports the examples.

Run from a terminal, the server stays up at the end, with the dashboard's link, until Ctrl-C; otherwise
(``--no-keep``, or output to a pipe) it stops with the demo and no link is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from urllib.parse import quote

from agent_examples.jobs import lr_spike_job
from agent_examples.scripted_agent import connect, triage
from diag_server.testing import serve

RUN = "demo-lr-spike"
FAULT_STEP = 500


def run_demo(steps: int = 1500, keep: bool = False) -> int:
    data_dir = tempfile.mkdtemp(prefix="traindx-demo-")
    print(f"[demo] starting traindx serve (data in {data_dir})")
    server = serve(os.path.join(data_dir, "data"))
    url = server.url
    print(f"[demo] serving on {url}")
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
        print(f"[demo] training finished in {time.monotonic() - t0:.1f}s; computing the same run without the fix")
        baseline = lr_spike_job(run="counterfactual", steps=steps, fault_step=FAULT_STEP, pace=0, attach=False)
        before = result.median(FAULT_STEP - 50, FAULT_STEP)
        worst = max(result.median(i, i + 20) for i in range(FAULT_STEP, min(steps - 20, FAULT_STEP + 300), 10))
        after = result.median(steps - 50, steps)
        unfixed = baseline.median(steps - 50, steps)
        print("\n=== traindx demo ===")
        if outcome.anomaly is None and outcome.fix is None and not outcome.log:
            print("no anomaly was found")
        fix = outcome.fix or {}
        print(f"anomaly : {outcome.log[0] if outcome.log else 'none'}")
        if fix:
            print(f"fix     : {fix['id']} {fix['action']} {fix['params']} applied at step {fix['applied_step']} "
                  f"({fix['before']} -> {fix['after']}); verdict: {fix['status']}")
        print(f"loss    : {before:.4f} before the fault, {worst:.4g} at its worst, {after:.4f} at the end "
              f"(without the fix: {unfixed:.4g})")
        if keep:  # the link carries the token once: the page sets its cookie and drops it from the address
            token = quote(os.environ["TRAINDX_TOKEN"], safe="")
            print(f"browse  : {url}/runs/{RUN}?token={token}  |  MCP {url}/mcp  |  HTTP {url}/v1/runs/{RUN}")
        recovered = bool(fix) and fix["status"] == "effective" and after < 2 * before
        print(f"result  : {'recovered' if recovered else 'NOT recovered'}")
        if keep:
            print("[demo] the server keeps running for the links above; press Ctrl-C to stop it")
            try:
                server.proc.wait()
            except KeyboardInterrupt:
                pass
        return 0 if recovered else 1
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="traindx demo", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--keep", action=argparse.BooleanOptionalAction, default=None,
                    help="keep the server (and the dashboard) up at the end until Ctrl-C; default: when the "
                         "output is a terminal")
    args = ap.parse_args(argv)
    keep = sys.stdout.isatty() if args.keep is None else args.keep
    return run_demo(steps=args.steps, keep=keep)


if __name__ == "__main__":
    sys.exit(main())
