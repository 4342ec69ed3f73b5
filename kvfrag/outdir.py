"""Output folders kvfrag may write, and only those: ownership, locking, temporaries, signals.

Ownership is proven, never inferred. Every folder kvfrag writes carries a manifest
(`.kvfrag-manifest.json`, written last: kvfrag's version, what wrote it, every file and every
subfolder in it). kvfrag replaces a folder only when it does not exist, is truly empty (no
entry at all), or its own manifest lists everything in it, recursively. A subfolder with a
manifest of its own (a run folder's `validate/` report) counts only when the parent's manifest
names it too; what is inside it is then held against its own manifest. So a folder of kvfrag's
folders with no manifest at its top (`results/`), an empty subfolder nobody listed, a symbolic
link or a file is not kvfrag's: it is refused with one line before any work, and nothing is
touched (`UnsafeOutput`, exit status 2). So is the current folder (or one holding it): the new
folder is renamed into place, which would leave the shell in a deleted folder.

Temporaries, beside the folder NAME they become (`.NAME.tmp-XXXXXXXX`) or that they replace
(`.NAME.old-XXXXXXXX`), are kvfrag's only when they carry its marker (`.kvfrag-temporary`,
naming NAME), written as they are made: a folder of the user's that merely has such a name is
neither removed nor overlooked.

While a command writes a folder it holds an exclusive `flock` on a lock file beside it
(`.NAME.lock`, NAME the real folder's: `-o .` would lock `../.DIR.lock`), so two runs (or a run
and a `validate`) never race on one folder; the second says who holds it, or waits with
`--wait` (`Busy`, exit status 4). The lock file is opened without following a symbolic link,
and one that is not a plain file of kvfrag's is refused (exit status 2), so that the lock never
writes through to another file. Holding the lock also tells a killed writer's temporaries from
a live one's: the lock holder removes the stale ones. SIGTERM and SIGHUP are turned into
`Terminated` (a `KeyboardInterrupt`) so that the same clean-up runs as for Ctrl-C. An
operating-system failure while writing (read-only place, disk full, a file where a folder
should be) is one line naming the path and the reason (`OutputError`, exit status 3).
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
import stat
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvfrag import __version__

MANIFEST = ".kvfrag-manifest.json"
#: The file that makes a temporary folder kvfrag's: JSON naming the folder it is for.
MARKER = ".kvfrag-temporary"
#: `kvfrag validate`'s report folder inside a scenario's results. A new run keeps it: the
#: report describes its own simulation (with its resolved scenario), not the run's.
VALIDATE_DIR = "validate"

#: The names of the temporaries kvfrag makes beside a folder NAME (`tempfile`'s 8 characters);
#: a name alone proves nothing: the marker inside does.
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[a-z0-9_]{8}$")
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


def real_path(path: Path | str) -> Path:
    """`path` with its folder resolved (symbolic links, `..`) but itself not followed; `.` and
    `..` are resolved too, so that the result has the folder's real name."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        return path.resolve()
    return path.parent.resolve() / path.name


# ------------------------------------------------------------------------ ownership
def check_target(path: Path, early: bool = False, replace: bool = True) -> None:
    """Raise `UnsafeOutput` unless kvfrag may write the folder at `path`.

    `replace`: the folder is to be replaced whole (renamed away), which the current folder and
    those holding it cannot be; without it (`kvfrag plot`, `report`) it is written in place.
    `early`: the check made before the lock is taken, which lets kvfrag's marked temporaries
    through (a killed writer's, that the lock holder removes before it checks again).
    """
    path = Path(path)
    if path.is_symlink():
        raise UnsafeOutput(f"{path}: is a symbolic link; give the folder itself")
    if path.exists():
        if not path.is_dir():
            raise UnsafeOutput(
                f"{path}: exists and is not a folder; kvfrag will not replace it "
                "(choose another output path)"
            )
        foreign = foreign_files(path, limit=4, early=early)  # (a 4th: there are more)
        if foreign:
            raise UnsafeOutput(_foreign_message(path, foreign))
    if replace:
        _refuse_current(path)


def _foreign_message(path: Path, foreign: list[str]) -> str:
    shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    kvfrags = all(f.endswith("/") and _read_manifest(path / f) is not None for f in foreign)
    if kvfrags and _read_manifest(path) is None:
        return (
            f"{path}: holds folders kvfrag wrote ({shown}) but is not one itself (it has no "
            "manifest of its own); replacing it would delete them: give one of them, or a new "
            "folder"
        )
    if kvfrags:  # (a report written before run folders named theirs, or dropped in)
        return (
            f"{path}: holds folders with manifests of their own that its manifest does not "
            f"name ({shown}); kvfrag will not delete them: move them away (`kvfrag validate` "
            "run again names its report), or choose another output path"
        )
    return (
        f"{path}: holds files kvfrag did not write ({shown}); kvfrag writes only folders whose "
        "manifest lists everything in them: choose another output path (or move those away)"
    )


def _refuse_current(path: Path) -> None:
    """The current folder (or one holding it) cannot be replaced: renaming the new folder into
    its place would leave the shell (and this process) in a deleted folder."""
    try:
        cwd = Path.cwd().resolve()
    except OSError:
        return
    real = real_path(path)
    if real == cwd or real in cwd.parents:
        what = "is the current folder" if real == cwd else "holds the current folder"
        raise UnsafeOutput(
            f"{path}: {what}; kvfrag writes a new folder and renames it into place, which "
            "would leave your shell in a deleted folder: give a folder inside it (-o NAME), "
            "or run from its parent"
        )


def foreign_files(folder: Path, limit: int = 3, early: bool = False) -> list[str]:
    """Up to `limit` entries under `folder` that its manifest does not account for (a folder
    with a trailing '/'); `early`: not counting kvfrag's marked temporaries anywhere."""
    folder = Path(folder)
    found: list[str] = []
    _foreign(folder, folder, "", _read_manifest(folder), found, limit, [_WALK_LIMIT], early)
    return found


@dataclass(frozen=True)
class _Manifest:
    files: frozenset[str]
    folders: frozenset[str]


def _foreign(
    top: Path,
    root: Path,
    prefix: str,
    manifest: _Manifest | None,
    found: list[str],
    limit: int,
    budget: list[int],
    early: bool,
) -> None:
    """Append to `found` what in `root/prefix` `manifest` (root's, None: none) does not list."""
    folder = root / prefix if prefix else root
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as exc:
        found.append(f"{_shown(top, folder)}/ (unreadable: {exc.strerror})")
        return
    for entry in entries:
        if len(found) >= limit:
            return
        budget[0] -= 1
        if budget[0] < 0:
            found.append("more files than kvfrag writes")
            return
        path = Path(entry.path)
        rel = f"{prefix}/{entry.name}" if prefix else entry.name
        if entry.is_dir(follow_symlinks=False):
            if (manifest is not None or early) and is_temporary(path):
                continue  # (what a killed writer left: removed with the folder, or before)
            if manifest is None or rel not in manifest.folders:
                found.append(f"{_shown(top, path)}/")
            elif os.path.lexists(path / MANIFEST):  # a folder with a manifest of its own
                _foreign(top, path, "", _read_manifest(path), found, limit, budget, early)
            else:
                _foreign(top, root, rel, manifest, found, limit, budget, early)
        elif manifest is not None and entry.is_file(follow_symlinks=False) and (
            rel in manifest.files or rel in (MANIFEST, MARKER)
        ):
            continue
        else:
            found.append(_shown(top, path))


def _shown(top: Path, path: Path) -> str:
    return path.relative_to(top).as_posix() if path != top else "."


def _read_manifest(folder: Path) -> _Manifest | None:
    """What `folder`'s manifest lists, or None when it has none (or one that cannot be read:
    nothing is proven then)."""
    manifest = Path(folder) / MANIFEST
    try:
        if not stat.S_ISREG(os.lstat(manifest).st_mode):
            return None
        data = json.loads(manifest.read_text(encoding="utf-8"))
        files, folders = data["files"], data.get("folders")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not _strings(files) or (folders is not None and not _strings(folders)):
        return None
    if folders is None:  # (written before manifests listed folders: those of its files)
        folders = _parents(files)
    return _Manifest(frozenset(files), frozenset(folders))


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _parents(files: Iterable[str]) -> set[str]:
    """Every folder that holds one of `files` ('a/b/c.png': 'a' and 'a/b')."""
    out = set()
    for f in files:
        parts = f.split("/")[:-1]
        out.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return out


def write_manifest(folder: Path, what: str) -> None:
    """Record every file and subfolder now in `folder` (the last file written into a
    temporary folder). A subfolder with a manifest of its own is named, not walked."""
    files, folders = _contents(Path(folder))
    data = {"kvfrag_version": __version__, "written_by": what, "files": files,
            "folders": folders}
    (Path(folder) / MANIFEST).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def _contents(folder: Path) -> tuple[list[str], list[str]]:
    """The files and the folders under `folder`, relative and '/'-separated (not kvfrag's
    manifest and marker at its top, nor symbolic links or marked temporaries anywhere)."""
    files: list[str] = []
    folders: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        rel = here.relative_to(folder)
        walk = []
        for d in sorted(dirnames):
            sub = here / d
            if sub.is_symlink() or is_temporary(sub):
                continue
            folders.append((rel / d).as_posix())
            if not os.path.lexists(sub / MANIFEST):
                walk.append(d)
        dirnames[:] = walk
        for f in sorted(filenames):
            if (here / f).is_symlink() or (here == folder and f in (MANIFEST, MARKER)):
                continue
            files.append((rel / f).as_posix())
        if len(files) > _WALK_LIMIT:
            break
    return files, folders


def add_to_manifest(
    folder: Path, files: Iterable[Path] = (), folders: Iterable[str] = ()
) -> None:
    """Record files (and folders, by name relative to `folder`) that kvfrag wrote into a
    folder it had written (`kvfrag plot` redraws, a `validate/` report put in a run folder)."""
    folder = Path(folder)
    current = _read_manifest(folder)
    if current is None:
        return
    data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    base = os.path.abspath(folder)
    names = {Path(os.path.relpath(os.path.abspath(f), base)).as_posix() for f in files}
    data["files"] = sorted(current.files | names)
    data["folders"] = sorted(current.folders | set(folders) | _parents(names))
    write_text_atomic(folder / MANIFEST, json.dumps(data, indent=1) + "\n")


def register_nested(folder: Path) -> None:
    """Have the folder holding `folder` (a report with its own manifest) name it, so that it
    stays replaceable: added to its manifest, or, when `folder` is all it holds, a manifest
    of its own. A folder of the user's holding other things (or the current folder) is left
    as it is."""
    folder = Path(folder)
    parent = folder.parent
    if _read_manifest(parent) is not None:
        add_to_manifest(parent, folders=[folder.name])
        return
    try:
        only = [e.name for e in os.scandir(parent)] == [folder.name]
        cwd = Path.cwd().resolve()
    except OSError:
        return
    real = parent.resolve()
    if only and real != cwd and real not in cwd.parents:
        write_manifest(parent, "kvfrag validate")


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
    """A fresh temporary folder beside `target` (`.NAME.tmp-XXXXXXXX`), mode `DIR_MODE`,
    marked as kvfrag's before anything else goes in (`replace_dir` takes the mark off)."""
    real = real_path(target)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{real.name}.tmp-", dir=real.parent))
    except OSError as exc:
        raise output_error(exc, target, exact=True) from None
    try:
        tmp.chmod(DIR_MODE)
        _mark(tmp, real.name)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise output_error(exc, target, exact=True) from None
        raise
    return tmp


def _mark(folder: Path, name: str) -> None:
    """Mark `folder` as kvfrag's temporary for the folder `name` beside it."""
    data = {"kvfrag_temporary": True, "target": name, "pid": os.getpid(),
            "kvfrag_version": __version__}
    fd = os.open(folder / MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(data) + "\n")


def unmark(folder: Path) -> None:
    """Take the temporary's mark off `folder` (it is about to become what it was made for)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / MARKER)


def is_temporary(path: Path, name: str | None = None) -> bool:
    """Whether `path` is a temporary kvfrag made (of the folder `name`, if given): a folder
    named as one whose marker names the same folder."""
    path = Path(path)
    match = _TEMPORARY.match(path.name)
    if not match or (name is not None and match["name"] != name):
        return False
    marker = path / MARKER
    try:
        if path.is_symlink() or not stat.S_ISREG(os.lstat(marker).st_mode):
            return False
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(data, dict) and data.get("kvfrag_temporary") is True
            and data.get("target") == match["name"])


def clean_stale(target: Path) -> list[Path]:
    """Remove the temporaries a killed writer of `target` left beside it (call with the
    lock held: no live writer of `target` can own them then). Only marked ones go."""
    real = real_path(target)
    removed = []
    try:
        entries = list(os.scandir(real.parent))
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        if is_temporary(path, real.name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def clean_stale_inside(folder: Path) -> list[Path]:
    """Remove the marked temporaries directly inside `folder` (a killed `kvfrag report` or
    manifest update; call with `folder`'s lock held)."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        if is_temporary(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def replace_dir(new: Path, target: Path) -> None:
    """Rename the temporary `new` to `target`, replacing it; the old folder goes only once the
    new is in (renamed aside, marked, as `.NAME.old-XXXXXXXX`: a killed run's is stale).

    `target` is checked again first: files may have appeared in it since the run began. An
    empty `target` is replaced by the rename itself, which fails if anything appeared since.
    """
    check_interrupted()  # (results of a command the user stopped are not put in place)
    check_target(target)
    target = Path(target)
    name = real_path(target).name
    old = None
    try:
        if target.is_dir() and any(os.scandir(target)):
            old = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=target.parent))
            os.rmdir(old)
            _mark(target, name)  # (in a folder with a manifest, the marker is kvfrag's)
            try:
                target.rename(old)
            except BaseException:
                unmark(target)
                raise
        try:
            new.rename(target)
        except BaseException:
            if old is not None:
                old.rename(target)
                unmark(target)
            raise
        unmark(target)
    except OSError as exc:
        raise output_error(exc, target) from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write the file `path` whole or not at all, through a marked temporary folder beside it
    (a killed writer's is recognised as kvfrag's, not taken for the user's)."""
    path = Path(path)
    tmp = temp_dir(path)
    try:
        (tmp / path.name).write_text(text, encoding="utf-8")
        os.chmod(tmp / path.name, FILE_MODE)
        os.replace(tmp / path.name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    """`.NAME.lock` beside the folder, NAME the real one's (`.` has none of its own)."""
    real = real_path(target)
    return real.parent / f".{real.name}.lock"


@contextlib.contextmanager
def locked(target: Path, command: str, wait: bool = False) -> Iterator[None]:
    """Hold the exclusive lock of results folder `target` (`.NAME.lock` beside it).

    The lock file is removed on release; a process that was waiting on a removed file
    notices (its inode is gone) and takes the new one, so removal never lets two in. It is
    never opened through a symbolic link, and one that is not a plain file holding a kvfrag
    lock's record (or nothing) is refused: writing the record would destroy it.
    """
    path = lock_path(target)
    make_dirs(path.parent)
    fd, held = -1, False
    try:
        while True:
            fd = _open_lock(path, target)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                if not wait:
                    raise Busy(
                        f"{target}: in use by {holder}; wait for it to finish, or run again "
                        "with --wait"
                    ) from None
                print(f"kvfrag: waiting for {holder} to release {target}", file=sys.stderr)
                fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(path, fd):
                _check_lock_record(fd, path)
                held = True
                break
            os.close(fd)  # the holder removed the file as we waited on it: lock the new one
            fd = -1
        info = {"pid": os.getpid(), "command": command, "since": time.strftime("%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        _HELD.add(fd)
        yield
    finally:
        with _signals_deferred():  # (a second signal must not leave the lock file behind)
            _HELD.discard(fd)
            if held and _same_file(path, fd):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _open_lock(path: Path, target: Path) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO) or os.path.islink(path):
            raise _not_a_lock(path) from None
        raise output_error(exc, target, exact=True) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise _not_a_lock(path, st.st_nlink != 1 and stat.S_ISREG(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_a_lock(path: Path, linked: bool = False) -> UnsafeOutput:
    if os.path.islink(path):
        what = "is a symbolic link"
    elif linked:
        what = "is a file with other names (hard links)"
    else:
        what = "is not a plain file"
    return UnsafeOutput(
        f"{path}: {what}, not kvfrag's lock file; kvfrag will not write to it: remove it (or "
        "choose another output path)"
    )


def _check_lock_record(fd: int, path: Path) -> None:
    """A lock file holds nothing or a lock's record (one left by a killed kvfrag): anything
    else is someone's file, which taking the lock would overwrite."""
    try:
        data = os.pread(fd, 4096, 0)
        ok = not data or isinstance(json.loads(data).get("pid"), int)
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise UnsafeOutput(
            f"{path}: holds something other than a kvfrag lock; kvfrag will not overwrite it: "
            "move it away (or choose another output path)"
        )


def _same_file(path: Path, fd: int) -> bool:
    try:
        st, mine = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"process {info['pid']} ({info['command']}, since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another kvfrag process"


# ------------------------------------------------------------------------ signals
#: The signals that stop a command (Ctrl-C, SIGTERM, SIGHUP).
_STOPPING = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold back the stopping signals until the block is done (a clean-up must not be cut)."""
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING)
    except (AttributeError, OSError, ValueError):
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Ctrl-C raises `KeyboardInterrupt`, SIGTERM and SIGHUP `Terminated`, in the main thread
    while this is active. Enter it before `locked`, so that a signal never lands between
    taking the lock and its release being set up.

    A signal the process ignores on entry (SIGHUP under `nohup`, SIGINT in a background job)
    stays ignored. A signal is also remembered until the command ends: its exception, raised
    by the handler wherever the main thread is, is swallowed when that is a weakref callback
    or a `__del__` (matplotlib's caches are weak dictionaries; Python prints "Exception
    ignored" and goes on), and the command would then finish as if nothing had happened.
    `check_interrupted` raises it again at the next safe point: before results are put in
    place (`replace_dir`), and at the latest when this context ends.
    """

    def handler(signum: int, frame: object) -> None:
        _pending[:] = [signum]
        raise _interruption(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals as they are
            break
    _pending.clear()
    try:
        yield
        check_interrupted()  # (a signal whose exception was swallowed on the way)
    finally:
        _pending.clear()
        for sig, old in previous.items():
            signal.signal(sig, old)


#: The signal `terminate_as_interrupt`'s handler last took, until the command ends.
_pending: list[int] = []


def _interruption(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def check_interrupted() -> None:
    """Raise the interruption a signal asked for, if its own exception was swallowed (see
    `terminate_as_interrupt`); nothing when no signal came."""
    if _pending:
        raise _interruption(_pending[0])


def interrupt_status(exc: KeyboardInterrupt) -> int:
    """The shell's exit status for a process ended by this signal (128 + its number:
    130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)
