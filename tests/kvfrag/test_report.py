"""report.html (issue 17): what the page holds, `kvfrag report DIR`, and the page in a real
headless browser (Chromium through playwright: skipped when either is absent)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from kvfrag.cli import main
from kvfrag.outdir import MANIFEST

CHROMIUM = "/usr/bin/chromium"

SCENARIO = """\
name: tiny-report
model: llama-3-8b
kv_budget: 2GiB
max_model_len: 2048
workload:
  trace: {path: "sample:azure-conv"}
  transforms: {first_n: 60}
allocators:
  - {label: slab-max, kind: contiguous, reserve: max_model_len, placement: first-fit}
  - {label: paged-16, kind: paged, block_size: 16}
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report")
    (root / "s.yaml").write_text(SCENARIO)
    out = root / "tiny-report"
    assert main(["run", str(root / "s.yaml"), "-o", str(out), "-q", "-j", "1"]) == 0
    return out


def test_run_writes_the_report_with_everything(results):
    page = (results / "report.html").read_text(encoding="utf-8")
    # named after the scenario (the page is written in a staging folder: not after that)
    assert "<title>kvfrag report: tiny-report</title>" in page
    summary = pd.read_csv(results / "summary.csv").set_index("label")
    for label in ("slab-max", "paged-16"):  # the summary's numbers, as the table shows them
        assert f"{100 * summary.loc[label, 'token_states_frac']:.1f} %" in page
        assert f"{int(summary.loc[label, 'max_running']):,}" in page
    pngs = sorted((results / "plots").glob("*.png"))
    assert pngs
    # every figure inline but the address map, which links to its file (the interactive map
    # shows its slabs)
    assert page.count("<img ") == len(pngs) - 1
    assert "<a href='plots/address_map.png'>" in page and "alt='address_map'" not in page
    for png in pngs:
        assert f"plots/{png.name}" in page
    assert "id=\"map-0\"" in page or "id='map-0'" in page  # slab-max's address map
    assert "map-1" not in page  # paged: no map
    assert not re.search(r"<script[^>]+src=['\"]https?:", page)  # plotly.js inline: offline
    files = json.loads((results / MANIFEST).read_text())["files"]
    assert "report.html" in files


def test_report_command_rebuilds_it(results, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(results, copy)
    (copy / "report.html").unlink()
    assert main(["report", str(copy)]) == 0
    assert capsys.readouterr().out.strip() == str(copy / "report.html")
    assert "slab-max" in (copy / "report.html").read_text(encoding="utf-8")
    assert "report.html" in json.loads((copy / MANIFEST).read_text())["files"]
    assert not [p for p in copy.iterdir() if ".tmp-" in p.name]


def test_report_of_a_folder_that_is_not_results(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "not a results folder" in capsys.readouterr().err


def test_no_report_and_no_plots(tmp_path):
    (tmp_path / "s.yaml").write_text(SCENARIO)
    for flag in ("--no-report", "--no-plots"):
        out = tmp_path / flag.strip("-")
        assert main(["run", str(tmp_path / "s.yaml"), "-o", str(out), "-q", "-j", "1", flag]) == 0
        assert not (out / "report.html").exists()


def test_paged_only_says_there_is_no_map(tmp_path):
    (tmp_path / "s.yaml").write_text(SCENARIO.replace(
        "  - {label: slab-max, kind: contiguous, reserve: max_model_len, placement: first-fit}\n",
        ""))
    out = tmp_path / "paged"
    assert main(["run", str(tmp_path / "s.yaml"), "-o", str(out), "-q", "-j", "1"]) == 0
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "paged only" in page and "map-0" not in page


def test_map_caps_its_slabs(results):
    from kvfrag.report import address_maps

    req = pd.read_parquet(results / "requests.parquet")
    summary = pd.read_csv(results / "summary.csv")
    maps, _ = address_maps(req, summary, max_slabs=5)
    ((_, fig, slabs),) = maps
    assert "first 5 of" in fig.layout.title.text
    assert len(fig.data) == 5  # one trace per part, the outlines and the hover points
    assert len(slabs["X"][0]) == 5 and all(len(col) == 5 for col in slabs["H"])


def test_page_in_a_headless_browser(results):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    req = pd.read_parquet(results / "requests.parquet")
    req = req[(req["label"] == "slab-max") & req["admitted_s"].notna()]
    first = int(req.sort_values("admitted_s", kind="stable")["request_id"].iloc[0])
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto((results / "report.html").resolve().as_uri())
            page.locator("#map-0").scroll_into_view_if_needed()  # (drawn when in view)
            page.wait_for_selector("#map-0[data-drawn]", timeout=30_000)
            # The first hover point (of the first slab by admission), in page pixels.
            x, y = page.evaluate("""() => {
                const gd = document.getElementById('map-0');
                const hover = gd.calcdata[gd.calcdata.length - 1][0];
                const box = gd.querySelector('.nsewdrag').getBoundingClientRect();
                return [box.left + gd._fullLayout.xaxis.l2p(hover.x),
                        box.top + gd._fullLayout.yaxis.l2p(hover.y)];
            }""")
            page.mouse.move(x, y)
            label = page.wait_for_selector("#map-0 .hovertext", timeout=10_000)
            text = label.text_content() or ""
        finally:
            browser.close()
    assert f"request {first} " in text and "slab-max" in text, text
    assert not errors, errors
