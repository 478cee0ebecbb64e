"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright), against a live
server fed by a real training run: the charts draw data, a new anomaly shows up without a reload, the
filters filter, and a fix applied from the page reaches the job, which acknowledges it."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.conftest import PEOPLE_TOKEN, ServerProcess

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
RUN = "dash-run"
WAIT_MS = 45_000  # generous: the CI machine is shared; nothing here asserts how long anything took

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is not installed "
                                "(apt-get install chromium)")
sync_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def live(people_server: ServerProcess) -> Iterator[tuple[ServerProcess, object]]:
    from scripts.live_run import LiveRun

    job = LiveRun(people_server.url, RUN, interval=5, step_sleep=0.005, token=PEOPLE_TOKEN).start()
    job.wait_steps(80)
    yield people_server, job
    job.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def test_run_list_shows_the_run_and_links_to_its_page(live, browser) -> None:
    srv, _ = live
    page = browser.new_page()
    page.goto(srv.url + "/")
    row = page.locator(f"#runs tr[data-run='{RUN}']")
    row.wait_for(timeout=WAIT_MS)
    assert "active" in row.inner_text()
    row.locator("a").click()
    page.wait_for_url(f"**/runs/{RUN}")
    page.close()


def count(page, selector: str) -> int:
    return page.locator(selector).count()


def test_live_run_page_charts_anomalies_filters_and_a_fix_from_the_page(live, browser) -> None:
    srv, job = live
    page = browser.new_page(viewport={"width": 1300, "height": 1400})
    # The server has a token: a person pastes it once in the token box; the page keeps it in localStorage.
    page.add_init_script(f"localStorage.setItem('traindx.token', '{PEOPLE_TOKEN}')")
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{srv.url}/runs/{RUN}")

    # Charts draw real data: loss and scalars, the per-layer heat map, update ratios, step time, memory.
    for target, attr in (("#chart-loss", "points"), ("#chart-updates", "series"), ("#chart-time", "series"),
                         ("#chart-memory", "points"), ("#chart-heat", "rows")):
        page.wait_for_function(f"Number(document.querySelector('{target}').dataset.{attr} || 0) > 0", timeout=WAIT_MS)
    assert page.locator("#chart-loss canvas").count() >= 1
    layers = page.evaluate("document.querySelector('#chart-heat').dataset.rows")
    assert int(layers) == 6  # three Linear layers: weight and bias each
    painted = page.evaluate("""(() => { const c = document.querySelector('#chart-heat canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; })()""")
    assert painted > 1000
    time_series = page.evaluate("traindx.charts.time.series.slice(1).map(s => s.label)")
    assert {"sys/data_wait", "sys/forward", "sys/backward", "sys/optimizer"} <= set(time_series)
    assert count(page, "#anomalies tbody tr[data-kind='nonfinite']") == 0
    assert page.locator("#embeddings-panel").is_hidden()  # an MLP: no embedding table to show

    # A message about the job (here: its probe degraded) shows on the open page, as text.
    text = "<b>the probe stopped sampling</b> after 20 internal errors"
    httpx.post(f"{srv.url}/v1/ingest", headers={"authorization": f"Bearer {PEOPLE_TOKEN}"},
               json={"batch_id": uuid.uuid4().hex, "run": RUN, "seq": 0,
                     "events": [{"kind": "message", "step": 3, "time": 1.0, "level": "error", "text": text}]}
               ).raise_for_status()
    shown = page.locator("#run-messages li[data-level='error']", has_text="the probe stopped sampling")
    shown.first.wait_for(timeout=WAIT_MS)
    assert text in shown.first.inner_text() and "step 3" in shown.first.inner_text()

    # The job breaks; the anomaly appears on the page that is already open (no reload).
    page.evaluate("window.__sameDocument = true")
    job.inject("nan", steps=10)
    page.locator("#anomalies tbody tr[data-kind='nonfinite']").first.wait_for(timeout=WAIT_MS)
    assert page.evaluate("window.__sameDocument") is True
    page.locator("#timeline-list li[data-type='anomaly']").first.wait_for(timeout=WAIT_MS)
    assert page.evaluate("traindx.updates") >= 2  # it came over the event stream

    # Filters: kind, severity, status and the step-time threshold narrow the list, and clearing restores it.
    def rows() -> int:
        page.wait_for_timeout(50)
        return count(page, "#anomalies tbody tr")

    def settle(expect) -> None:
        page.wait_for_function(f"(() => {{ const n = document.querySelectorAll('#anomalies tbody tr').length; "
                               f"return {expect}; }})()", timeout=WAIT_MS)

    page.select_option("#f-kind", "nonfinite")
    settle("n >= 1 && [...document.querySelectorAll('#anomalies tbody tr')].every(r => r.dataset.kind === 'nonfinite')")
    page.select_option("#f-severity", "info")
    settle("n === 0")
    page.select_option("#f-severity", "critical")
    settle("n >= 1")
    page.fill("#f-latency", "1000000000")  # ms: no step took that long
    settle("n === 0")
    page.fill("#f-latency", "0")
    settle("n >= 1")
    page.fill("#f-latency", "")
    page.select_option("#f-kind", "exploding_gradient")
    settle("[...document.querySelectorAll('#anomalies tbody tr')].every(r => r.dataset.kind === 'exploding_gradient')")
    page.select_option("#f-kind", "")
    page.select_option("#f-severity", "")
    settle("n >= 1")
    assert rows() >= 1

    # Open the anomaly: evidence, diagnosis, proposals; apply one as a person; the job acknowledges it.
    page.fill("#actor", "tester")
    page.dispatch_event("#actor", "change")
    page.locator("#anomalies tbody tr[data-kind='nonfinite']").first.click()
    page.locator("#detail .kv").wait_for(timeout=WAIT_MS)
    assert "nonfinite" in page.inner_text("#detail h2")
    assert page.inner_text("#detail .diagnosis").strip()
    page.locator("#detail button.propose").click()
    skip = page.locator("#fixes tr", has_text="skip_nonfinite")
    skip.first.wait_for(timeout=WAIT_MS)
    fix_id = skip.first.get_attribute("data-fix")
    page.locator(f"#fixes tr[data-fix='{fix_id}'] button.apply").click()
    page.wait_for_function(
        f"['applied', 'effective', 'ineffective'].includes(document.querySelector(\"#fixes tr[data-fix='{fix_id}']\")"
        "?.dataset.status)", timeout=WAIT_MS)
    page.locator(f"#timeline-list li[data-type='fix'][data-ref='{fix_id}']").first.wait_for(timeout=WAIT_MS)

    trail = httpx.get(f"{srv.url}/v1/runs/{RUN}/audit?fix_id={fix_id}").json()["entries"]
    asked = [e for e in trail if e["action"] == "apply_requested"]
    acked = [e for e in trail if e["actor"] == "job" and e["action"] == "applied"]
    assert asked and asked[0]["actor"] == "person:tester"
    assert acked, "the job never acknowledged the fix"
    assert errors == []
    page.close()


def test_a_recommender_run_shows_its_embedding_tables(live, browser) -> None:
    """A run with embedding tables: the page lists each table's latest report, with its zombie-like rows."""
    import torch

    import probes
    from tests.embedding_jobs import Toy, train

    srv, _ = live
    torch.manual_seed(0)
    model = Toy(rows=40, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = "dash-recsys"
    probe = probes.attach(model, opt, server=srv.url, run=run, token=PEOPLE_TOKEN, collections={"embeddings": 20})
    ids = torch.tensor([i for i in range(40) if i not in (5, 33)])
    train(model, probe, 81, ids=ids, zombies={3, 17, 29}, opt=opt)
    assert probe.flush()
    probe.close()
    page = browser.new_page(viewport={"width": 1300, "height": 1400})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{srv.url}/runs/{run}")
    row = page.locator("#embeddings tbody tr[data-table='table.weight']")
    row.wait_for(timeout=WAIT_MS)
    cells = row.locator("td").all_inner_texts()
    assert cells[:6] == ["table.weight", "80", "40", "38", "2", "0"] and float(cells[7]) > 0  # the score spread
    assert sorted(int(z.split(":")[0]) for z in cells[-2].split(" · ")[:3]) == [3, 17, 29]
    assert sorted(int(z.split(":")[0]) for z in cells[-1].split(" · ")[:3]) == [3, 17, 29]  # their data, over the run
    assert page.locator("#embeddings-panel").is_visible() and errors == []

    # A language model whose output projection is its token table (tied, or the table itself used as the
    # output matrix): the table says what it is tied to, or that it learns outside its lookups.
    from tests.embedding_jobs import TinyLM, train_lm
    for run, tie, shown in (("dash-tied", True, "wte.weight · tied to lm_head.weight"),
                            ("dash-output", False, "wte.weight · learns outside its lookups")):
        model = TinyLM(40, tie=tie, output=not tie)
        probe = probes.attach(model, torch.optim.Adam(model.parameters(), lr=0.01), server=srv.url, run=run,
                              token=PEOPLE_TOKEN, collections={"embeddings": 20})
        train_lm(model, probe, 21, inputs=36)
        assert probe.flush()
        probe.close()
        page.goto(f"{srv.url}/runs/{run}")
        row = page.locator("#embeddings tbody tr[data-table='wte.weight']")
        row.wait_for(timeout=WAIT_MS)
        assert row.locator("td").first.inner_text() == shown and errors == []
    page.close()


def test_pages_refuse_a_foreign_origin(live) -> None:
    srv, _ = live
    res = httpx.get(srv.url + "/", headers={"host": "attacker.example"})
    # The security middleware answers before any route (docs/security.md): 421 for a foreign Host...
    assert res.status_code == 421 and res.json()["error"] == "invalid_host"
    res = httpx.post(f"{srv.url}/v1/runs/{RUN}/fixes/f-1/apply", headers={"origin": "http://attacker.example"})
    # ...and 403 for a foreign Origin.
    assert res.status_code == 403 and res.json()["error"] == "invalid_origin"
    assert httpx.get(srv.url + "/static/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(srv.url + "/static/../http.py").status_code == 404
