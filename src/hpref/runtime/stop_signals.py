"""A graceful stop of a launcher and its ranks on SIGTERM or Ctrl-C, as preemption-aware trainers do
(torchtitan, Lightning): `hpref train`'s.

A scheduler preempting a job, a service manager or `kill` sends SIGTERM; a terminal's Ctrl-C sends
SIGINT to the whole foreground process group. The launcher (`hpref train`'s process) holds the
handlers; its workers are not in its process group (torchrun starts each in a session of its own)
and learn of a stop through a file the launcher hands them in the environment (`STOP_FILE_ENV`, in a
fresh temporary folder per launch, so a stale request can never stop a later run):

- the first signal writes the file; every rank reads it at its next step boundary, the ranks agree
  on the step in one collective (`hpref.runfolder.save_trigger.check_requests_all_ranks`), save as
  `hpref save --now` would and end; the launcher then says where `--resume auto` continues and
  exits 128 + the signal (143 SIGTERM, 130 SIGINT);
- a second signal, no step boundary within `grace_s`, or a signal before the run has reached its
  training loop (nothing to save yet: data still tokenising, the model being built) stop at once:
  the handler raises `StopNow`, which unwinds the launcher to the command, where it becomes the
  same one line and exit code; torchrun's agent ends the workers on the way out.

torchrun's agent installs handlers of its own for SIGTERM and SIGINT when it starts the workers
(they raise its `SignalException`, an internal error to hpref, and end the workers without a save);
`torchrun_environment` tells it, through its `TORCHELASTIC_SIGNALS_TO_HANDLE`, to leave those two
alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

STOP_FILE_ENV = "HPREF_STOP_FILE"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: what torchrun's agent still handles itself: its default list less SIGTERM and SIGINT
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + int(signum)


class StopNow(BaseException):  # noqa: N818 (a stop, not an error)
    """Raised by the handler to stop at once. A BaseException, as KeyboardInterrupt is: a worker's
    `except Exception` must not turn it into a failure."""

    def __init__(self, signum: int, reason: str) -> None:
        super().__init__(f"{signal_name(signum)}: {reason}")
        self.signum = signum
        self.reason = reason


class GracefulStop:
    """The launcher's side. `ready()`: whether the run has reached its training loop (a step
    boundary will come); until then a signal stops at once."""

    def __init__(self, grace_s: float, ready: Callable[[], bool]) -> None:
        self.grace_s = grace_s
        self.ready = ready
        self.signum: int | None = None  # the first signal, once one came
        self._folder = Path(tempfile.mkdtemp(prefix="hpref-stop-"))
        self.path = self._folder / "stop"
        self._timer: threading.Timer | None = None
        self._timed_out = False
        self._stopping_now = False

    def environment(self) -> dict[str, str]:
        """For the workers: where the stop request appears."""
        return {STOP_FILE_ENV: str(self.path)}

    @contextmanager
    def installed(self) -> Iterator[GracefulStop]:
        """The handlers for SIGTERM and SIGINT while the block runs; the previous ones after it.
        Only the main thread may hold them: called from another (a caller's own thread running a
        launch), the block runs with the process's handlers as they are."""
        main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS} if main else {}
        try:
            yield self
        finally:
            if self._timer is not None:  # first: a late expiry must not meet the default handler
                self._timer.cancel()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            shutil.rmtree(self._folder, ignore_errors=True)

    def _handle(self, signum: int, _frame) -> None:
        if self._stopping_now:  # the teardown under way must reach every worker: not cut short
            return
        if self.signum is not None:
            self._stopping_now = True
            if self._timed_out:
                raise StopNow(self.signum, f"no step boundary within {self.grace_s:g} s")
            raise StopNow(self.signum, f"a second {signal_name(signum)}")
        self.signum = signum
        if not self.ready():
            self._stopping_now = True
            raise StopNow(signum, "before the first step")
        write_stop_request(self.path, signum)
        # the wait is bounded: past it, the same path as a second signal
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        self._timed_out = True
        os.kill(os.getpid(), self.signum or signal.SIGTERM)


def write_stop_request(path: Path, signum: int) -> None:
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_text(f"{int(signum)}\n")
    os.replace(tmp, path)  # a reader sees no file or the whole number


def stop_requested() -> int:
    """The worker's side: the signal its launcher was asked to stop by, 0 when none (or when the
    process was not started by a launcher that handles signals)."""
    path = os.environ.get(STOP_FILE_ENV)
    if not path:
        return 0
    try:
        return int(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return 0


def torchrun_environment() -> dict[str, str]:
    """Set while torchrun's agent starts the workers: it keeps its hands off SIGTERM and SIGINT."""
    return {"TORCHELASTIC_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS}
