"""A signal stops a command even where its exception cannot travel, and an ignored one stays
ignored.

Python runs a signal's handler wherever the main thread is; when that is a weakref callback or
a `__del__` (matplotlib keeps weak caches), the handler's exception is printed as "Exception
ignored" and dropped. kvfrag remembers the signal and stops at the next safe point, before the
results are put in place. A signal ignored when the command starts (`nohup`: SIGHUP; a
background job: SIGINT) is left ignored.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
import weakref
from pathlib import Path

import pytest

from kvfrag import outdir
from kvfrag.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "scenarios" / "quickstart.yaml"
ARGS = ["-q", "-j", "1", "--set", "workload.transforms.first_n=30"]


class _Cached:
    pass


def _signal_inside_a_weakref_callback(sig: int) -> None:
    """Deliver `sig` while a weakref callback runs: its handler's exception is swallowed."""
    obj = _Cached()

    def callback(_ref: object) -> None:
        os.kill(os.getpid(), sig)
        time.sleep(0.05)  # (the handler runs here, and raises inside the callback)

    ref = weakref.ref(obj, callback)
    del obj
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_swallowed_signal_still_stops_the_run_before_it_writes(tmp_path, monkeypatch, capsys,
                                                                  sig):
    def draw(folder, meta, **kwargs):
        _signal_inside_a_weakref_callback(sig)
        return []  # (the drawing "finishes": only the remembered signal can stop the run)

    swallowed = []  # (what Python reports as "Exception ignored in ...")
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))
    monkeypatch.setattr("kvfrag.plots.plot_results", draw)
    out = tmp_path / "r"
    assert main(["run", str(QUICK), "-o", str(out), *ARGS]) == 128 + sig
    err = capsys.readouterr().err
    assert len(swallowed) == 1 and issubclass(swallowed[0], KeyboardInterrupt)
    assert "interrupted" in err and "--resume" in err
    assert not out.exists()  # the results were not put in place
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".lock") or ".tmp-" in p.name]
    assert not outdir._pending  # (nothing remembered past the command)


def test_a_signal_ignored_at_the_start_stays_ignored(tmp_path, monkeypatch):
    seen = []

    def draw(folder, meta, **kwargs):
        seen.append(signal.getsignal(signal.SIGHUP))
        os.kill(os.getpid(), signal.SIGHUP)  # (as `nohup` users expect: nothing happens)
        return []

    monkeypatch.setattr("kvfrag.plots.plot_results", draw)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert main(["run", str(QUICK), "-o", str(tmp_path / "r"), *ARGS]) == 0
        assert seen == [signal.SIG_IGN]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert (tmp_path / "r" / "summary.csv").is_file()


@pytest.mark.parametrize("command", [["run", str(QUICK)], ["compare", "a", "b"]])
def test_a_signal_while_the_inputs_are_read_is_an_interruption(monkeypatch, capsys, command):
    """Before a command takes its lock: still one line and 143, not a death by signal."""

    def reading(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # (the handler raises before this ends)

    where = {"run": "kvfrag.config.load_scenario", "compare": "kvfrag.compare_cmd.read_folder"}
    monkeypatch.setattr(where[command[0]], reading, raising=True)
    handler = signal.getsignal(signal.SIGTERM)
    assert main(command) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == "interrupted"
    assert signal.getsignal(signal.SIGTERM) == handler
