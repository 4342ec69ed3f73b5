"""`kvfrag plan`'s search on toy answers (no simulator): brackets, bisection, verdicts, goodput."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvfrag.plan_search import (
    ABOVE,
    FAILED,
    FOUND,
    MAX_STEPS,
    NEVER,
    Search,
    Target,
    goodput,
    judge,
    parse_duration,
    parse_precision,
    per_request_limits,
    run_searches,
)


def drive(searches, met):
    """Run `searches` with `met(search id, value)` as the probe; the asks of every round."""
    asked = []

    def probe(asks):
        asked.append(list(asks))
        return {(sid, v): met(sid, v) for sid, v in asks}

    rounds = run_searches(searches, probe)
    assert rounds == len(asked)
    return asked


@pytest.mark.parametrize("threshold", [0.013, 0.7, 1.0, 3.3, 1000.0])
@pytest.mark.parametrize("precision", [0.02, 0.1])
def test_bisection_finds_a_monotone_threshold(threshold, precision):
    search = Search(1.0, precision)
    drive({0: search}, lambda sid, v: v <= threshold)
    assert search.status == FOUND
    answer = search.answer
    assert answer is not None and answer <= threshold < search.hi
    assert search.hi <= answer * (1 + precision)
    # every probe at or below the answer met, every probe above it failed
    assert all(met == (v <= answer) for v, met in search.probes.items())


def test_searches_run_together_one_probe_each_per_round():
    thresholds = {"a": 2.5, "b": 0.3, "c": 40.0}
    searches = {k: Search(1.0, 0.02) for k in thresholds}
    asked = drive(searches, lambda sid, v: v <= thresholds[sid])
    for round_ in asked:
        ids = [sid for sid, _ in round_]
        assert len(ids) == len(set(ids))  # at most one probe per search per round
    assert len(asked) == max(len(s.probes) for s in searches.values())
    for key, s in searches.items():
        assert s.answer <= thresholds[key] < s.hi


def test_non_monotone_answer_is_below_the_first_failure():
    # holds up to 3, fails in (3, 5), holds again in [5, 6]: the answer is the first edge
    search = Search(1.0, 0.02)
    drive({0: search}, lambda sid, v: v <= 3 or 5 <= v <= 6)
    assert search.status == FOUND
    assert 3 / 1.02 <= search.answer <= 3
    assert all(met for v, met in search.probes.items() if v <= search.answer)


def test_same_probes_every_time():
    def once():
        s = Search(2.0, 0.02)
        drive({0: s}, lambda sid, v: v <= 7.77)
        return list(s.probes.items())

    assert once() == once()


def test_never_met_halves_to_the_floor():
    search = Search(1.0, 0.02)
    drive({0: search}, lambda sid, v: False)
    assert search.status == NEVER and search.answer is None
    assert len(search.probes) == MAX_STEPS + 1
    assert min(search.probes) == pytest.approx(2.0**-MAX_STEPS)


def test_always_met_stops_at_the_highest_value():
    search = Search(1.0, 0.02, highest=100.0)
    drive({0: search}, lambda sid, v: True)
    assert search.status == ABOVE
    assert search.answer == 64.0  # doubling from 1: 128 would pass the bound
    assert max(search.probes) == 64.0


def test_a_failed_run_stops_only_its_search():
    a, b = Search(1.0, 0.02), Search(1.0, 0.02)

    def probe(asks):
        return {(sid, v): ("RuntimeError: boom" if sid == "a" and v > 1 else v <= 5)
                for sid, v in asks}

    run_searches({"a": a, "b": b}, probe)
    assert a.status == FAILED and a.error == "RuntimeError: boom" and a.answer is None
    assert b.status == FOUND and b.answer <= 5


SUMMARY = {"requests": 100, "completed": 100, "rejected": 0, "unfinished": 0,
           "p50_ttft_s": 0.2, "p90_ttft_s": 0.8, "p99_ttft_s": 1.5,
           "p50_tpot_s": 0.02, "p90_tpot_s": 0.03, "p99_tpot_s": 0.045}


def test_judge_holds_every_target():
    assert judge(SUMMARY, [Target("ttft", 99, 2.0), Target("tpot", 99, 0.05)]).met
    verdict = judge(SUMMARY, [Target("ttft", 99, 2.0), Target("tpot", 90, 0.025)])
    assert not verdict.met and verdict.why == "p90 TPOT 30 ms > 25 ms"
    assert not judge(SUMMARY, [Target("ttft", 50, 0.1)]).met


def test_rejected_or_unfinished_requests_fail_the_target():
    rejected = {**SUMMARY, "completed": 97, "rejected": 3, "rejected_too_large": 3}
    verdict = judge(rejected, [Target("ttft", 99, 10.0)])
    assert not verdict.met and "3 of 100 requests rejected (too_large: 3)" in verdict.why
    unfinished = {**SUMMARY, "completed": 90, "unfinished": 10}
    verdict = judge(unfinished, [Target("ttft", 99, 10.0)])
    assert not verdict.met and "10 of 100 requests unfinished" in verdict.why


def test_a_percentile_that_cannot_be_computed_fails():
    verdict = judge({**SUMMARY, "p99_tpot_s": math.nan}, [Target("tpot", 99, 1.0)])
    assert not verdict.met and "decoded a second token" in verdict.why


def test_goodput_counts_requests_within_the_per_request_limits():
    requests = pd.DataFrame({
        "arrival_s": [0.0, 1.0, 2.0, 3.0, 4.0],
        "finished_s": [2.0, 3.0, 4.0, 9.0, math.nan],
        "status": ["completed"] * 4 + ["running"],
        "generated_tokens": [10, 20, 30, 40, 0],
        "ttft_s": [0.5, 1.5, 0.4, 0.3, math.nan],
        "tpot_s": [0.01, 0.01, math.nan, 0.2, math.nan],
    })
    # the p99 bound is the per-request limit (the p50 one is looser on the tail: unused)
    targets = [Target("ttft", 50, 0.2), Target("ttft", 99, 1.0), Target("tpot", 99, 0.05)]
    assert per_request_limits(targets) == {"ttft": 1.0, "tpot": 0.05}
    req_s, tok_s = goodput(requests, targets)
    # within: requests 0 (0.5 s, 10 ms) and 2 (no TPOT: one token after the first); span 9 s
    assert req_s == pytest.approx(2 / 9)
    assert tok_s == pytest.approx(40 / 9)


@pytest.mark.parametrize(("text", "seconds"), [
    ("2s", 2.0), ("500ms", 0.5), ("50ms", 0.05), ("0.25s", 0.25), (" 1.5 s", 1.5),
    ("1e-3s", 0.001),
])
def test_durations(text, seconds):
    assert parse_duration(text, "--ttft-p99") == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["50", "2h", "-1s", "0s", "s", "1,5s", "2 seconds", "1e9s"])
def test_bad_durations_are_one_line(text):
    with pytest.raises(ValueError, match="--ttft-p99") as exc:
        parse_duration(text, "--ttft-p99")
    assert "\n" not in str(exc.value)


def test_precision():
    assert parse_precision("2%") == pytest.approx(0.02)
    assert parse_precision("0.05") == pytest.approx(0.05)
    for bad in ("0", "200%", "x", "nan", "0.0001"):
        with pytest.raises(ValueError, match="--precision"):
            parse_precision(bad)
