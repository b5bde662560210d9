"""`hpref rl`'s graceful stop on SIGTERM and SIGINT, as preemption-aware trainers do it: the first
signal asks the run to stop at its next consistent boundary (the leader's rollout in flight finishes,
a global save, the end), a second one stops it at once.

    with StopSignals(timeout_s=300) as signals:
        setup()                       # a signal here stops at once: StopNow
        with signals.graceful():
            while ...:                # the loop asks `signals.requested` at each boundary, saves, ends
                ...
        teardown()                    # a signal here is noted, never raised

The handlers run in the main thread between two bytecodes, so they only set flags or raise:
- inside `graceful()`, the first signal is noted (`requested`, `first`) and a timer starts; a second
  signal, or the timer passing `timeout_s` (the bound on finishing and saving), raises `StopNow`;
- outside it, before the loop, the first signal raises `StopNow` (nothing is in flight to finish);
- once `StopNow` was raised, or `graceful()` has ended, signals are only noted: what follows is the
  teardown, which must reach every process it started.

`StopNow` is a `KeyboardInterrupt`, so asyncio (which re-raises only `KeyboardInterrupt` and
`SystemExit` out of its callbacks and tasks; another exception raised by a handler while a callback
runs would be logged and dropped) and every `except Exception` let it through as they let Ctrl-C
through. The exit code is the shell's for a process a signal ended: 128 + the first signal's number
(143 for SIGTERM, 130 for SIGINT), also when a second one stopped the run at once. These are the
rules of `hpref train`'s stop (`hpref.runtime.stop_signals`, whose ranks learn of it through a
file), for a driver whose loop is asyncio and whose teardown follows the loop.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpref.rl.control.record import read_record

# the signals a stop answers and its exit codes are `hpref train`'s (one convention for both commands)
from hpref.runtime.stop_signals import STOP_SIGNALS, exit_code


class StopNow(KeyboardInterrupt):
    """Stop at once, nothing saved: raised in the main thread by a signal before the loop, a second
    signal (`second`), or the graceful stop's bound passing (`expired_after`). `signal` is the first
    signal, the one the run was asked to stop by, and gives the exit code."""

    def __init__(self, signum: int, *, second: int | None = None, expired_after: float | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signal = signal.Signals(signum)
        self.second = None if second is None else signal.Signals(second)
        self.expired_after = expired_after  # the bound (seconds) that passed, or None

    @property
    def exit_code(self) -> int:
        return exit_code(self.signal)


class StopSignals:
    """SIGTERM and SIGINT handlers for one command run (see the module docstring); a context
    manager that installs them and puts the previous ones back. Main thread only."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.first: signal.Signals | None = None  # the signal that asked for the stop
        self._state = "setup"  # setup -> graceful -> closing; StopNow -> closing
        self._timer: threading.Timer | None = None
        self._expired = False
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether a signal asked the run to stop (the loop's question at each boundary)."""
        return self.first is not None

    @property
    def exit_code(self) -> int | None:
        """128 + the first signal's number; None without a signal."""
        return None if self.first is None else exit_code(self.first)

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._cancel_timer()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @contextmanager
    def graceful(self) -> Iterator[StopSignals]:
        """The loop's block: a first signal here waits for the loop's next boundary (at most
        `timeout_s`); when the block ends, the run is closing and signals are only noted."""
        if self._state == "setup":
            self._state = "graceful"
        try:
            yield self
        finally:
            self.closing()

    def closing(self) -> None:
        """From here signals are only noted: the teardown that follows must reach every process."""
        self._state = "closing"
        self._cancel_timer()

    def _handle(self, signum: int, _frame: object) -> None:
        first = self.first is None
        if first:
            self.first = signal.Signals(signum)
        if self._state == "closing":
            return
        if self._state == "graceful" and first:
            # the bound on finishing and saving: it stops the run the way a second signal does
            self._timer = threading.Timer(self.timeout_s, self._expire, args=(signum,))
            self._timer.daemon = True
            self._timer.start()
            return
        self.closing()
        if first:  # before the loop: nothing in flight to finish
            raise StopNow(signum)
        assert self.first is not None
        if self._expired:
            raise StopNow(self.first, expired_after=self.timeout_s)
        raise StopNow(self.first, second=signum)

    def _expire(self, signum: int) -> None:
        self._expired = True
        # to the main thread, where Python runs the handler (a process-directed signal may be taken
        # by one of Ray's or torch's threads, and the main thread woken only by its next event)
        main = threading.main_thread().ident
        if main is not None:
            signal.pthread_kill(main, signum)

    def _cancel_timer(self) -> None:
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        self._timer = None


def stopped_line(
    run_dir: Path, why: StopNow | str, *, rollout: int | None = None, saved: str | None = None
) -> str:
    """`hpref rl`'s one line at a stop: the signal, the rollout and the save, and where `--resume auto`
    continues. `why`: the first signal's name after a graceful stop (`rollout`: the leader's
    position, `saved`: the save it made), or the `StopNow` of a stop at once (the record, if any,
    says where a resume goes on)."""
    if isinstance(why, str):
        return (
            f"hpref rl: stopped by {why} after leader rollout {rollout}; saved {saved}; run again with "
            "--resume auto to continue from it"
        )
    name = why.signal.name
    if why.expired_after is not None:
        how = f"stopped by {name}: the rollout and its save did not end within {why.expired_after:g} s"
    elif why.second is not None:
        how = f"stopped at once by a second signal ({why.second.name} after {name})"
    else:
        how = f"stopped by {name} before the first rollout"
    record = read_record(run_dir)
    if record is None:
        where = "no save was recorded yet, so a new run starts from the beginning"
    else:
        at = record.rollout_ids[record.leader]
        where = f"run again with --resume auto to continue from leader rollout {at} ({record.save_dir})"
    return f"hpref rl: {how}, nothing saved; {where}"
