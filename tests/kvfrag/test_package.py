"""One import name, shipped scenarios by name, and a wheel that installs only `kvfrag`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvfrag.cli import main
from kvfrag.config import load_scenario, shipped_scenarios

ROOT = Path(__file__).resolve().parents[2]


def test_every_shipped_scenario_is_listed_with_its_description(capsys):
    found = shipped_scenarios()
    assert set(found) == {p.stem for p in (ROOT / "scenarios").glob("*.yaml")}
    assert main(["scenarios"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(found)
    quick = next(line for line in out if line.startswith("quickstart "))
    assert "paged" in quick  # its description


def test_a_shipped_scenario_runs_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file called quickstart here
    loaded = load_scenario("quickstart")
    assert loaded.path == ROOT / "scenarios" / "quickstart.yaml"
    rc = main(["run", "validate-tiny", "-o", str(tmp_path / "r"), "-q", "--no-plots",
               "--set", "workload.transforms.first_n=20", "-j", "1"])
    assert rc == 0 and (tmp_path / "r" / "summary.csv").is_file()


def test_a_local_file_of_that_name_wins_and_unknown_names_list_the_shipped(tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart").write_text((ROOT / "scenarios" / "validate-tiny.yaml").read_text())
    assert load_scenario("quickstart").path == Path("quickstart")
    assert main(["run", "no-such-scenario", "-q"]) == 2
    err = capsys.readouterr().err
    assert "no shipped scenario of that name" in err and "quickstart" in err


def test_the_wheel_installs_one_top_level_package(tmp_path):
    """No top-level `sim`, `validate` or `workloads` to clash with other packages (configobj
    ships a top-level `validate`); the scenarios travel as package data."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True,
    )
    if out.returncode:
        pytest.skip(f"cannot build a wheel here: {out.stderr.strip()[-200:]}")
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"kvfrag", wheel.name.split("-")[0] + "-"
                                               + wheel.name.split("-")[1] + ".dist-info"}
    assert "kvfrag/scenarios/quickstart.yaml" in names
    assert "kvfrag/sim/engine.py" in names and "kvfrag/workloads/samples/azure-conv.csv" in names
