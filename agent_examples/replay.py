"""`traindx replay`: re-run a recorded MCP session against a server and report every response that differs.

The traindx command starts this module in a child process (``python -m agent_examples.replay``): the
server's package never imports the examples. Exit status 0 when every response matched, 1 otherwise,
2 for a session file or target that cannot be used.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from agent_examples.scripted_agent import connect
from agent_examples.sessions import SessionError, load, replay as run_replay, start_job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="traindx replay", description=__doc__.splitlines()[0])
    ap.add_argument("session")
    ap.add_argument("--against", required=True)
    ap.add_argument("--run-job", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--data", default=".traindx")
    args = ap.parse_args(argv)
    try:
        header, calls = load(args.session)
    except SessionError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    job = None
    if args.run_job:
        if args.against == "stdio" or not header.get("job"):
            print("Error: --run-job needs a URL target and a session whose header names a job", file=sys.stderr)
            return 2
        job = start_job(header["job"], args.against.rsplit("/mcp", 1)[0])

    async def go():  # noqa: ANN202 - the report type is the sessions module's
        client = (connect(stdio_data=args.data, name="traindx-replay") if args.against == "stdio"
                  else connect(args.against, name="traindx-replay"))
        async with client:
            return await run_replay(client, calls, timeout=args.timeout)

    report = asyncio.run(go())
    if job is not None:
        job.join()
    for m in report.mismatches:
        print(f"call {m.seq} ({m.tool}) differs:")
        for d in m.differences[:20]:
            print(f"  {d}")
    print(f"{report.calls} recorded calls replayed ({report.sent} requests sent): {len(report.mismatches)} differ")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
