"""Generate docs/dashboard.png: a real training run that goes wrong, a fix applied from the API, and the
dashboard's run page photographed in headless Chromium.

    python scripts/screenshot.py [--out docs/dashboard.png] [--chromium /usr/bin/chromium]

Needs Debian's chromium (apt-get install chromium) and the playwright Python package; it never
downloads a browser.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diag_server.client import Client  # noqa: E402
from scripts.live_run import LiveRun  # noqa: E402

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(data_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "diag_server.cli", "serve", "--port", str(port), "--data", data_dir],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(tmp)
        run = LiveRun(url, "mlp-lr-spike", interval=5, step_sleep=0.003).start()
        try:
            run.wait_steps(250)
            run.inject("lr_spike", factor=10.0)  # someone raised the learning rate mid-run
            dx = Client(url, actor="ana")
            deadline = time.monotonic() + 60
            while not (found := dx.anomalies(run.probe.run, status="open")) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not found:
                raise SystemExit("the run raised no anomaly")
            anomaly = next((a for a in found if a.kind.value in ("exploding_gradient", "loss_divergence")), found[0])
            fix = dx.propose(run.probe.run, anomaly.id)[0]
            dx.apply(run.probe.run, fix.id)
            dx.wait_fix(run.probe.run, fix.id)
            run.wait_steps(250)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 1500})
                page.goto(f"{url}/runs/{run.probe.run}")
                page.wait_for_function("document.querySelector('#chart-loss').dataset.points > 0")
                page.click(f"#anomalies tr[data-id='{anomaly.id}']")
                page.wait_for_selector("#fixes")
                time.sleep(0.5)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=args.out, full_page=True)
                browser.close()
        finally:
            run.stop()
            proc.terminate()
            proc.wait(10)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
