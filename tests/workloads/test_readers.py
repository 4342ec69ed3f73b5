"""Readers on the shipped samples, on the full traces in ../shared (when present), and on
generic layouts (column mappings, Parquet, gzip)."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kvfrag.workloads import load_trace, samples, trace_stats, validate_requests
from kvfrag.workloads.table import WorkloadError

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/traces is absent")

# name -> rows, prompt mean, output mean, span (s) or None; from workloads/samples/SOURCE.md
SAMPLES = {
    "azure-conv": (2000, 1104.8, 264.9, 424.26),
    "azure-code": (2000, 1986.6, 29.5, 853.08),
    "mooncake-conv": (1000, 13732.9, 349.4, 330.0),
    "sharegpt-8k": (2000, 2272.3, 463.7, None),
}

# file -> rows, prompt (mean, p50, p90, p99, max), output (...), span, rate, CV; from SOURCE.md
FULL = {
    "azure-llm-2023-conv/AzureLLMInferenceTrace_conv.csv": (
        19366, (1154.7, 1020, 2734, 4142, 14050), (211.1, 129, 424, 601, 1000),
        3501.7, 5.53, 1.09),
    "azure-llm-2023-code/AzureLLMInferenceTrace_code.csv": (
        8819, (2047.8, 1469, 5188, 7436, 7437), (27.9, 13, 55, 251, 1899),
        3435.9, 2.57, 13.15),
    "mooncake-fast25-conversation/conversation_trace.jsonl": (
        12031, (12035.1, 6909, 27367, 85400, 126195), (342.6, 350, 597, 1119, 2000),
        3537.0, 3.40, 3.03),
    "sarathi-sharegpt-8k/sharegpt_8k_filtered_stats_llama2_tokenizer.csv": (
        30731, (2340.0, 1730, 5696, 7434, 8141), (438.7, 415, 834, 998, 1024),
        None, None, None),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_shipped_sample(name: str) -> None:
    rows, prompt_mean, output_mean, span = SAMPLES[name]
    workload = load_trace(f"sample:{name}")
    df = workload.requests
    assert len(df) == rows
    assert round(df["prompt_tokens"].mean(), 1) == prompt_mean
    assert round(df["output_tokens"].mean(), 1) == output_mean
    assert df["request_id"].tolist() == list(range(rows))
    assert df["arrival_s"].iloc[0] == 0.0
    if span is None:
        assert not workload.has_arrivals and workload.notes
    else:
        assert workload.has_arrivals
        assert df["arrival_s"].iloc[-1] == pytest.approx(span, abs=0.01)
    assert workload.dropped_rows == 0
    validate_requests(df, name)


def test_mooncake_sample_hashes() -> None:
    df = load_trace(samples.path("mooncake-conv")).requests
    assert list(df.columns) == [
        "request_id", "arrival_s", "prompt_tokens", "output_tokens", "hash_ids"]
    assert df.attrs["hash_block_tokens"] == 512
    assert sum(len(h) for h in df["hash_ids"]) == 27305
    assert df["hash_ids"].iloc[0] == list(range(14))
    assert all(len(h) == math.ceil(p / 512)
               for h, p in zip(df["hash_ids"], df["prompt_tokens"], strict=True))


@pytest.mark.parametrize(("name", "fmt"), [
    ("azure-conv", "azure"), ("mooncake-conv", "mooncake"), ("sharegpt-8k", "sarathi")])
def test_named_format_matches_auto(name: str, fmt: str) -> None:
    auto = load_trace(f"sample:{name}").requests
    named = load_trace(samples.path(name), format=fmt).requests
    pd.testing.assert_frame_equal(auto, named)


def test_sample_source_notes_ship() -> None:
    text = (samples.path("azure-conv").parent / "SOURCE.md").read_text()
    for needle in ("CC BY 4.0", "Apache License", "first", "Splitwise", "Mooncake"):
        assert needle in text
    with pytest.raises(ValueError, match="unknown sample"):
        samples.path("nope")


@pytest.mark.slow
@needs_shared
@pytest.mark.parametrize("relpath", sorted(FULL))
def test_full_trace_matches_source_md(relpath: str) -> None:
    rows, prompt, output, span, rate, cv = FULL[relpath]
    stats = trace_stats(load_trace(SHARED / relpath))
    assert stats.rows == rows
    for got, want in ((stats.prompt, prompt), (stats.output, output)):
        assert round(got.mean, 1) == want[0]
        assert (round(got.p50), round(got.p90), round(got.p99), got.max) == want[1:]
    if span is None:
        assert stats.span_s is None
    else:
        assert round(stats.span_s, 1) == span
        assert round(stats.mean_rate, 2) == rate
        assert round(stats.interarrival_cv, 2) == cv


@pytest.mark.slow
@needs_shared
def test_full_mooncake_prefix_structure() -> None:
    df = load_trace(SHARED / "mooncake-fast25-conversation/conversation_trace.jsonl").requests
    lengths = df["hash_ids"].map(len)
    assert lengths.sum() == 288_500
    assert len({x for h in df["hash_ids"] for x in h}) == 182_790
    assert (lengths == np.ceil(df["prompt_tokens"] / 512)).all()
    # SOURCE.md: ideal reuse with an infinite cache, 36.6 % of blocks, 37.4 % of input tokens.
    blocks, tokens = trace_stats(load_trace(
        SHARED / "mooncake-fast25-conversation/conversation_trace.jsonl")).prefix_reuse
    assert (round(100 * blocks, 1), round(100 * tokens, 1)) == (36.6, 37.4)


@pytest.mark.slow
@needs_shared
@pytest.mark.parametrize(("name", "relpath"), [
    ("azure-conv", "azure-llm-2023-conv/AzureLLMInferenceTrace_conv.csv"),
    ("azure-code", "azure-llm-2023-code/AzureLLMInferenceTrace_code.csv"),
    ("mooncake-conv", "mooncake-fast25-conversation/conversation_trace.jsonl"),
    ("sharegpt-8k", "sarathi-sharegpt-8k/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"),
])
def test_samples_are_byte_identical_prefixes(name: str, relpath: str) -> None:
    sample = samples.path(name).read_bytes()
    assert (SHARED / relpath).read_bytes().startswith(sample)


def test_generic_csv_with_mapping_and_units(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("t_ms,in,out,limit,samples\n1000,10,5,8,2\n1500,20,6,6,1\n3000,30,7,7,4\n")
    workload = load_trace(
        path, columns={"arrival": "t_ms", "prompt_tokens": "in", "output_tokens": "out",
                       "max_tokens": "limit", "n": "samples"},
        time_unit="ms")
    df = workload.requests
    assert list(df.columns) == [
        "request_id", "arrival_s", "prompt_tokens", "output_tokens", "max_tokens", "n"]
    assert df["arrival_s"].tolist() == [0.0, 0.5, 2.0]
    assert df["max_tokens"].tolist() == [8, 6, 7]
    assert df["n"].tolist() == [2, 1, 4]
    assert df["prompt_tokens"].dtype == np.int64


def test_generic_datetime_and_seconds(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("when,p,o\n2024-01-01T00:00:00Z,1,1\n2024-01-01T00:00:01.5Z,2,2\n")
    mapping = {"arrival": "when", "prompt_tokens": "p", "output_tokens": "o"}
    df = load_trace(path, columns=mapping, time_unit="datetime").requests
    assert df["arrival_s"].tolist() == [0.0, 1.5]
    with pytest.raises(WorkloadError, match="needs a time unit"):
        load_trace(path, columns=mapping)


def test_parquet_with_hashes_and_kvfrag_layout(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    table = pa.table({
        "arrival_s": [0.0, 0.25, 1.0],
        "prompt_tokens": [3, 20, 17],
        "output_tokens": [1, 2, 3],
        "hash_ids": [[0], [0, 1], [0, 2]],
    })
    pq.write_table(table, path)
    workload = load_trace(path, hash_block_tokens=16)
    df = workload.requests
    assert df["hash_ids"].tolist() == [[0], [0, 1], [0, 2]]
    assert df.attrs["hash_block_tokens"] == 16
    assert df["arrival_s"].tolist() == [0.0, 0.25, 1.0]
    with pytest.raises(WorkloadError, match="hash_block_tokens"):
        load_trace(path)


def test_gzip_jsonl_with_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    lines = samples.path("mooncake-conv").read_text().splitlines()[:50]
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")
    df = load_trace(path).requests
    expected = load_trace("sample:mooncake-conv").requests.iloc[:50]
    pd.testing.assert_frame_equal(df, expected, check_like=False)


def test_relative_path_resolves_against_base_dir(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "t.csv").write_text("num_prefill_tokens,num_decode_tokens\n4,5\n")
    df = load_trace("sub/t.csv", base_dir=tmp_path).requests
    assert df["prompt_tokens"].tolist() == [4]
