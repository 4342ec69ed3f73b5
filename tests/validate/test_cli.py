"""`kvfrag validate` end to end on CPU: the report, the exit codes, the refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("torch")

from kvfrag.cli import main
from kvfrag.results import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "scenarios" / "validate-tiny.yaml")
SMALL = ["--set", "kv_budget=4MiB", "--set", "workload.transforms.first_n=40"]


def test_cli_writes_report_and_passes(tmp_path, capsys):
    out = tmp_path / "report"
    rc = main(["validate", TINY, "--device", "cpu", *SMALL, "--checkpoints", "8", "-o", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    for name in ("validate.csv", "validate.json", "validate.png", "series.parquet"):
        assert (out / name).stat().st_size > 0
    df = pd.read_csv(out / "validate.csv")
    replayed = df[df["mode"].isin(["arena", "paged"])]
    assert set(replayed["kind"]) == {"contiguous", "buddy", "paged"}
    assert (replayed["status"] == "pass").all()
    assert (replayed["checks"] > 0).all()
    assert (replayed["token_states_bytes_abs_err"] == 0).all()
    assert (replayed["token_states_bytes_tol"] == 0).all()
    assert set(df.loc[df["kind"] == "torch-caching", "status"]) <= {"skip"}
    doc = json.loads((out / "validate.json").read_text())
    assert list(doc) == ["schema_version", "scenario", "rows"]
    assert doc["schema_version"] == SCHEMA_VERSION and doc["scenario"] == "validate-tiny"
    assert doc["rows"][0]["label"] == df["label"][0]
    assert list(doc["rows"][0]) == list(df.columns)
    assert "paged-16" in printed and "pass" in printed
    assert not list(tmp_path.glob(".report.tmp-*"))


def test_cli_cuda_without_cuda_is_a_clear_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    rc = main(["validate", TINY, "--device", "cuda", "-o", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "CUDA is not available" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_cli_refuses_budget_over_cap(tmp_path, capsys):
    rc = main(["validate", TINY, "--cap", "8MiB", "-o", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "over the cap" in err and "--set kv_budget=" in err
    assert len(err.strip().splitlines()) == 1


def test_cli_torch_mode_needs_cuda(tmp_path, capsys):
    rc = main(["validate", TINY, "--mode", "torch", "--device", "cpu", "-o", str(tmp_path / "x")])
    assert rc == 2
    assert "--mode torch needs --device cuda" in capsys.readouterr().err


def test_cli_fails_on_mismatch(tmp_path, capsys, monkeypatch):
    import kvfrag.validate.replay as replay

    real = replay.MemoryReplay.count

    def off_by_one(self):
        tokens, held, free = real(self)
        return tokens + 1, held - 1, free

    monkeypatch.setattr(replay.MemoryReplay, "count", off_by_one)
    out = tmp_path / "r"
    rc = main(["validate", TINY, *SMALL, "--mode", "paged", "--checkpoints", "5", "-o", str(out)])
    assert rc == 1
    df = pd.read_csv(out / "validate.csv")
    assert list(df["status"]) == ["fail"]
    assert df["token_states_bytes_abs_err"][0] == 1
    assert "fail" in capsys.readouterr().out


def test_help_does_not_import_torch():
    code = (
        "import sys, contextlib, io\n"
        "from kvfrag.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['validate', '--help'])\n"
        "print('torch' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_skipped_replays_are_counted_as_skipped_not_ok():
    from kvfrag.validate.outcome import Outcome
    from kvfrag.validate.report import format_table, tally

    outcomes = [Outcome("a", "paged", "paged", "cpu", 1), Outcome("b", "paged", "arena", "cpu", 1),
                Outcome("c", "torch-caching", "torch", "cpu", 1, status="skip", note="cuda only"),
                Outcome("d", "paged", "paged", "cpu", 1, status="fail")]
    assert tally(outcomes) == (2, 1, 1)
    assert format_table(outcomes).splitlines()[-1] == "2 of 4 ok, 1 skipped, 1 failed"
    assert format_table(outcomes[:2]).splitlines()[-1] == "2 of 2 ok"


def test_threads_default_to_one_on_cpu(monkeypatch):
    torch = pytest.importorskip("torch")
    from kvfrag.validate import suite

    seen: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    suite.set_threads("cpu", None)
    suite.set_threads("cpu", 3)
    suite.set_threads("cuda", None)  # left as it is
    suite.set_threads("cuda", 2)
    assert seen == [1, 3, 2]
    with pytest.raises(ValueError, match="--threads must be 1 or more, not 0"):
        suite.set_threads("cpu", 0)
