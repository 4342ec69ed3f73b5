"""Output folders kvfrag may write, and only those: ownership, locking, temporaries, signals.

kvfrag replaces a folder only when doing so loses no file it did not write. Every folder it
writes carries a manifest (`.kvfrag-manifest.json`: kvfrag's version, what wrote it, and
every file in it); a folder is *replaceable* when it does not exist, is empty, or holds only
files that its manifest (or a nested folder's own manifest, as a run folder's `validate/`
report has) lists. Results folders written before manifests existed are recognised by their
fixed file names. Anything else — a user's folder, a file, a symbolic link, `.`, `~` — is
refused with one line, before any work is done (`UnsafeOutput`, exit status 2).

While a command writes a results folder it holds an exclusive `flock` on a lock file beside
it (`.NAME.lock`), so two runs (or a run and a `validate`) never race on one folder; the
second says who holds it, or waits with `--wait` (`Busy`, exit status 4). Holding the lock
also tells this run's stale temporaries (left by a killed run) from another live run's: the
lock holder removes the stale ones. SIGTERM and SIGHUP are turned into `Terminated` (a
`KeyboardInterrupt`) so that the same clean-up runs as for Ctrl-C. An operating-system
failure while writing (read-only place, disk full, a file where a folder should be) is one
line naming the path and the reason (`OutputError`, exit status 3).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

from kvfrag import __version__

MANIFEST = ".kvfrag-manifest.json"
#: `kvfrag validate`'s report folder inside a scenario's results. A new run keeps it: the
#: report describes its own simulation (with its resolved scenario), not the run's.
VALIDATE_DIR = "validate"

#: Results folders written before manifests existed: what identifies them, and every file
#: such a folder can hold (glob patterns, relative to the folder).
_LEGACY = {
    "run": (
        ("scenario.resolved.yaml", "summary.csv"),
        ("scenario.resolved.yaml", "summary.csv", "summary.json", "timeseries.parquet",
         "requests.parquet", "failures.csv", "plots/*.png", "plots/*.svg", "report.html"),
    ),
    "validate": (
        ("validate.csv",),
        ("validate.csv", "validate.json", "series.parquet", "validate.png",
         "scenario.resolved.yaml"),
    ),
}
#: The temporaries kvfrag makes beside a folder NAME it writes (`tempfile`'s 8 characters).
_TEMPORARY = re.compile(r"^\..+\.(tmp|old)-[a-z0-9_]{8}$")
#: At most this many entries are looked at before a folder is refused as too big to check.
_WALK_LIMIT = 20_000


class UnsafeOutput(ValueError):
    """An output path kvfrag will not write to (it would lose files it did not write)."""


class OutputError(Exception):
    """The operating system refused a write (read-only, disk full, not a folder, ...)."""


class Busy(Exception):
    """Another kvfrag process holds the results folder's lock."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP: stop as for Ctrl-C, cleaning up on the way out.

    Its only argument is the signal's number: code that re-raises an exception by rebuilding
    it from its args (SimPy does, for one raised inside a process) gets the same exception.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(int(signum))
        self.signum = int(signum)

    def __str__(self) -> str:
        return signal.Signals(self.signum).name


# ------------------------------------------------------------------------ ownership
def check_target(path: Path, early: bool = False) -> None:
    """Raise `UnsafeOutput` unless kvfrag may (re)place a folder at `path`.

    `early`: the check made before the lock is taken, which lets kvfrag's own temporaries
    through (a killed writer's, that the lock holder removes before it checks again).
    """
    path = Path(path)
    if path.is_symlink():
        raise UnsafeOutput(f"{path}: is a symbolic link; give the folder itself")
    if not path.exists():
        return
    if not path.is_dir():
        raise UnsafeOutput(
            f"{path}: exists and is not a folder; kvfrag will not replace it "
            "(choose another output path)"
        )
    foreign = foreign_files(path, early=early)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise UnsafeOutput(
            f"{path}: holds files kvfrag did not write ({shown}); kvfrag replaces only "
            "folders it wrote: choose another output path (or move those files away)"
        )


def foreign_files(folder: Path, limit: int = 3, early: bool = False) -> list[str]:
    """Up to `limit` files under `folder` that no kvfrag manifest accounts for (`early`:
    not counting kvfrag's temporaries anywhere)."""
    found: list[str] = []
    budget = [_WALK_LIMIT]
    _foreign(Path(folder), Path(), found, limit, budget, early)
    return found


def _foreign(
    root: Path, rel: Path, found: list[str], limit: int, budget: list[int], early: bool
) -> None:
    folder = root / rel
    owned = _owned_files(folder)
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as exc:
        found.append(f"{rel or '.'} (unreadable: {exc.strerror})")
        return
    for entry in entries:
        if len(found) >= limit:
            return
        budget[0] -= 1
        if budget[0] < 0:
            found.append("more files than kvfrag writes")
            return
        name = entry.name
        if (owned is not None and name == MANIFEST) or (
            (owned is not None or early) and _TEMPORARY.match(name)
        ):
            continue  # (a temporary: what a killed writer left in a folder of ours)
        if entry.is_dir(follow_symlinks=False):
            sub = folder / name
            if owned is not None and not (sub / MANIFEST).is_file():
                inner = [f for f in _files(sub) if f"{name}/{f}" not in owned]
                found.extend(str(rel / name / f) for f in inner[: limit - len(found)])
            else:
                _foreign(root, rel / name, found, limit, budget, early)
        elif owned is None or name not in owned:
            found.append(str(rel / name))


def _owned_files(folder: Path) -> set[str] | None:
    """The files kvfrag wrote in `folder` (relative, '/'-separated), or None if not its."""
    manifest = folder / MANIFEST
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
            return {str(f) for f in data["files"]}
        except (OSError, ValueError, KeyError, TypeError):
            return None
    for required, patterns in _LEGACY.values():
        if all((folder / r).is_file() for r in required) and _legacy_ok(folder, required):
            return {f for f in _files(folder) if any(fnmatch(f, p) for p in patterns)}
    return None


def _legacy_ok(folder: Path, required: tuple[str, ...]) -> bool:
    if "scenario.resolved.yaml" not in required:
        return True
    try:
        head = (folder / "scenario.resolved.yaml").read_text(encoding="utf-8")[:200]
    except (OSError, UnicodeDecodeError):
        return False
    return head.startswith("kvfrag_version:")


def _files(folder: Path) -> list[str]:
    """Every file under `folder`, relative and '/'-separated (folders with a manifest of
    their own excluded: they are accounted for by it)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath).relative_to(folder)
        dirnames[:] = sorted(d for d in dirnames if not (Path(dirpath, d) / MANIFEST).is_file())
        out += [(here / f).as_posix() for f in sorted(filenames)]
        if len(out) > _WALK_LIMIT:
            break
    return out


def write_manifest(folder: Path, what: str) -> None:
    """Record every file now in `folder` (the last file written into a temporary folder)."""
    files = [f for f in _files(folder) if f != MANIFEST]
    data = {"kvfrag_version": __version__, "written_by": what, "files": files}
    (folder / MANIFEST).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def add_to_manifest(folder: Path, files: list[Path]) -> None:
    """Record files kvfrag wrote into a folder it had written (`kvfrag plot` redraws)."""
    manifest = Path(folder) / MANIFEST
    if not manifest.is_file():
        return
    data = json.loads(manifest.read_text(encoding="utf-8"))
    names = {Path(f).resolve().relative_to(Path(folder).resolve()).as_posix() for f in files}
    data["files"] = sorted(set(data["files"]) | names)
    tmp = manifest.with_name(f"{MANIFEST}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, manifest)


# ------------------------------------------------------------------------ folders
def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: The mode of every folder kvfrag makes: what `mkdir` would give (0755 with the usual
#: umask), so that a report, a staged point and a results folder read alike; and of a file it
#: makes through a private temporary (0644).
DIR_MODE = 0o777 & ~_umask()
FILE_MODE = 0o666 & ~_umask()


def make_dirs(path: Path) -> None:
    """`mkdir -p`, with an OS failure as one `OutputError` line."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(exc, path) from None


def temp_dir(target: Path) -> Path:
    """A fresh temporary folder beside `target` (`.NAME.tmp-XXXXXXXX`), mode `DIR_MODE`."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(DIR_MODE)
    except OSError as exc:
        raise output_error(exc, target, exact=True) from None
    return tmp


def clean_stale(target: Path) -> list[Path]:
    """Remove the temporaries a killed writer of `target` left beside it (call with the
    lock held: no live writer of `target` can own them then)."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            match = _TEMPORARY.match(entry.name)
            if match and entry.name[1 : match.start(1) - 1] == target.name and entry.is_dir(
                follow_symlinks=False
            ):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
    return removed


def replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`, replacing it; the old folder goes only once the new is in.

    `target` is checked again first: files may have appeared in it since the run began.
    """
    check_target(target)
    old = None
    try:
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rmdir(old)
            target.rename(old)
        try:
            new.rename(target)
        except BaseException:
            if old is not None:
                old.rename(target)
            raise
    except OSError as exc:
        raise output_error(exc, target) from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def output_error(exc: OSError, path: Path | str, exact: bool = False) -> OutputError:
    """One line: the path the OS complained about (`path` if `exact`, or when the OS names
    none: a temporary of ours means nothing to the user) and its reason."""
    where = path if exact or not exc.filename else exc.filename
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        reason = "no space left on device"
    elif exc.errno in (errno.EEXIST, errno.ENOTDIR):
        reason = "a file stands where a folder is needed"
    return OutputError(f"cannot write {where}: {reason}")


@contextlib.contextmanager
def writing(path: Path, exact: bool = False) -> Iterator[None]:
    """Turn an OSError raised while writing into an `OutputError` naming the path."""
    try:
        yield
    except OSError as exc:
        raise output_error(exc, path, exact) from None


# ------------------------------------------------------------------------ locking
#: Descriptors of the locks this process holds. A forked child (a sweep's worker) closes its
#: copies at once, so that a lock goes with the process that took it: a sweep killed with
#: SIGKILL frees its folder when it dies, not when the last of its workers has followed it.
_HELD: set[int] = set()


def _drop_inherited_locks() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)  # (the parent's copy keeps the flock)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


def lock_path(target: Path) -> Path:
    return Path(target).parent / f".{Path(target).name}.lock"


@contextlib.contextmanager
def locked(target: Path, command: str, wait: bool = False) -> Iterator[None]:
    """Hold the exclusive lock of results folder `target` (`.NAME.lock` beside it).

    The lock file is removed on release; a process that was waiting on a removed file
    notices (its inode is gone) and takes the new one, so removal never lets two in.
    """
    path = lock_path(target)
    make_dirs(path.parent)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise output_error(exc, target, exact=True) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            if not wait:
                os.close(fd)
                raise Busy(
                    f"{target}: in use by {holder}; wait for it to finish, or run again "
                    "with --wait"
                ) from None
            print(f"kvfrag: waiting for {holder} to release {target}", file=sys.stderr)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file as we waited on it: lock the new one
    try:
        info = {"pid": os.getpid(), "command": command, "since": time.strftime("%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())
        _HELD.add(fd)
        yield
    finally:
        _HELD.discard(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"process {info['pid']} ({info['command']}, since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another kvfrag process"


# ------------------------------------------------------------------------ signals
@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `Terminated` in the main thread while this is active."""

    def handler(signum: int, frame: object) -> None:
        raise Terminated(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals as they are
            break
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def interrupt_status(exc: KeyboardInterrupt) -> int:
    """The shell's exit status for a process ended by this signal (128 + its number)."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)
