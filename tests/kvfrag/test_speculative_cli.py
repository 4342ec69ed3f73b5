"""`kvfrag run` with `engine.speculative`: bad input (in the scenario, or in the request table
it needs) is one line, exit 2, nothing written; a small speculative scenario runs end to end."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

SCENARIO = """\
name: spec
model: llama-3-8b
kv_budget: 1GiB
max_model_len: 2048
workload:
  synthetic:
    count: 30
    prompt: {kind: uniform, low: 10, high: 200}
    output: {kind: uniform, low: 20, high: 100}
allocators:
  - {label: paged-16, kind: paged, block_size: 16}
engine:
  step_time: {base_s: 0.02}
  speculative: {method: eagle, num_tokens: 3, acceptance: 0.7}
"""
TRACE_SCENARIO = SCENARIO.replace("""  synthetic:
    count: 30
    prompt: {kind: uniform, low: 10, high: 200}
    output: {kind: uniform, low: 20, high: 100}
""", "  trace: {path: t.csv}\n")
TRACE = "arrival_s,prompt_tokens,output_tokens,n,accepted_drafts\n"


def run(capsys, tmp_path: Path, text: str, sets: list[str] | None = None,
        trace: str | None = None, name: str = "out") -> tuple[int, str, Path]:
    from kvfrag.cli import main

    path = tmp_path / "s.yaml"
    path.write_text(text)
    if trace is not None:
        (tmp_path / "t.csv").write_text(trace)
    out = tmp_path / name
    argv = ["run", str(path), "-o", str(out), "-q", "--no-plots", "-j", "1"]
    for item in sets or []:
        argv += ["--set", item]
    code = main(argv)
    return code, capsys.readouterr().err, out


@pytest.mark.parametrize(("text", "sets", "trace", "expected"), [
    (SCENARIO.replace("acceptance: 0.7", "acceptance: 1.5"), [], None,
     r"s\.yaml:14: engine\.speculative\.acceptance: must be a rate from 0 to 1"),
    (SCENARIO, ["engine.speculative.method=mtp3"], None,
     r"engine\.speculative\.method: 'mtp3' is not a method"),
    (SCENARIO, ["allocators.paged-16.kind=prefix-caching"], None,
     r"allocators\[0\]: allocator 'paged-16': prefix caching with engine\.speculative"),
    (SCENARIO, ["engine.speculative.acceptance=column"], None,
     r"--set 'engine\.speculative\.acceptance=column': engine\.speculative\.acceptance: column "
     r"reads the request table's accepted_drafts, which a synthetic workload has none of"),
    (TRACE_SCENARIO, ["engine.speculative.acceptance=column"],
     "arrival_s,prompt_tokens,output_tokens\n0,10,5\n",
     r"t\.csv: engine\.speculative\.acceptance is column, but the request table has no "
     r"accepted_drafts column"),
    (TRACE_SCENARIO, ["engine.speculative.acceptance=column"],
     TRACE + '0,10,5,1,"[1, 2]"\n1,10,5,2,"[0]"\n',
     r"t\.csv: row 2, column n: 2: speculative decoding with sample groups or beams"),
    (TRACE_SCENARIO, ["engine.speculative.acceptance=column"],
     TRACE + '0,10,5,1,"[1, 2]"\n1,10,5,1,"[0, x]"\n',
     r"t\.csv: row 2 \(line 3\), column accepted_drafts: '\[0, x\]' is not a non-empty list"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(capsys, tmp_path, text, sets, trace,
                                                      expected):
    import re

    code, err, out = run(capsys, tmp_path, text, sets, trace)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("kvfrag: error: "), lines[0]
    assert re.search(expected, lines[0]), lines[0]
    assert not out.exists()


def test_a_speculative_scenario_runs_end_to_end(capsys, tmp_path):
    """Every request completes; the pool holds the EAGLE layer (33 layers' bytes per token);
    accepting every draft (4 tokens a decode step) takes far fewer flat 20 ms iterations than
    accepting none (1 token a step)."""
    times = {}
    for rate in (0.0, 1.0):
        code, err, out = run(capsys, tmp_path, SCENARIO, [f"engine.speculative.acceptance={rate}"],
                             name=f"out-{rate:g}")
        assert code == 0, err
        (row,) = pd.read_csv(out / "summary.csv").to_dict("records")
        assert row["completed"] == row["requests"] == 30
        assert row["bytes_per_token"] == 33 * 8 * 128 * 2 * 2
        times[rate] = row["sim_time_s"]
    assert times[1.0] < 0.5 * times[0.0], times


def test_a_trace_with_accepted_drafts_runs(capsys, tmp_path):
    rows = "".join(f'{i * 0.01},{20 + i},{10 + i},1,"[{i % 4}, 3]"\n' for i in range(8))
    code, err, out = run(capsys, tmp_path, TRACE_SCENARIO, ["engine.speculative.acceptance=column"],
                         TRACE + rows)
    assert code == 0, err
    (row,) = pd.read_csv(out / "summary.csv").to_dict("records")
    assert row["completed"] == 8
