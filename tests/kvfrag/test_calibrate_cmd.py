"""`kvfrag calibrate`: a YAML block the engine takes, --json, and errors as one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from kvfrag.sim.engine_config import StepTime

from kvfrag.calibrate_cmd import _yaml_float
from kvfrag.cli import main
from kvfrag.results import SCHEMA_VERSION


def write_iterations(path: Path, n: int = 120, noise: float = 0.02) -> Path:
    """Iterations timed by 0.01 s + 1e-4 s/batched token + 5e-8 s/KV token, with noise."""
    rng = np.random.default_rng(7)
    batch = rng.integers(1, 64, n)
    prefill = np.where(rng.random(n) < 0.25, rng.integers(32, 2048, n), 0)
    kv = rng.integers(batch * 100, batch * 4000)
    seconds = (0.01 + 1e-4 * (prefill + batch) + 5e-8 * kv) * (1 + rng.normal(0, noise, n))
    pd.DataFrame({"batch_size": batch, "prefill_tokens": prefill, "decode_tokens": batch,
                  "kv_tokens_read": kv, "seconds": seconds}).to_csv(path, index=False)
    return path


def test_prints_a_step_time_block_the_engine_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_iterations(tmp_path / "iterations.csv")
    assert main(["calibrate", str(path)]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith(f"# fitted to {path}: 120 iterations; |error| median ")
    assert "5-fold held out: median " in first
    block = yaml.safe_load(out)["engine"]["step_time"]
    assert list(block) == ["base_s", "per_batched_token_s", "per_kv_token_s"]
    assert all(isinstance(v, float) for v in block.values())  # 5e-08 would be a string
    StepTime(**block)
    assert block == pytest.approx(
        {"base_s": 0.01, "per_batched_token_s": 1e-4, "per_kv_token_s": 5e-8}, rel=0.1
    )


def test_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_iterations(tmp_path / "iterations.csv", n=8, noise=0.0)
    assert main(["calibrate", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert next(iter(data)) == "schema_version" and data["schema_version"] == SCHEMA_VERSION
    assert data["file"] == str(path) and data["iterations"] == 8
    assert data["step_time"] == pytest.approx(
        {"base_s": 0.01, "per_batched_token_s": 1e-4, "per_kv_token_s": 5e-8}, rel=1e-6
    )
    assert set(data["relative_error"]) == {"median", "p90", "max"}
    assert data["relative_error"]["max"] < 1e-9
    assert data["held_out_relative_error"] is None  # fewer than 10 rows
    assert 1 <= data["batch_size"]["min"] <= data["batch_size"]["mean"] <= 63


@pytest.mark.parametrize(("content", "message"), [
    ("batch_size,seconds\n1,0.1\n", "missing column(s) prefill_tokens, decode_tokens"),
    ("batch_size,prefill_tokens,decode_tokens,kv_tokens_read,seconds\n"
     "1,0,1,10,0.01\n2,0,2,x,0.02\n3,0,3,30,0.03\n",
     "data row 2, column kv_tokens_read: 'x' is not a finite number"),
])
def test_bad_file_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    assert main(["calibrate", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"kvfrag: error: {path}: ") and message in captured.err
    assert captured.err.count("\n") == 1


def test_missing_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", str(tmp_path / "nope.csv")]) == 2
    err = capsys.readouterr().err
    assert err == f"kvfrag: error: {tmp_path / 'nope.csv'}: no such file\n"


@pytest.mark.parametrize(("value", "text"), [
    (0.0123456, "0.01235"), (9.87e-05, "9.87e-05"), (5e-08, "5.0e-08"), (0.0, "0.0"),
    (2.0, "2.0"),
])
def test_yaml_numbers_read_back_as_floats(value: float, text: str) -> None:
    assert _yaml_float(value) == text
    assert yaml.safe_load(text) == pytest.approx(value, rel=1e-3)
