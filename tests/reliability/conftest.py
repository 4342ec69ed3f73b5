"""Python's own SIGINT handler, armed again before each reliability test.

These tests send SIGINT to the process and expect Python's handler (KeyboardInterrupt). Run
after the oracle tests, which load vLLM's stack, the signal was no longer answered although
`signal.getsignal` still named Python's handler: something loaded there had taken the
process's C-level handler. Setting the handler again re-installs Python's.
"""

from __future__ import annotations

import signal

import pytest


@pytest.fixture(autouse=True)
def _python_sigint_handler():
    signal.signal(signal.SIGINT, signal.getsignal(signal.SIGINT))
    yield
