"""What the fuzz tests share (tests/data/test_fuzz_readers.py, tests/serve/test_fuzz_shapes.py)."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def time_bound(seconds: int, what: str):
    """Fail an example that runs `seconds` (`what`: a reader or parser stuck in a loop) instead of
    hanging the suite. SIGALRM, so only on the main thread; elsewhere hypothesis' deadline remains."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def hang(signum, frame):
        raise TimeoutError(f"{what} ran over {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
