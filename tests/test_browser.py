"""The dashboard's training page in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``.ci/run`` installs) driven by selenium. For each training master, a fresh
``local[2]`` context's page waits for a fit, then shows it running; Dask's own status page renders;
the page opened again shows the fit still running and, as it goes on, finished. Each page must render
its Bokeh document (every plot drawn; at the end, every line chart with lines in the rows' colours)
with no error in the browser's console. A listener holds the fit at its first step until the page
has been seen running.

With ``DLSCALE_SCREENSHOTS`` set to a folder (``docs/images``), the finished pages are saved there as
the screenshots of ``docs/statistics.md``."""

from __future__ import annotations

import functools
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from bokeh.palettes import Category10_10

from dlscale import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkContext, SparkNet
from dlscale.monitor.panel import PAGE
from dlscale.nn import Network
from dlscale.nn.listeners import TrainingListener
from tests.test_panel import batches

webdriver = pytest.importorskip("selenium.webdriver", reason="the browser test needs selenium (the test extra)")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SCREENSHOTS = os.environ.get("DLSCALE_SCREENSHOTS")  # a folder for the screenshots of docs/statistics.md
SCREENSHOT_EPOCHS = 10
WIDTH, HEIGHT = 1200, 800
LINES = list(Category10_10[:4])  # the colours of the rows' lines (4 trainers or 2 workers)

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="no Chromium with its chromedriver (Debian: apt-get install chromium chromium-driver, as .ci/run does)",
)

# What a page's Bokeh document shows, read in the browser: each plot (drawn, its canvas's number of
# colours and its pixels in each of the colours asked for), the text that the views of the training
# page's named models show, and the data of its sources. Models are those reachable from the roots:
# BokehJS keeps those replaced until its document has been still for 30 s.
_RENDERED = """
const docs = window.Bokeh ? Bokeh.documents : [];
if (docs.length == 0) return null;
const plots = [];
for (const v of Bokeh.index.all_views()) {
  if (v.model.type != "Figure") continue;
  if (!v.has_finished()) return null;
  const canvas = v.canvas_view.primary.canvas;
  if (canvas.width == 0 || canvas.height == 0) return null;
  const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  const colours = new Map();
  for (let i = 0; i < pixels.length; i += 4) {
    const colour = "#" + ((1 << 24) | (pixels[i] << 16) | (pixels[i + 1] << 8) | pixels[i + 2]).toString(16).slice(1);
    colours.set(colour, (colours.get(colour) ?? 0) + 1);
  }
  const pixels_of = Object.fromEntries(arguments[0].map((c) => [c, colours.get(c) ?? 0]));
  plots.push({title: v.model.title ? v.model.title.text : "", colours: colours.size, pixels_of});
}
const models = new Set(docs[0].roots().flatMap((root) => [...root.references()]));
const text = {};
for (const model of models) {
  if (!["dlscale-fit", "dlscale-status", "dlscale-table"].includes(model.name)) continue;
  const view = Bokeh.index.find_one(model);
  if (view == null) continue;
  if (view.input_el instanceof HTMLSelectElement) {  // the chosen option, then every option
    const options = Array.from(view.input_el.options);
    text[model.name] = [options[view.input_el.selectedIndex], ...options].map((o) => o?.text ?? "").join("\\n");
  } else {
    text[model.name] = view.markup_el.innerText;
  }
}
const sources = [...models].filter((m) => m.type == "ColumnDataSource").map((s) => Object.fromEntries(
  s.columns().map((c) => [c, Array.from(s.data[c], (x) => (typeof x == "number" && !isFinite(x) ? null : x))])
));
return {plots, text, sources};
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # no Selenium Manager
    driver.set_page_load_timeout(30)
    viewport(driver, HEIGHT)
    yield driver
    driver.quit()


def network() -> Network:
    """A network whose weights top-k compresses (a tensor sends a part of itself once that part, at
    least 32 elements, is under a third of it): the threshold and sparsity charts have lines."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    return Network(module, "cross_entropy", functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))


class Gate(TrainingListener):
    """Holds a fit at its first step on the driver until opened, so that the page sees it running
    however fast it trains (trainers and workers report to the scheduler, which the page reads)."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def step_done(self, network: Any, step: Any) -> None:
        self.opened.wait(120)


def errors(driver: Any) -> list[str]:
    """What the browser's console logged as an error since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def shown(driver: Any, what: str, plots: int, shows: Callable[[dict], bool], timeout: float = 30.0) -> dict:
    """The page, read in the browser, once its Bokeh documents have rendered ``plots`` plots or more,
    none blank, and ``shows`` is true of it; fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        page = driver.execute_script(_RENDERED, LINES)
        if page is not None and len(page["plots"]) >= plots and all(p["colours"] > 2 for p in page["plots"]):
            if shows(page):
                return page
        if time.monotonic() > deadline:
            seen = page and {k: page[k] for k in ("plots", "text")} | {"phases": phases(page)}
            raise AssertionError(f"the browser did not show {what} within {timeout:.0f} s; it showed {seen}")
        time.sleep(0.1)


def status(page: dict) -> str:
    """The training page's status line as the browser shows it."""
    return page["text"]["dlscale-status"]


def done(page: dict) -> int:
    """The minibatches done, from the status line ("gradient sharing: running, 120 of 400 minibatches ...")."""
    return int(status(page).split(", ", 1)[1].split(" of ")[0].replace(",", ""))


def lines(page: dict) -> dict[str, int]:
    """The pixels of each chart of the rows' series in the rows' colours: its lines (and points) drawn."""
    return {
        p["title"]: sum(p["pixels_of"].values())
        for p in page["plots"]
        if not p["title"].startswith(("Share of time", "Round times"))
    }


def phases(page: dict) -> list[float]:
    """The share of time each row spent fitting, as the phase chart's data source has it."""
    return next((s["fit"] for s in page["sources"] if "label" in s and "fit" in s), [])


@pytest.fixture(params=["gradient sharing", "parameter averaging"])
def approach(request) -> str:
    return request.param


@pytest.fixture
def context(browser) -> Iterator[SparkContext]:
    """A context of its own, whose page waits for a fit; the browser leaves its pages before it stops
    (a page left open would log its lost connection)."""
    with SparkContext("local[2]", "dlscale-browser") as context:
        try:
            yield context
        finally:
            browser.get("about:blank")
            errors(browser)


def test_the_training_page_shows_a_fit_running_then_finished(browser, context, approach: str, tmp_path) -> None:
    sharing = approach == "gradient sharing"
    charts = 6 if sharing else 4  # loss, examples/s, phases; then bytes, threshold, sparsity or round times
    rows = 4 if sharing else 2  # two trainers per worker, or the workers
    epochs = 2
    base = context.uiWebUrl.rsplit("/", 1)[0]
    browser.get(base + PAGE)
    page = shown(browser, "the page waiting for a fit", 0, lambda page: "dlscale-status" in page["text"])
    assert page["plots"] == [] and status(page).startswith("Waiting for a fit")
    assert errors(browser) == []

    if sharing:
        master = SharedTrainingMaster(batch_size_per_worker=16, workers_per_node=2, collect_training_stats=True)
    else:
        master = ParameterAveragingTrainingMaster(
            16, averaging_frequency=2, collect_training_stats=True, export_directory=str(tmp_path)
        )
    spark_net = SparkNet(context, network(), master)
    gate = Gate()
    spark_net.set_listeners(gate)
    data = context.parallelize(batches(), 4)
    failure: list[BaseException] = []

    def fit() -> None:
        try:
            spark_net.fit(data, epochs=epochs)
        except BaseException as e:  # failed by the test
            failure.append(e)

    fitting = threading.Thread(target=fit)
    fitting.start()
    try:
        page = shown(browser, "the fit running", charts, lambda page: "running" in status(page) and done(page) > 0)
        assert status(page).startswith(f"{approach}: running")
        table = page["text"]["dlscale-table"]
        assert table.count("fitting") == rows and "finished" not in table
        chosen, *options = page["text"]["dlscale-fit"].split("\n")
        assert chosen.startswith(f"{approach}, started") and chosen.endswith("running") and options == [chosen]
        losses = [s["smoothed"] for s in page["sources"] if "smoothed" in s]
        assert len(losses) == rows and any(v is not None for s in losses for v in s)
        assert errors(browser) == []

        # Dask's status page while the fit is held running; then the training page opened again
        browser.get(base + "/status")
        page = shown(browser, "Dask's status page", 4, lambda page: True)
        assert any(p["title"] == "Task Stream" for p in page["plots"]), page["plots"]
        assert errors(browser) == []
        browser.get(base + PAGE)
        page = shown(browser, "the fit still running", charts, lambda page: "running" in status(page))
        assert done(page) > 0 and page["text"]["dlscale-table"].count("fitting") == rows
        assert errors(browser) == []
    finally:
        gate.opened.set()
        fitting.join(120)
    assert not fitting.is_alive() and not failure, failure

    total = epochs * len(batches())
    page = shown(
        browser,
        "the fit finished",
        charts,
        lambda page: (
            "finished" in status(page)
            and all(pixels > 50 for pixels in lines(page).values())
            and any(p > 0 for p in phases(page))
        ),
    )
    assert status(page).startswith(f"{approach}: finished, {total:,} of {total:,} minibatches (100%)")
    table = page["text"]["dlscale-table"]
    assert table.count("finished") == rows and "fitting" not in table
    chosen, *options = page["text"]["dlscale-fit"].split("\n")
    assert chosen.endswith("finished") and options == [chosen]
    if not sharing:
        assert next(s["seconds"] for s in page["sources"] if "round" in s)  # round times from the second
    assert errors(browser) == []
    if SCREENSHOTS:  # a longer fit, not held, for docs/statistics.md
        SparkNet(context, network(), master).fit(context.parallelize(batches(1600), 4), epochs=SCREENSHOT_EPOCHS)
        total = SCREENSHOT_EPOCHS * len(batches(1600))
        shown(
            browser,
            "the fit of the screenshot finished",
            charts,
            lambda page: (
                f"finished, {total:,} of {total:,}" in status(page)
                and len(page["text"]["dlscale-fit"].split("\n")) == 3
            ),
        )
        screenshot(browser, Path(SCREENSHOTS) / f"training-page-{'sharing' if sharing else 'averaging'}.png")


def viewport(driver: Any, height: int) -> None:
    """Make the page's viewport ``WIDTH`` by ``height`` pixels, at one device pixel per CSS pixel."""
    metrics = {"width": WIDTH, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)


def screenshot(driver: Any, path: Path) -> None:
    """The whole page, ``WIDTH`` wide, as a PNG at ``path``: the window made as tall as the page, once
    every plot has been drawn again at its new size."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    viewport(driver, max(HEIGHT, height))
    sizes = """return [...Bokeh.index.all_views()].filter((v) => v.model.type == "Figure")
      .map((v) => [v.has_finished(), v.canvas_view.bbox.width, v.canvas_view.bbox.height])"""
    try:
        before, deadline = None, time.monotonic() + 10
        while (now := driver.execute_script(sizes)) != before or not all(f for f, _, _ in now):
            assert time.monotonic() < deadline, "the plots were not drawn again at the window's new size"
            before = now
            time.sleep(0.5)
        path.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(path))
    finally:
        viewport(driver, HEIGHT)
