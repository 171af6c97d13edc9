"""``yatt-graph report``: the page's data from a run folder (finished, in progress, crashed),
the command's errors, and the page itself in headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.cli import main
from runtime.train.report import report_data, write_report

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
STEPS, EVERY = 6, 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real run of a ready graph: 6 steps, the samples of every 2nd (3 files)."""
    out = tmp_path_factory.mktemp("report") / "run"
    cli = "import sys; from runtime.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", cli, "run", "text_grpo", "--steps", str(STEPS), "--out", str(out),
           "--samples-every", str(EVERY), "--set", "batch_size=4", "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def image_run(tmp_path_factory) -> Path:
    """A run of a graph with images: 2 steps of mm_grpo, 2 prompts x 4 samples kept each."""
    out = tmp_path_factory.mktemp("report") / "images"
    cli = "import sys; from runtime.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", cli, "run", "mm_grpo", "--steps", "2", "--out", str(out),
           "--samples-every", "1", "--set", "batch_size=2", "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


def _samples(run: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(run / "samples").to_pylist()


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("report.html", ".lock"))
    return to


@pytest.mark.timeout(120)
def test_a_finished_run_has_every_part_and_no_notes(run_dir):
    data = report_data(run_dir)
    assert data["notes"] == [] and data["status"].startswith("finished: 6 steps")
    assert data["metrics"]["steps"] == list(range(STEPS))
    assert [c["id"] for c in data["metrics"]["curves"]] == ["reward", "kl", "length", "throughput"]
    table = {t["name"]: t for t in data["nodes"]["table"]}
    assert {"rollout", "reward", "grpo"} <= set(table) and data["nodes"]["source"] == "trace.json"
    assert abs(sum(t["share"] for t in table.values()) - 1) < 1e-9
    assert [s["name"] for s in data["utilization"]["series"]] == ["controller 0"]
    graph = data["graph"]
    recorded = json.loads((run_dir / "graph.json").read_text())
    assert [n["name"] for n in graph["nodes"]] == [n["name"] for n in recorded["nodes"]]
    assert any(e["delay"] for e in graph["edges"])  # the weight sync
    rollout = next(n for n in graph["nodes"] if n["name"] == "rollout")
    assert rollout["mean_s"] == pytest.approx(table["rollout"]["mean_s"])
    assert len(data["samples"]["rows"]) == len(_samples(run_dir)) == 3 * 16
    settings = data["settings"]
    assert settings["graph"]["ref"] == "graphs.text_grpo" and settings["train"]["steps"] == STEPS
    assert settings["config"]["batch_size"] == 4 and settings["engine"]["placement"]


@pytest.mark.timeout(120)
def test_a_run_in_progress_or_crashed_becomes_notes_not_errors(run_dir, tmp_path):
    run = _copy(run_dir, tmp_path / "partial")
    (run / "summary.json").unlink()
    (run / "trace.json").unlink()
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "scores/me')  # a row being written
    newest = sorted((run / "samples").iterdir())[-1]
    newest.write_bytes(newest.read_bytes()[:100])  # a samples file cut short
    data = report_data(run)
    text = "\n".join(data["notes"])
    assert "no trace.json" in text and "cut short" in text and newest.name in text
    assert data["status"].startswith("stopped before its end")
    assert data["metrics"]["steps"] == list(range(STEPS))
    assert data["nodes"]["source"] == "metrics.jsonl" and data["nodes"]["table"]
    assert data["utilization"]["xlabel"] == "step" and data["utilization"]["series"]
    assert len(data["samples"]["rows"]) == 2 * 16
    # A trace cut in the middle of its event list keeps the events before the cut.
    trace = (run_dir / "trace.json").read_text()
    (run / "trace.json").write_text(trace[: len(trace) // 2])
    data = report_data(run)
    assert any("trace.json is cut short" in n for n in data["notes"])
    assert data["nodes"]["source"] == "trace.json"
    # A run that stopped before its first step, from before runs recorded graph and settings.
    for name in ("metrics.jsonl", "trace.json", "graph.json"):
        (run / name).unlink()
    shutil.rmtree(run / "samples")
    assert write_report(run).is_file()
    assert report_data(run)["graph"] is None


def test_a_run_without_graph_json_draws_its_traced_nodes_in_order(run_dir, tmp_path):
    run = _copy(run_dir, tmp_path / "old")
    (run / "graph.json").unlink()
    data = report_data(run)
    assert [n["name"] for n in data["graph"]["nodes"]][:2] == ["data", "rollout"]
    assert any("no graph.json" in n for n in data["notes"])


def test_bad_input_is_one_line_naming_what_and_how(run_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "file", "is a file"),
        (tmp_path / "empty", "is not a run folder"),
    ]
    for path, words in cases:
        assert main(["report", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "--out folder" in err and len(err.splitlines()) == 1
    assert main(["report", str(run_dir), "-o", str(tmp_path / "no" / "such" / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot write there" in err and len(err.splitlines()) == 1
    assert main(["report", str(run_dir), "-o", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_the_page_is_self_contained(run_dir, tmp_path):
    assert main(["report", str(run_dir), "-o", str(tmp_path / "r.html")]) == 0
    html = (tmp_path / "r.html").read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert (
        "https://" not in html and "<script src" not in html and '<link rel="stylesheet' not in html
    )
    assert html.count("</script>") == 2  # the data cannot close its element early


def _browser():
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(
            "needs Chromium and its driver: `apt-get install -y chromium chromium-driver` "
            "(Debian; .ci/run installs them)"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,2400", "--no-first-run", "--disable-extensions"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The system's driver: selenium's own manager would try to download one.
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def _column(driver, name: str) -> list[str]:
    return driver.execute_script(
        "const i = [...document.querySelectorAll('#sample-table thead th')]"
        ".findIndex(th => th.dataset.column === arguments[0]);"
        "return [...document.querySelectorAll('#sample-table tbody tr')]"
        ".map(tr => tr.children[i].textContent);",
        name,
    )


@pytest.mark.timeout(90)
def test_the_page_in_headless_chromium(run_dir, image_run, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    started = time.perf_counter()
    page = write_report(run_dir, tmp_path / "report.html")
    samples = _samples(run_dir)
    driver = _browser()
    try:
        driver.get(page.resolve().as_uri())
        rows = lambda: len(driver.find_elements(By.CSS_SELECTOR, "#sample-table tbody tr"))  # noqa: E731

        lines = driver.find_elements(By.CSS_SELECTOR, "#curves svg.chart path.line")
        assert len(lines) == 4
        for line in lines:
            assert int(line.get_attribute("data-points")) == STEPS and line.get_attribute("d")
        assert driver.find_elements(By.CSS_SELECTOR, "#node-chart path.line")
        assert driver.find_elements(By.CSS_SELECTOR, "#util-chart path.line")
        assert len(driver.find_elements(By.CSS_SELECTOR, "#graph-svg g.graph-node")) >= 5
        assert len(driver.find_elements(By.CSS_SELECTOR, "#node-table tbody tr")) >= 5
        assert rows() == len(samples) == 48

        Select(driver.find_element(By.ID, "f-step")).select_by_value("3")
        assert rows() == sum(s["step"] == 3 for s in samples) == 16
        driver.find_element(By.ID, "f-reward-min").send_keys("0.5")
        expected = sum(s["step"] == 3 and s["reward"] >= 0.5 for s in samples)
        assert rows() == expected
        assert driver.find_element(By.ID, "sample-count").get_attribute("data-count") == str(
            expected
        )
        driver.find_element(By.ID, "f-clear").click()
        assert rows() == len(samples)
        Select(driver.find_element(By.ID, "f-stop")).select_by_value("max_new_tokens")
        assert rows() == sum(s["stop_reason"] == "max_new_tokens" for s in samples)
        Select(driver.find_element(By.ID, "f-stop")).select_by_value("stop")
        assert rows() == sum(s["stop_reason"] == "stop" for s in samples)
        driver.find_element(By.ID, "f-clear").click()
        assert rows() == len(samples)

        header = driver.find_element(By.CSS_SELECTOR, "#sample-table th[data-column='reward']")
        header.click()  # highest first
        rewards = [float(x) for x in _column(driver, "reward")]
        assert rewards == sorted(rewards, reverse=True) and len(rewards) == len(samples)
        header.click()
        rewards = [float(x) for x in _column(driver, "reward")]
        assert rewards == sorted(rewards)

        Select(driver.find_element(By.ID, "bw-step")).select_by_value("5")
        best = driver.find_elements(By.CSS_SELECTOR, "#best-table tbody tr")
        worst = driver.find_elements(By.CSS_SELECTOR, "#worst-table tbody tr")
        assert len(best) == len(worst) == 5
        assert driver.find_elements(By.CSS_SELECTOR, "#settings-box table")

        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
        shot = Path(os.environ.get("YATT_REPORT_SCREENSHOT", tmp_path / "report.png"))
        driver.save_screenshot(str(shot))
        print(f"screenshot: {shot}")

        # A run with images: a thumbnail in each row, each image inline once.
        driver.get(write_report(image_run, tmp_path / "images.html").resolve().as_uri())
        pictures = _samples(image_run)
        assert rows() == len(pictures) == 16
        thumbs = driver.find_elements(By.CSS_SELECTOR, "#sample-table tbody td img")
        assert len(thumbs) == 16 and all(t.get_attribute("naturalWidth") == "32" for t in thumbs)
        html = (tmp_path / "images.html").read_text()
        assert html.count("data:image/png;base64,") == len({p["image"] for p in pictures})
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors

        # A crashed run's page: notes at the top, the parts it has, no script error.
        crashed = _copy(run_dir, tmp_path / "crashed")
        for name in ("trace.json", "summary.json", "graph.json"):
            (crashed / name).unlink()
        with (crashed / "metrics.jsonl").open("a") as f:
            f.write('{"step": 6, "scor')
        driver.get(write_report(crashed).resolve().as_uri())
        assert len(driver.find_elements(By.CSS_SELECTOR, "#notes li")) == 3
        assert len(driver.find_elements(By.CSS_SELECTOR, "#curves svg.chart path.line")) == 4
        assert rows() == len(samples)
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        driver.quit()
    assert time.perf_counter() - started < 30
