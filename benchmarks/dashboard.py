"""The dashboard's figures on a big run: time to first paint and to a live update of the run page, page weight.

    python benchmarks/dashboard.py [--layers 100] [--steps 10000] [--interval 100] [--repeats 5]

A real `traindx serve`, a real training run (an MLP of ``--layers`` Linear+ReLU layers, the probe's default
collections sampled every ``--interval`` steps, ``--steps`` steps), and the run page in headless Debian
chromium (Playwright). Figures, each beside its goal (issue 41) and the ratio to it:

- first paint: from navigation to every chart drawn with its data (the page's own mark,
  ``traindx.timings.drawn``); also the browser's first contentful paint. Median of ``--repeats`` loads.
- live update: from an ingest POST returning (the event is stored) to the open page showing that step
  (``traindx.shownStep``), over the run's change stream. Median and worst of ``--repeats`` x 2 events.
- page weight: the bytes the page fetched for the first paint (HTML, scripts, styles, data), as sent.
- the Playwright checks: the tests in tests/test_dashboard*.py that drive chromium, as pytest collects them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diag_server.testing import serve  # noqa: E402 - after the checkout is on sys.path
from scripts.screenshot import CHROMIUM_ARGS  # noqa: E402

GOALS = {"first_paint_ms": 1000.0, "live_update_ms": 500.0}


def train(url: str, run: str, layers: int, steps: int, interval: int) -> object:
    """A real run: returns the probe, left open (the run stays active for the live-update figure)."""
    import torch

    import probes

    torch.manual_seed(0)
    torch.set_num_threads(1)  # small matrices: more threads only contend on a shared machine
    width = 32
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = probes.attach(model, opt, run=run, server=url, interval=interval,
                          config={"layers": layers, "width": width, "lr": 0.01, "steps": steps})
    x, y = torch.randn(256, width), torch.randn(256, 1)
    t0 = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(0, 256, (16,))
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        if step % 1000 == 0:
            print(f"  step {step} ({time.perf_counter() - t0:.0f} s)", flush=True)
    assert probe.flush(timeout=600), "the probe could not deliver its events"
    return probe


# Collects the dashboard's tests and counts those that take the `browser` fixture (a real chromium page).
_COLLECT = """
import sys, pytest
class Count:
    def pytest_collection_finish(self, session):
        print("browser-driven", sum("browser" in i.fixturenames for i in session.items), len(session.items))
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Count()]))
"""


def playwright_tests() -> tuple[int, int]:
    """(tests that drive chromium through Playwright, all tests) in tests/test_dashboard*.py, as pytest collects them."""
    files = sorted(str(p) for p in (ROOT / "tests").glob("test_dashboard*.py"))
    out = subprocess.run([sys.executable, "-c", _COLLECT, *files], capture_output=True, text=True, cwd=ROOT, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("browser-driven "):
            driven, total = line.split()[1:]
            return int(driven), int(total)
    raise SystemExit(f"pytest could not collect the dashboard's tests:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")


def row(name: str, value: float, unit: str, goal: float | None) -> None:
    ratio = f"{value / goal:.2f} of the goal" if goal else ""
    print(f"{name:<34} {value:>10.1f} {unit:<3} goal {'<= ' + format(goal, '.0f') if goal else '-':>8} {ratio}")


def measure(url: str, run: str, steps: int, repeats: int, chromium: str, token: str) -> dict:
    """Load the run page ``repeats`` times, then time ``2 * repeats`` live updates on it."""
    from playwright.sync_api import sync_playwright

    headers = {"authorization": f"Bearer {token}"}
    paints, fcps, weights, updates = [], [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        page.goto(f"{url}/?token={token}")  # the cookie, as a person's first visit sets it
        page.wait_for_selector("html[data-settled]")
        for _ in range(repeats):
            page.goto(f"{url}/runs/{run}", wait_until="commit")
            page.wait_for_function("window.traindx && window.traindx.timings.drawn > 0", timeout=60_000)
            paints.append(page.evaluate("traindx.timings.drawn"))
            fcps.append(page.evaluate("(performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime || 0"))
            weights.append(page.evaluate(
                "performance.getEntriesByType('navigation').concat(performance.getEntriesByType('resource'))"
                ".filter(e => e.startTime <= traindx.timings.drawn).reduce((n, e) => n + (e.encodedBodySize || 0), 0)"))
        heaviest = page.evaluate(
            "performance.getEntriesByType('resource').filter(e => e.startTime <= traindx.timings.drawn)"
            ".map(e => [e.name.replace(location.origin, ''), e.encodedBodySize, e.responseEnd - e.startTime])")
        page.wait_for_selector("#run-state[data-state=live], #run-state[data-state=stale]", timeout=60_000)
        page.wait_for_timeout(1000)  # the stream's first update and the redraw it asks for
        step = steps + 10 + int(time.time()) % 100_000  # past every step the run has (a store used again)
        for _ in range(repeats * 2):
            step += 1
            body = {"batch_id": uuid.uuid4().hex, "run": run, "seq": 0, "events": [
                {"kind": "scalars", "step": step, "time": time.time(), "values": {"loss": 0.5}}]}
            httpx.post(f"{url}/v1/ingest", json=body, headers=headers).raise_for_status()
            stored = time.time() * 1000
            page.wait_for_function(f"traindx.shownStep >= {step}", timeout=30_000, polling="raf")
            updates.append(page.evaluate("traindx.timings.shown") - stored)
            page.wait_for_timeout(300)
        browser.close()
    return {"paints": paints, "fcps": fcps, "weights": weights, "updates": updates, "heaviest": heaviest}


def report(m: dict) -> None:
    paints, updates = m["paints"], m["updates"]
    print()
    row("first paint (charts drawn), median", statistics.median(paints), "ms", GOALS["first_paint_ms"])
    row("first contentful paint, median", statistics.median(m["fcps"]), "ms", None)
    row("live update after stored, median", statistics.median(updates), "ms", GOALS["live_update_ms"])
    row("live update after stored, worst", max(updates), "ms", GOALS["live_update_ms"])
    row("page weight (first paint)", statistics.median(m["weights"]) / 1024, "KiB", None)
    driven, total = playwright_tests()
    print(f"{'Playwright checks (browser tests)':<34} {driven:>10d}     of {total} tests in tests/test_dashboard*.py")
    print(f"(first paints: {', '.join(f'{v:.0f}' for v in paints)} ms; live updates: "
          f"{', '.join(f'{v:.0f}' for v in updates)} ms)")
    print("what the last first paint fetched, largest first:")
    for name, size, took in sorted(m["heaviest"], key=lambda r: -r[1])[:8]:
        print(f"  {size / 1024:8.1f} KiB {took:7.0f} ms  {name[:100]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--interval", type=int, default=100, help="the probe's default")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRAINDX_SPOOL"] = os.path.join(tmp, "spool")
        server = serve(os.path.join(tmp, "data"))  # its token in TRAINDX_TOKEN, made up when unset
        url, token = server.url, server.token
        run = "bench-100-layers"
        try:
            print(f"training {args.layers} layers for {args.steps} steps, sampled every {args.interval} ...", flush=True)
            probe = train(url, run, args.layers, args.steps, args.interval)
            rows = httpx.get(f"{url}/v1/runs/{run}/heatmap?collection=gradients",
                             headers=server.headers).json()
            print(f"the run: {len(rows['tensors'])} gradient tensors, {len(rows['steps'])} sampled steps")
            m = measure(url, run, args.steps, args.repeats, args.chromium, token)
            probe.close()
        finally:
            server.stop()
    report(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
