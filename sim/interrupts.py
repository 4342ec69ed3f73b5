"""Where the compiled engine lets Python run a pending signal's handler.

CPython runs the Python handler of a signal (Ctrl-C's `KeyboardInterrupt`, the SIGTERM and
SIGHUP handlers of `kvfrag.outdir`) only between bytecode instructions of interpreted code. The
engine and the allocators compiled by mypyc execute none while they loop inside one callback
of the serving loop, so a signal could wait there unanswered for as long as that loop runs.
The engine therefore calls `poll` every `PROGRESS_TURNS` turns of its loop: entering an
interpreted function is a point where the interpreter checks for pending signals, and the
handler's exception then propagates through the compiled frames like any other.

This module must stay out of the compiled set (`HOT` in sim/_native.py): compiled, `poll`
would be a C call that checks nothing.
"""

from __future__ import annotations


def poll() -> None:
    """Nothing to do: the call itself is where a pending signal's handler runs."""
