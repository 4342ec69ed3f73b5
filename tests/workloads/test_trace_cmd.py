"""`kvfrag trace stats`: the table, the PNG, and errors as one line with exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfrag.cli import main


def test_stats_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "stats", "sample:azure-conv"]) == 0
    out = capsys.readouterr().out
    assert "rows              2,000" in out
    assert "time span         424.3 s" in out
    assert "mean rate         4.71 req/s" in out
    assert "inter-arrival CV  1.14" in out
    prompt = next(line for line in out.splitlines() if line.startswith("prompt"))
    assert prompt.split() == ["prompt", "1104.8", "1032", "1989.7", "4100", "7930"]


def test_stats_length_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "stats", "sample:sharegpt-8k", "--format", "sarathi"]) == 0
    out = capsys.readouterr().out
    assert "time span         n/a" in out and "2272.3" in out


def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plots" / "trace.png"
    assert main(["trace", "stats", "sample:mooncake-conv", "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    assert [p.name for p in out.parent.iterdir()] == ["trace.png"]
    assert main(["trace", "stats", "sample:sharegpt-8k", "--plot", str(out)]) == 0
    assert "plot written" in capsys.readouterr().out


def test_column_mapping(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.csv"
    path.write_text("t,a,b\n0,10,1\n2,30,3\n")
    argv = ["trace", "stats", str(path), "--column", "arrival=t", "--column",
            "prompt_tokens=a", "--column", "output_tokens=b", "--time-unit", "s"]
    assert main(argv) == 0
    assert "time span         2.0 s" in capsys.readouterr().out


@pytest.mark.parametrize(("content", "extra", "message"), [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,abc,3\n", [],
     "row 1 (line 2), column ContextTokens: 'abc' is not a number"),
    ("a,b\n1,2\n", [], "cannot tell the trace layout"),
    ("a,b\n1,2\n", ["--column", "prompt_tokens"], "expected FIELD=COLUMN"),
])
def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str,
                             extra: list[str], message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    assert main(["trace", "stats", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfrag: error: ") and message in err
    assert err.count("\n") == 1


def test_drop_bad_rows_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n5,x\n6,7\n")
    assert main(["trace", "stats", str(path), "--drop-bad-rows"]) == 0
    assert "dropped rows      1" in capsys.readouterr().out


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "stats", "no/such/file.csv"]) == 2
    assert "no such trace file" in capsys.readouterr().err


def test_stats_ideal_prefix_reuse(capsys: pytest.CaptureFixture[str]) -> None:
    """The most a prefix cache can reuse of the shipped Mooncake sample (no trace without
    hash ids prints it)."""
    assert main(["trace", "stats", "sample:mooncake-conv"]) == 0
    out = capsys.readouterr().out
    assert "prefix reuse      21.2 % of blocks, 21.6 % of prompt tokens at most" in out
    assert main(["trace", "stats", "sample:azure-conv"]) == 0
    assert "prefix reuse" not in capsys.readouterr().out


def test_ideal_prefix_reuse_by_hand() -> None:
    import pandas as pd
    from kvfrag.workloads import Workload
    from kvfrag.workloads.stats import ideal_prefix_reuse

    df = pd.DataFrame({
        "request_id": [0, 1, 2],
        "arrival_s": [0.0, 1.0, 2.0],
        "prompt_tokens": [20, 20, 10],
        "output_tokens": [1, 1, 1],
        "hash_ids": [[1, 2], [1, 2], [1, 3]],  # blocks of 10 tokens
    })
    df.attrs["hash_block_tokens"] = 10
    # Request 1 finds both of its blocks (20 tokens), request 2 its first (10 of 10 tokens).
    assert ideal_prefix_reuse(Workload(df, "t")) == (3 / 6, 30 / 50)


def test_plot_replaces_only_its_own_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--plot writes over a PNG it wrote (its Software text says so), and nothing else."""
    ours = tmp_path / "ours.png"
    assert main(["trace", "stats", "sample:azure-conv", "--plot", str(ours)]) == 0
    assert main(["trace", "stats", "sample:azure-code", "--plot", str(ours)]) == 0
    theirs = tmp_path / "theirs.png"
    theirs.write_bytes(b"\x89PNG\r\n\x1a\n not ours")
    folder = tmp_path / "folder.png"
    folder.mkdir()
    capsys.readouterr()
    for target in (theirs, folder):
        assert main(["trace", "stats", "sample:azure-conv", "--plot", str(target)]) == 2
        err = capsys.readouterr().err
        assert str(target) in err and err.count("\n") == 1
    assert theirs.read_bytes() == b"\x89PNG\r\n\x1a\n not ours" and folder.is_dir()
    (tmp_path / "afile").write_text("x")
    assert main(["trace", "stats", "sample:azure-conv", "--plot",
                 str(tmp_path / "afile" / "p.png")]) == 3  # cannot write under a file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "folder.png", "ours.png",
                                                           "theirs.png"]
