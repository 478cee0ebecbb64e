"""Regenerate the dashboard's screenshots under docs/: real training runs, one that goes wrong and is fixed
from the API and one that does not, photographed in headless Chromium.

    python scripts/screenshot.py [--out docs] [--chromium /usr/bin/chromium]

Writes ``dashboard.png`` (the run page of the broken run, its anomaly open with the fix applied),
``dashboard-runs.png`` (the list of runs, both picked) and ``dashboard-compare.png`` (the two runs side by
side). Needs Debian's chromium (apt-get install chromium) and the playwright Python package; it never
downloads a browser.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diag_server.client import Client  # noqa: E402
from diag_server.testing import serve  # noqa: E402
from scripts.live_run import LiveRun  # noqa: E402

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
WIDTH = 1400


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs"), help="the folder the screenshots are written to")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRAINDX_SPOOL"] = os.path.join(tmp, "spool")  # nothing left over from another run
        server = serve(os.path.join(tmp, "data"))  # its token in TRAINDX_TOKEN, made up when unset
        url, token = server.url, server.token
        baseline = LiveRun(url, "mlp-baseline", interval=5, step_sleep=0.003, lr=0.01, hidden=64, seed=1,
                           token=token).start()
        broken = LiveRun(url, "mlp-lr-spike", interval=5, step_sleep=0.003, token=token).start()
        try:
            broken.wait_steps(250)
            broken.inject("lr_spike", factor=10.0)  # someone raised the learning rate mid-run
            dx = Client(url, actor="ana", token=token)
            deadline = time.monotonic() + 60
            while not (found := dx.anomalies(broken.probe.run, status="open")) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not found:
                raise SystemExit("the run raised no anomaly")
            anomaly = next((a for a in found if a.kind.value in ("exploding_gradient", "loss_divergence")), found[0])
            fix = dx.propose(broken.probe.run, anomaly.id)[0]
            dx.apply(broken.probe.run, fix.id)
            dx.wait_fix(broken.probe.run, fix.id)
            broken.wait_steps(250)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": WIDTH, "height": 1000})
                page.set_default_timeout(120_000)  # a loaded machine
                page.goto(f"{url}/?token={token}")  # sets the cookie, as the link traindx serve prints does
                page.wait_for_selector("html[data-settled]")
                for run in (baseline.probe.run, broken.probe.run):
                    page.check(f"#runs tr[data-run='{run}'] input[type=checkbox]")
                page.screenshot(path=str(out / "dashboard-runs.png"))
                page.goto(f"{url}/runs/{broken.probe.run}")
                page.wait_for_selector("html[data-settled]")
                page.click(f"#anomalies tr[data-id='{anomaly.id}']")
                page.wait_for_selector("#fixes")
                page.screenshot(path=str(out / "dashboard.png"), full_page=True)
                page.goto(f"{url}/compare?run={broken.probe.run}&run={baseline.probe.run}")
                page.wait_for_selector("html[data-settled]")
                page.screenshot(path=str(out / "dashboard-compare.png"), full_page=True)
                browser.close()
        finally:
            broken.stop()
            baseline.stop()
            server.stop()
    for name in ("dashboard.png", "dashboard-runs.png", "dashboard-compare.png"):
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
