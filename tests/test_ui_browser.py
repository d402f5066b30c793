"""The MLflow UI as the place to compare runs, checked in a real browser: Debian's Chromium driven by
Selenium through Debian's chromedriver, against ``mlflow server`` on the store of a real 2-job tiny sweep.

The runs table (opened by the link ``graft_exp.tracking.ui_link`` prints) lists both job runs by name
with their model runs nested and their data in the Dataset column; the chart view plots ``val/avg`` of
the model runs of both jobs. Screenshots of both views are saved under the test's tmp_path (the
docs/tracking.md's images come from them). Install the browser with ``apt-get install chromium chromium-driver``
(``.ci/run`` does, as root); without it these tests skip and say so.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import requests
from mlflow.tracking import MlflowClient

from graft_exp import tracking

pytestmark = [pytest.mark.service, pytest.mark.slow]
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
JOBS = {"graft": "tiny-graft-s0", "grpo_n8": "tiny-grpo_n8-s0"}
MODELS = ("tiny-char-llama", "tiny-bpe-gpt2")
# Short tiny jobs with three validation points (steps 2, 4, 6): enough for a curve, about a minute each.
SHORT = ["train.max_steps=6", "method.n=2", "train.batch_prompts=4", "train.minibatch_prompts=2", "eval.val_every=2",
         "eval.runs=1", "eval.samples=1", "eval.max_problems=4", "backend.progress=false", "train.save_every=6"]
# Chromium as root in a container: no sandbox, no GPU, nothing fetched from the network, a fresh profile.
CHROMIUM_FLAGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1600,900"]


def browser_missing() -> str | None:
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return f"{path} is absent: apt-get install {package} (as root; .ci/run does)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


if browser_missing():
    pytest.skip(browser_missing(), allow_module_level=True)

# Imported after the skip: selenium may be absent.
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from support.ports import free_port


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[str, str]:
    """(tracking URI, experiment id) of a real 2-job tiny sweep: GRAFT and GRPO n=8, seed 0."""
    root = tmp_path_factory.mktemp("ui-sweep")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "graft_exp", "-m", f"method={','.join(JOBS)}", f"tracking.uri={uri}",
         f"hydra.sweep.dir={root / 'multirun'}", f"checkpoint_root={root / 'checkpoints'}", *SHORT],
        capture_output=True, text=True, cwd=root, timeout=600, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    experiment = MlflowClient(uri).get_experiment_by_name("graft/default")
    assert tracking.ui_link(experiment.experiment_id) in done.stdout + done.stderr   # printed at the end
    return uri, experiment.experiment_id


@pytest.fixture(scope="module")
def server(store, tmp_path_factory) -> str:
    """``mlflow server`` (what ``mlflow ui`` starts) on its own port over the sweep's store."""
    uri, _ = store
    port = free_port()
    log = tmp_path_factory.mktemp("ui-server") / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
                                 "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="graft-chromium-")
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def page_text(driver) -> str:
    return driver.find_element(By.TAG_NAME, "body").text


def open_runs_table(driver, server: str, experiment_id: str) -> WebDriverWait:
    """Open the experiment by the link the launcher prints, close the assistant panel, expand the job
    runs (their model runs are nested under them)."""
    wait = WebDriverWait(driver, 90)
    driver.get(tracking.ui_link(experiment_id, server))
    wait.until(lambda d: all(name in page_text(d) for name in JOBS.values()))
    for close in driver.find_elements(By.CSS_SELECTOR, "[data-component-id='mlflow.assistant.chat_panel.close']"):
        close.click()
    for expand in driver.find_elements(By.CSS_SELECTOR, "button[data-component-id$='runnamecellrenderer.tsx_46']"):
        expand.click()
    wait.until(lambda d: all(f"{m}-{method}-s0" in page_text(d) for m in MODELS for method in JOBS))
    return wait


def test_runs_table_lists_job_runs_with_model_runs_nested(store, server, browser, tmp_path):
    uri, experiment_id = store
    open_runs_table(browser, server, experiment_id)
    assert "/runs?" in browser.current_url and "workflowType=machine_learning" in browser.current_url
    # Rows in display order: each job run, then its two model runs (ag-grid's row-index orders them).
    rows = {}
    for row in browser.find_elements(By.CSS_SELECTOR, "[role=row][row-index]"):
        for cell in row.find_elements(By.CSS_SELECTOR, "[col-id='attributes.`Run Name`']"):
            rows[int(row.get_attribute("row-index"))] = cell.text.split("\n")[-1]
    names = [rows[i] for i in sorted(rows)]
    runs = {r.info.run_name: r for r in MlflowClient(uri).search_runs([experiment_id])}
    assert len(names) == 6 and set(names) == set(runs), names
    for method, job in JOBS.items():
        position = names.index(job)
        children = names[position + 1:position + 3]
        assert sorted(children) == sorted(f"{m}-{method}-s0" for m in MODELS), names
        for child in children:
            assert runs[child].data.tags[tracking.PARENT_TAG] == runs[job].info.run_id
    assert "tiny_arith/train" in page_text(browser)        # the Dataset column
    assert "python -m graft_exp" in page_text(browser)     # the Source column
    browser.save_screenshot(str(tmp_path / "runs-table.png"))


def test_val_avg_is_charted_for_the_runs_of_both_jobs(store, server, browser, tmp_path):
    uri, experiment_id = store
    wait = open_runs_table(browser, server, experiment_id)
    browser.find_element(By.XPATH, "//input[@name='runs-view-mode' and @value='CHART']/ancestor::label").click()
    search = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "input[placeholder='Search metric charts']"))
    search.send_keys("val/avg")
    # Plotly keeps each chart's traces on its element: (run name, number of points) per trace.
    script = ("return Array.from(document.querySelectorAll('.js-plotly-plot'))"
              ".map(p => (p.data || []).map(t => [t.name, (t.x || []).length]))")

    def only_chart(driver):
        """The one chart left once the filter applies (until then the others are still drawn)."""
        charts = [c for c in driver.execute_script(script) if c]
        return charts[0] if len(charts) == 1 else None

    points = dict(wait.until(only_chart))
    client = MlflowClient(uri)
    runs = {r.info.run_name: r.info.run_id for r in client.search_runs([experiment_id])}
    for method in JOBS:
        for model in MODELS:
            name = f"{model}-{method}-s0"
            # Every validation point MLflow holds (before training, then steps 2, 4, 6) is plotted.
            assert points.get(name) == len(client.get_metric_history(runs[name], "val/avg")) >= 3, points
    assert "val/avg" in page_text(browser)
    time.sleep(1)   # let the chart finish drawing before the screenshot
    browser.save_screenshot(str(tmp_path / "val-avg-chart.png"))
