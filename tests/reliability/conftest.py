"""Python's default SIGINT handler before each reliability test, and what was there after.

These tests send SIGINT to the process and expect Python's default (KeyboardInterrupt), as
a terminal's Ctrl-C gets. In the whole suite an earlier test can leave SIGINT ignored (a
worker's set-up run in the test process), and kvfrag then rightly leaves an ignored SIGINT
ignored (`outdir.terminate_as_interrupt`, as in a background job): the Ctrl-C tests would
test that instead.
"""

from __future__ import annotations

import signal

import pytest


@pytest.fixture(autouse=True)
def _default_sigint():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
