"""A graceful stop for `hpref serve`: on SIGTERM or Ctrl-C, what is in flight is answered first.

Ray Serve's own shutdown stops the HTTP proxy at once, cutting the connections of requests still
being scored. So `hpref serve` drains before it shuts Serve down: a small named actor
(`DrainControl`) holds the "stopping" flag; every replica reports to it four times a second how many
requests it holds and learns the flag (`ReplicaDrain`, a thread in the replica). Once the flag is
up, replicas answer new scoring requests 503 with Retry-After ("stopping": a client retries on
another instance) and `/ready` says 503 (a load balancer takes the instance out), while what they
hold is scored and answered. The command waits until every replica has seen the flag and holds
nothing, or the drain timeout passes, then shuts Serve down (`drain`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import ray

#: how often a replica reports (and learns the flag): the window in which a request that arrives
#: after the signal is still taken
REPORT_S = 0.25
#: a replica that has not reported for this long is gone (killed, restarting): not waited for
STALE_S = 3.0


class DrainControl:
    """The stopping flag and what each replica holds (a Ray actor, named per service)."""

    def __init__(self) -> None:
        self.stopping = False
        self.replicas: dict[str, tuple[bool, int, float]] = {}

    def report(self, replica: str, held: int, seen: bool) -> bool:
        """A replica's count (and whether it had seen the flag); returns the flag."""
        self.replicas[replica] = (seen, held, time.monotonic())
        return self.stopping

    def stop(self) -> None:
        self.stopping = True

    def drained(self) -> tuple[bool, int]:
        """Whether every live replica has seen the flag and holds nothing; what they hold."""
        now = time.monotonic()
        live = [(seen, held) for seen, held, at in self.replicas.values() if now - at < STALE_S]
        return all(seen and held == 0 for seen, held in live), sum(held for _, held in live)


def control_name(port: int) -> str:
    """One control per service: two `hpref serve` on one cluster listen on different ports."""
    return f"hpref-serve-drain-{port}"


def start_control(port: int):
    """The service's `DrainControl` actor (zero CPUs: it only counts)."""
    remote = ray.remote(num_cpus=0)(DrainControl)
    return remote.options(name=control_name(port), namespace="hpref", get_if_exists=True).remote()


class ReplicaDrain:
    """In a replica: a daemon thread that reports `held()` and keeps `stopping` current."""

    def __init__(self, port: int, held: Callable[[], int]) -> None:
        self.stopping = False
        self._held = held
        self._replica = ray.get_runtime_context().get_actor_id() or "driver"
        try:
            self._control = ray.get_actor(control_name(port), namespace="hpref")
        except ValueError:  # no control (a replica built outside `hpref serve`): never stopping
            return
        threading.Thread(target=self._loop, name="hpref-drain", daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                reply = self._control.report.remote(self._replica, self._held(), self.stopping)
                self.stopping = ray.get(reply, timeout=5)
            except Exception:  # the control is gone: the service is being torn down
                return
            time.sleep(REPORT_S)


def drain(control, timeout_s: float, log: Callable[[str], None]) -> bool:
    """Raise the flag, wait until the replicas hold nothing (at most `timeout_s`); whether they did."""
    ray.get(control.stop.remote())
    deadline = time.monotonic() + timeout_s
    held = 0
    while time.monotonic() < deadline:
        done, held = ray.get(control.drained.remote())
        if done:
            return True
        time.sleep(REPORT_S)
    log(f"drain timeout ({timeout_s:g} s) passed with {held} request(s) still held: stopping anyway")
    return False
