"""How big each shipped scenario's report.html is and how soon it opens in a browser.

Runs every scenario of scenarios/ (or those named), then opens each page in headless Chromium
(playwright, the system's /usr/bin/chromium, a 1400 x 900 window) and prints a row each: the
page's size, the time from opening it to its `load` event, and to its first address map drawn
once scrolled to (plotly.js unpacked and started, the map's traces built and drawn).

    python bench/report.py [--chromium /usr/bin/chromium] [NAME ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvfrag.cli import main as kvfrag

ROOT = Path(__file__).resolve().parent.parent


def timed(page, path: Path) -> tuple[float, float | None]:
    """(seconds to the `load` event, seconds to the first map drawn; None: no map)."""
    start = time.perf_counter()
    page.goto(path.resolve().as_uri(), wait_until="load", timeout=120_000)
    load = time.perf_counter() - start
    if page.query_selector("#map-0") is None:
        return load, None
    page.locator("#map-0").scroll_into_view_if_needed()
    page.wait_for_selector("#map-0[data-drawn]", timeout=120_000)
    return load, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="scenarios (default: all of scenarios/)")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    files = sorted((ROOT / "scenarios").glob("*.yaml"))
    if args.names:
        files = [f for f in files if f.stem in args.names]
    print("| scenario | report.html (MiB) | to `load` (s) | first map drawn (s) |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        for scenario in files:
            out = Path(tmp) / scenario.stem
            if kvfrag(["run", str(scenario), "-o", str(out), "-q"]) not in (0, 1):
                print(f"| {scenario.stem} | run failed | | |", flush=True)
                continue
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            load, drawn = timed(page, out / "report.html")
            page.close()
            size = (out / "report.html").stat().st_size / 2**20
            shown = "no map" if drawn is None else f"{drawn:.2f}"
            print(f"| {scenario.stem} | {size:.2f} | {load:.2f} | {shown} |", flush=True)
        browser.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
