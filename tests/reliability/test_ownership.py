"""Ownership is proven, never inferred: what a careless (or hostile) user found, on real files.

Every case runs the command line (`kvfrag.cli.main`, or a real child process for signals) and
checks what is on disk afterwards: a folder kvfrag may not replace is refused with one line
(exit status 2) and left byte for byte as it was, with no lock or temporary beside it.

- A folder is kvfrag's only if its own manifest lists everything in it: a folder of kvfrag's
  folders (`results/`), a folder with an empty subfolder of the user's, are not.
- A temporary is kvfrag's only if kvfrag's marker is inside it, not because of its name.
- The lock file is never opened through a symbolic link (nor a hard link, nor a file of the
  user's that happens to have its name), in every command that takes one.
- `-o .` is refused with its real reason; `kvfrag plot .` works in place.
- Ctrl-C, SIGTERM and SIGHUP stop `plot`, `report`, `compare` and `validate` at once, with
  the lock and temporaries gone and the shell's exit status (130, 143, 129): real signals,
  sent to a child `kvfrag plot` from outside, and sent by the command to itself mid-write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfrag import outdir
from kvfrag.cli import main
from kvfrag.outdir import MANIFEST, write_manifest

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "scenarios" / "quickstart.yaml"
TINY = ROOT / "scenarios" / "validate-tiny.yaml"
FAST = ["--set", "workload.transforms.first_n=30", "--no-plots", "-q", "-j", "1"]
VALIDATE = ["--mode", "arena", "--set", "workload.transforms.first_n=20", "--set",
            "allocators=[{label: slab, kind: contiguous, reserve: oracle}]", "--checkpoints", "3",
            "-q"]


def _run(out: Path | str | None, *extra: str) -> int:
    return main(["run", str(QUICK), *(["-o", str(out)] if out is not None else []), *FAST,
                 *extra])


def _tree(root: Path) -> dict[str, object]:
    """Everything under `root` (itself included): each path with its kind and content."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        out[here.relative_to(root).as_posix() + "/"] = "folder"
        for name in dirnames + filenames:
            p = here / name
            if p.is_symlink():
                out[p.relative_to(root).as_posix()] = ("link", os.readlink(p))
            elif p.is_file():
                out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def _refused(capsys: pytest.CaptureFixture[str], rc: int, *words: str) -> str:
    """Exit status 2 with one line on stderr that holds `words`."""
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


# ------------------------------------------------------------------------ rule 1: manifests
def test_a_folder_of_results_folders_is_not_replaced(tmp_path, monkeypatch, capsys):
    """`kvfrag run base; kvfrag run other; kvfrag run base -o results` deleted both."""
    monkeypatch.chdir(tmp_path)
    assert _run(None, "--set", "name=base") == 0
    assert _run(None, "--set", "name=other") == 0
    before = _tree(tmp_path)
    _refused(capsys, _run("results", "--set", "name=base"), "results", "base/", "other/")
    assert _tree(tmp_path) == before  # no lock, no staging, no temporary: nothing


def test_a_results_folder_beside_an_empty_folder_of_the_users(tmp_path, capsys):
    rd2 = tmp_path / "rd2"
    assert _run(rd2 / "r") == 0
    (rd2 / "mine").mkdir()
    before = _tree(tmp_path)
    _refused(capsys, _run(rd2), "mine/", "r/")
    assert _tree(tmp_path) == before


def test_an_empty_subfolder_is_the_users(tmp_path, capsys):
    esub = tmp_path / "esub"
    (esub / "inner").mkdir(parents=True)
    before = _tree(tmp_path)
    _refused(capsys, _run(esub), "inner/")
    assert _tree(tmp_path) == before
    out = tmp_path / "r"  # and inside a folder kvfrag wrote, one it did not list
    assert _run(out) == 0
    (out / "keep").mkdir()
    before = _tree(tmp_path)
    _refused(capsys, _run(out), "keep/")
    assert _tree(tmp_path) == before


def test_a_truly_empty_folder_is_used(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert _run(out) == 0
    assert (out / "summary.csv").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_a_nested_manifest_counts_only_when_the_parent_names_it(tmp_path, capsys):
    out = tmp_path / "r"
    assert _run(out) == 0
    extra = out / "extra"  # a folder with a manifest, dropped in: it proves nothing of r
    extra.mkdir()
    (extra / "data.csv").write_text("mine")
    write_manifest(extra, "kvfrag validate")
    before = _tree(tmp_path)
    _refused(capsys, _run(out), "extra/")
    assert _tree(tmp_path) == before


def test_a_validation_report_is_named_by_its_run_folder_and_kept(tmp_path, capsys):
    out = tmp_path / "r"
    assert _run(out) == 0
    report = out / "validate"
    assert main(["validate", str(TINY), "-o", str(report), *VALIDATE]) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert "validate" in manifest["folders"] and (report / MANIFEST).is_file()
    kept = (report / "validate.csv").read_bytes()
    assert _run(out) == 0  # replaced, the report carried over
    assert (report / "validate.csv").read_bytes() == kept
    (report / "notes.txt").write_text("mine")  # inside the report: held to its own manifest
    _refused(capsys, _run(out), "validate/notes.txt")
    assert (report / "notes.txt").read_text() == "mine"


def test_a_report_written_first_makes_a_folder_a_run_may_replace(tmp_path):
    out = tmp_path / "results" / "x"
    assert main(["validate", str(TINY), "-o", str(out / "validate"), *VALIDATE]) == 0
    assert json.loads((out / MANIFEST).read_text())["folders"] == ["validate"]
    assert _run(out) == 0
    assert (out / "summary.csv").is_file() and (out / "validate" / "validate.csv").is_file()


# ------------------------------------------------------------------------ rule 2: markers
def test_a_users_folder_named_like_a_temporary_survives(tmp_path, capsys):
    for name in (".res.tmp-abcdefgh", ".res.old-abcdefgh"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text("mine")
    out = tmp_path / "res"
    assert _run(out) == 0  # beside the target: not removed as a stale temporary
    assert _run(out) == 0
    for name in (".res.tmp-abcdefgh", ".res.old-abcdefgh"):
        assert (tmp_path / name / "keep.txt").read_text() == "mine"
    inside = out / ".summary.csv.tmp-abcdefgh"  # inside a folder of kvfrag's: not overlooked
    inside.mkdir()
    (inside / "keep.txt").write_text("mine")
    _refused(capsys, _run(out), ".summary.csv.tmp-abcdefgh/")
    assert (inside / "keep.txt").read_text() == "mine"


def test_only_a_marked_temporary_of_that_folder_is_stale(tmp_path):
    target = tmp_path / "res"
    ours = outdir.temp_dir(target)
    (ours / "half.csv").write_text("half")
    theirs = tmp_path / ".res.tmp-zzzzzzzz"  # a copy of ours under the user's name: the
    theirs.mkdir()  # marker names another folder
    (theirs / outdir.MARKER).write_text(json.dumps({"kvfrag_temporary": True, "target": "x"}))
    assert outdir.clean_stale(target) == [ours]
    assert not ours.exists() and theirs.is_dir()


# ------------------------------------------------------------------------ the lock
def _results(tmp_path: Path, name: str = "res") -> Path:
    out = tmp_path / name
    assert _run(out) == 0
    return out


def _lock_commands(tmp_path: Path) -> dict[str, tuple[list[str], Path]]:
    """Each command that takes a lock: its arguments and the folder it locks."""
    res = _results(tmp_path)
    other = _results(tmp_path, "other")
    return {
        "run": (["run", str(QUICK), "-o", str(res), *FAST], res),
        "plot": (["plot", str(res)], res),
        "report": (["report", str(res)], res),
        "compare": (["compare", str(res), str(other), "-o", str(tmp_path / "cmp")],
                    tmp_path / "cmp"),
        "validate": (["validate", str(TINY), "-o", str(tmp_path / "v"), *VALIDATE],
                     tmp_path / "v"),
    }


def test_the_lock_never_writes_through_to_another_file(tmp_path, capsys):
    """`ln -s victim.txt .res.lock; kvfrag run ... -o res` wrote the lock's record into
    victim.txt; so could each command that takes a lock."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    commands = _lock_commands(tmp_path)
    for kind in ("symlink", "dangling", "hardlink", "folder", "data"):
        for command, (args, target) in commands.items():
            lock = outdir.lock_path(target)
            if kind == "symlink":
                lock.symlink_to(victim)
            elif kind == "dangling":
                lock.symlink_to(tmp_path / "created-through-the-link")
            elif kind == "hardlink":
                os.link(victim, lock)
            elif kind == "folder":
                lock.mkdir()
            else:
                lock.write_text("my notes, named oddly\n")
            capsys.readouterr()
            before = _tree(tmp_path)
            _refused(capsys, main(args), str(lock))
            assert _tree(tmp_path) == before, (kind, command)  # victim, link, target as were
            assert victim.read_text() == "precious\n"
            lock.rmdir() if kind == "folder" else lock.unlink()


def test_a_stale_lock_of_a_killed_kvfrag_is_taken(tmp_path):
    out = tmp_path / "r"
    lock = outdir.lock_path(out)
    lock.write_text(json.dumps({"pid": 1, "command": "kvfrag run", "since": "00:00:00"}))
    assert _run(out) == 0
    assert not lock.exists()


# ------------------------------------------------------------------------ the current folder
def test_dot_is_refused_for_its_real_reason(tmp_path, monkeypatch, capsys):
    """Replacing the current folder would leave the shell in a deleted one: an empty `.` is
    refused for that, not for a lock file kvfrag had put in it (`..lock`)."""
    a, b = _results(tmp_path, "a"), _results(tmp_path, "b")
    work = tmp_path / "p" / "work"
    work.mkdir(parents=True)
    write_manifest(work.parent, "kvfrag validate")  # p: kvfrag's, holding `work` only
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    _refused(capsys, _run("."), ".: is the current folder")
    _refused(capsys, _run(".."), "..: holds the current folder")
    _refused(capsys, main(["compare", str(a), str(b), "-o", "."]), "current folder")
    assert _tree(tmp_path) == before  # no lock (`..lock`, `.work.lock`), no staging


def test_plot_of_the_current_folder_locks_it_by_its_real_name(tmp_path, monkeypatch, capsys):
    out = _results(tmp_path)
    seen = []

    def draw(folder, meta, svg=False, point=None):  # (the figures themselves: test_plots)
        seen.append(sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".lock")))
        (folder / "plots").mkdir()
        (folder / "plots" / "breakdown.png").write_bytes(b"png")
        return [folder / "plots" / "breakdown.png"]

    monkeypatch.setattr("kvfrag.plots.plot_results", draw)
    monkeypatch.chdir(out)
    assert main(["plot", "."]) == 0  # in place: the current folder is fine
    assert seen == [[".res.lock"]]  # (not `..lock` inside it)
    assert capsys.readouterr().out == "plots/breakdown.png\n"
    assert not list(tmp_path.rglob("*.lock"))
    monkeypatch.chdir(tmp_path)
    assert _run(out) == 0  # what plot drew is listed: still replaceable


# ------------------------------------------------------------------------ signals
CHILD = """\
import sys, time
import kvfrag.plots

def slow_plots(folder, *args, **kwargs):  # one figure drawn before the signal comes
    (folder / "plots").mkdir(exist_ok=True)
    (folder / "plots" / "drawn.png").write_bytes(b"png")
    print("drawing", flush=True)
    time.sleep(60)

kvfrag.plots.plot_results = slow_plots
from kvfrag.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _signalled(args: list[str], sig: int) -> tuple[int, str, float]:
    """Run `kvfrag ARGS` in a child whose figures take a minute; send `sig` once it draws."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "drawing", proc.communicate(timeout=30)
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err, time.monotonic() - sent


def _leftovers(folder: Path) -> list[str]:
    """Locks, temporaries and markers under `folder` (recursively)."""
    return sorted(p.name for p in folder.rglob(".*") if p.name.endswith(".lock")
                  or ".tmp-" in p.name or ".old-" in p.name or p.name == outdir.MARKER)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_stops_plot_and_frees_its_folder(tmp_path, sig):
    out = _results(tmp_path)
    rc, err, took = _signalled(["plot", str(out)], sig)
    assert rc == 128 + sig, err
    assert "Traceback" not in err and took < 5, (took, err)
    assert _leftovers(tmp_path) == []
    assert "plots/drawn.png" in json.loads((out / MANIFEST).read_text())["files"]
    assert _run(out) == 0  # replaceable: what it drew is listed, no stale lock in the way


def test_ctrl_c_stops_plot_and_frees_its_folder(tmp_path, monkeypatch, capsys):
    out = _results(tmp_path)

    def interrupted(folder, *args, **kwargs):
        (folder / "plots").mkdir()
        (folder / "plots" / "drawn.png").write_bytes(b"png")
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # (Python's own handler raises KeyboardInterrupt before this ends)

    monkeypatch.setattr("kvfrag.plots.plot_results", interrupted)
    assert main(["plot", str(out)]) == 130
    assert _leftovers(tmp_path) == []
    assert "plots/drawn.png" in json.loads((out / MANIFEST).read_text())["files"]


@pytest.mark.parametrize("command", ["report", "compare", "validate"])
def test_a_signal_stops_the_other_writers_and_frees_their_folders(
    tmp_path, monkeypatch, capsys, command
):
    """In this process (a child's start-up would dominate): the signal lands while the command
    holds its lock (and, for compare and validate, writes its temporary folder)."""
    out = _results(tmp_path)
    sig = {"report": signal.SIGTERM, "compare": signal.SIGHUP, "validate": signal.SIGTERM}[command]

    sent: list[float] = []

    def signalled(*args, **kwargs):
        sent.append(time.monotonic())
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises before this ends

    where = {"report": "kvfrag.report.render", "compare": "kvfrag.compare_cmd._save",
             "validate": "kvfrag.validate.report.figure"}[command]
    monkeypatch.setattr(where, signalled)
    args = {
        "report": ["report", str(out)],
        "compare": ["compare", str(out), str(out), "-o", str(tmp_path / "cmp")],
        "validate": ["validate", str(TINY), "-o", str(out / "validate"), *VALIDATE],
    }[command]
    before = _tree(out)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    assert main(args) == 128 + sig
    assert time.monotonic() - sent[0] < 4  # (clean-up included; the sleep alone is 5 s)
    assert _leftovers(tmp_path) == []
    assert _tree(out) == before and not (tmp_path / "cmp").exists()
    # the handlers restored (not SIG_DFL: a library loaded earlier, Ray, may have set its own)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == handlers
