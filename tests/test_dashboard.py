"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright), against a live
server fed by real training runs: the charts draw data, a new anomaly shows up without a reload, the
filters filter, a fix applied from the page reaches the job, which acknowledges it, and reverted from the
page comes off; runs are searched, picked and compared; a 100-layer model's heat map and legends stay
readable; the pages fit 1400 and 1024 px without overflowing, say a run's state once, drop the token from
the address bar, and settle (no request left running) for a screenshot or a print."""

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
    # its before and after, as lines that wrap in the panel (not JSON that pushes it wider)
    page.locator(f"#fixes tr[data-fix='{fix_id}'] .change").first.wait_for(timeout=WAIT_MS)

    # Revert it from the page: the job takes it off and says so; the audit names the person again.
    page.locator(f"#fixes tr[data-fix='{fix_id}'] button.revert").click()
    page.wait_for_function(f"document.querySelector(\"#fixes tr[data-fix='{fix_id}']\")?.dataset.status === 'reverted'",
                           timeout=WAIT_MS)
    trail = httpx.get(f"{srv.url}/v1/runs/{RUN}/audit?fix_id={fix_id}").json()["entries"]
    assert [e["actor"] for e in trail if e["action"] == "revert_requested"] == ["person:tester"]
    assert any(e["actor"] == "job" and e["action"] == "reverted" for e in trail)
    page.locator(f"#fixes tr[data-fix='{fix_id}'] button.apply").wait_for(timeout=WAIT_MS)  # it can go on again
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


# -- runs, compared --------------------------------------------------------------------------------------
OTHER = "dash-run-b"


@pytest.fixture(scope="module")
def other_run(live) -> str:
    """A second run of the same job with another learning rate and width: what a person compares against."""
    from scripts.live_run import LiveRun

    srv, _ = live
    job = LiveRun(srv.url, OTHER, interval=5, step_sleep=0.002, lr=0.01, hidden=64, seed=1, token=PEOPLE_TOKEN).start()
    job.wait_steps(60)
    job.stop()
    return OTHER


def test_runs_are_searched_picked_and_compared(live, other_run, browser) -> None:
    srv, _ = live
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(srv.url + "/")
    page.locator(f"#runs tr[data-run='{OTHER}']").wait_for(timeout=WAIT_MS)
    page.fill("#runs-search", "DASH-RUN")  # any case
    page.wait_for_function("[...document.querySelectorAll('#runs tbody tr')].every(r => r.dataset.run.startsWith('dash-run'))"
                           " && document.querySelectorAll('#runs tbody tr').length === 2", timeout=WAIT_MS)
    page.check("#runs-open")  # only runs with an open anomaly: the broken one, not its healthy twin
    page.wait_for_function(f"!document.querySelector(\"#runs tr[data-run='{OTHER}']\")", timeout=WAIT_MS)
    assert "open=1" in page.url and "search=DASH-RUN" in page.url  # a filtered list is a link to share
    page.uncheck("#runs-open")
    page.locator(f"#runs tr[data-run='{OTHER}']").wait_for(timeout=WAIT_MS)
    assert page.is_disabled("#compare-selected")
    for run in (RUN, OTHER):
        page.check(f"#runs tr[data-run='{run}'] input[type=checkbox]")
    page.click("#compare-selected")
    page.wait_for_url(f"**/compare?run={RUN}&run={OTHER}*")
    page.wait_for_selector("html[data-settled]", timeout=WAIT_MS)

    # the same metric of both runs, overlaid; their anomalies and fixes on the same axis; where configs differ
    assert page.get_attribute("#chart-compare", "data-series") == "2"
    assert int(page.get_attribute("#chart-compare", "data-points")) >= 60
    assert page.evaluate("traindx.charts.compare.series.slice(1).map(s => s.label)") == [RUN, OTHER]
    assert int(page.get_attribute("#chart-compare-marks", "data-marks")) >= 1  # the NaN anomaly of the first run
    lr = page.locator("#config-diff tr[data-key='optimizer.lr'] td").all_inner_texts()
    assert lr == ["optimizer.lr", "0.02", "0.01"]
    assert page.locator("#config-diff tr[data-key='model.hidden'] td").all_inner_texts() == ["model.hidden", "32", "64"]
    assert "the same in every run" in page.inner_text("#compare-same")
    page.check("input[name=align][value=time]")
    assert page.evaluate("traindx.charts.compare.series[0].label") == "seconds since the run began"
    assert "align=time" in page.url
    page.select_option("#compare-metric", "accuracy")
    page.wait_for_function("traindx.comparison.metric === 'accuracy'", timeout=WAIT_MS)
    assert "accuracy" in page.inner_text("#compare-chart-title") and errors == []
    page.close()


# -- a 100-layer model -----------------------------------------------------------------------------------
DEEP = "dash-deep"


@pytest.fixture(scope="module")
def deep_run(live) -> str:
    """A real 100-layer MLP (200 parameter tensors, 201 activations), a few sampled steps."""
    import torch

    import probes

    srv, _ = live
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(100):
        layers += [torch.nn.Linear(4, 4), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = probes.attach(model, opt, server=srv.url, run=DEEP, token=PEOPLE_TOKEN, interval=5,
                          config={"layers": 100, "width": 4})
    x = torch.randn(32, 4)
    for _ in range(16):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
    assert probe.flush()
    probe.close()
    return DEEP


def test_a_100_layer_heat_map_groups_names_on_hover_and_legends_keep_to_the_top(live, deep_run, browser) -> None:
    srv, _ = live
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{srv.url}/runs/{DEEP}")
    page.wait_for_selector("html[data-settled]", timeout=WAIT_MS)
    heat = page.locator("#chart-heat")
    assert heat.get_attribute("data-tensors") == "200"
    assert int(heat.get_attribute("data-rows")) <= 40 and heat.get_attribute("data-level") == "block"
    box = page.locator("#chart-heat .u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + 3)  # the top row, a block of layers
    tip = page.inner_text("#heat-tip")
    assert "tensors; largest:" in tip and (".weight" in tip or ".bias" in tip), tip  # the full name, on hover
    page.mouse.click(box["x"] + box["width"] * 0.6, box["y"] + 3)  # that tensor's gradient distribution
    page.wait_for_function("document.querySelector('#chart-dist').dataset.collection === 'gradients'", timeout=WAIT_MS)
    assert page.get_attribute("#chart-dist", "data-tensor") in tip
    page.select_option("#heat-level", "tensor")
    page.wait_for_function("document.querySelector('#chart-heat').dataset.rows === '200'", timeout=WAIT_MS)
    page.select_option("#heat-level", "layer")
    page.wait_for_function("document.querySelector('#chart-heat').dataset.rows === '100'", timeout=WAIT_MS)

    # 200 update-ratio lines: the top 6 by peak are drawn and listed, the rest on demand
    assert page.get_attribute("#chart-updates", "data-shown") == "6"
    assert "top 6 of 200" in page.inner_text("#updates-more")
    assert page.locator("#chart-updates .u-legend .u-series").count() == 7  # the step, and six
    page.click("#updates-more")
    page.wait_for_function("document.querySelector('#chart-updates').dataset.shown === '200'", timeout=WAIT_MS)
    legend = page.locator("#chart-updates .u-legend").bounding_box()
    assert legend["height"] < 100  # it scrolls instead of pushing the page down
    assert errors == []
    page.close()


# -- every page: it fits, says its state once, settles --------------------------------------------------
OVERFLOW = """(() => {
  const doc = document.documentElement;
  const wide = [...document.querySelectorAll('.chart, .panel, #runs-page, #run-page, #compare-page')]
    .filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1).map(e => e.id || e.className);
  const hidden = [...document.querySelectorAll('main > section:not([hidden]) .chart')]
    .filter(e => !e.offsetParent || e.getBoundingClientRect().width < 200 || !e.querySelector('canvas')).map(e => e.id);
  return {page: doc.scrollWidth - doc.clientWidth, wide, hidden};
})()"""


@pytest.mark.parametrize("width", [1400, 1024])
def test_every_page_fits_the_window_and_shows_every_panel(live, other_run, deep_run, browser, width) -> None:
    srv, _ = live
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    for path in ("/", f"/runs/{RUN}", f"/runs/{DEEP}", f"/compare?run={RUN}&run={OTHER}&run={DEEP}"):
        page.goto(srv.url + path)
        page.wait_for_selector("html[data-settled]", timeout=WAIT_MS)
        if path == f"/runs/{RUN}":  # the anomaly with the fix applied and reverted: the widest detail there is
            page.locator("#anomalies tbody tr[data-kind='nonfinite']").first.click()
            page.locator("#fixes .change").first.wait_for(timeout=WAIT_MS)
            for chart in ("loss", "heat", "updates", "dist", "time", "memory", "timeline"):
                assert page.locator(f"#panel-{chart}").is_visible() and page.locator(f"#chart-{chart} canvas").count()
        found = page.evaluate(OVERFLOW)
        assert found == {"page": 0, "wide": [], "hidden": []}, (path, found)
    assert errors == []
    page.close()


def test_an_ended_run_says_so_once_and_its_page_settles(live, browser) -> None:
    srv, _ = live
    from tests.conftest import PEOPLE_RUN

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(f"{srv.url}/runs/{PEOPLE_RUN}")
    page.wait_for_selector("html[data-settled]", timeout=WAIT_MS)
    assert page.get_attribute("#run-state", "data-state") == "ended"
    assert page.inner_text("#run-state").startswith("ended · step ")
    assert page.inner_text("#run-page").count("ended") == page.inner_text("#run-state").count("ended")
    assert not any("/stream" in u for u in requests)  # an ended run is not followed
    before = len(requests)
    page.wait_for_timeout(1500)
    assert len(requests) == before  # nothing more is asked: a screenshot or a print can be taken

    # printing: the charts and tables, without the inputs, within the page
    page.emulate_media(media="print")
    assert page.locator("#filters").is_hidden() and page.locator("#actor").is_hidden()
    assert page.locator("#chart-loss canvas").first.is_visible()
    assert len(page.pdf(format="A4")) > 10_000
    page.close()


def test_a_live_run_is_live_once_and_a_snapshot_stays_still(live, browser) -> None:
    srv, _ = live
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{srv.url}/runs/{RUN}")
    page.wait_for_selector("#run-state[data-state=live]", timeout=WAIT_MS)
    assert page.inner_text("#run-state").startswith("live · step ")
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(f"{srv.url}/runs/{RUN}?live=0")  # for a screenshot of a run still going: drawn once
    page.wait_for_selector("html[data-settled]", timeout=WAIT_MS)
    assert page.get_attribute("#run-state", "data-state") == "snapshot"
    before = len(requests)
    page.wait_for_timeout(1000)
    assert len(requests) == before and not any("/stream" in u for u in requests)
    page.close()


def test_the_token_leaves_the_address_bar_once_the_cookie_is_set(live, browser) -> None:
    srv, _ = live
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{srv.url}/?token={PEOPLE_TOKEN}&search=dash")
    page.wait_for_selector("html[data-settled]", timeout=WAIT_MS)
    assert "token" not in page.url and "search=dash" in page.url
    assert any(c["name"] == "traindx_token" and c["httpOnly"] for c in context.cookies())
    assert PEOPLE_TOKEN not in page.evaluate("history.state === null ? location.href : JSON.stringify(history.state)")
    context.close()
