"""Parking: how the leader brings every follower to a standstill for a consistent save or eval.

Followers call `park(name)` at the one safe point of their loop (between rollouts). Usually it
returns at once; while the leader holds the parker it blocks until the leader is done. The leader
enters `async with parker.hold():`, which waits until every follower still running is parked, runs
the body (save every trainer and the executor, or evaluate), and releases them, also when the body
fails. Saves and evals use separate parkers so an eval request can never release followers a save is
still waiting for. A follower that ends calls `leave(name)` so the leader never waits for it.

Everything runs on one asyncio event loop (the driver's); nothing here is thread-safe, nor needs to be.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable


class ParkingTimeout(RuntimeError):
    """The leader waited longer than its timeout for followers to park."""


def waiting_for(followers: Iterable[str], parked: Iterable[str], gone: Iterable[str]) -> list[str]:
    """The followers the leader still waits for: neither parked nor gone, sorted."""
    return sorted(set(followers) - set(parked) - set(gone))


class Parker:
    """A leader-driven rendezvous between one leader and named followers (see the module docstring)."""

    def __init__(self, followers: Iterable[str], name: str = "parker") -> None:
        self.name = name
        self.followers = frozenset(followers)
        self._parked: set[str] = set()  # a fresh set per hold: a follower woken late from the
        # previous round must not count as parked in the next one
        self._gone: set[str] = set()
        self._changed = asyncio.Event()
        self._release: asyncio.Event | None = None  # set while a hold is active
        self.rounds = 0

    @property
    def requested(self) -> bool:
        """Whether the leader is waiting for (or holding) the followers now."""
        return self._release is not None

    @property
    def parked(self) -> frozenset[str]:
        return frozenset(self._parked)

    def _notify(self) -> None:
        self._changed.set()

    async def park(self, follower: str) -> bool:
        """Block while the leader holds this parker; True when this call did park."""
        if follower not in self.followers:
            raise ValueError(f"{self.name}: '{follower}' is not a follower of this parker")
        release, parked = self._release, self._parked
        if release is None:
            return False
        parked.add(follower)
        self._notify()
        try:
            await release.wait()
        finally:
            parked.discard(follower)
        return True

    def leave(self, follower: str) -> None:
        """A follower has ended (finished, failed or cancelled): never wait for it again."""
        self._gone.add(follower)
        self._notify()

    @contextlib.asynccontextmanager
    async def hold(self, timeout: float | None = None) -> AsyncIterator[frozenset[str]]:
        """Request parking, wait until every live follower is parked, yield the parked set, release.

        `timeout` bounds the wait (`ParkingTimeout` names the followers that never arrived); the
        followers already parked are released in every case, so a failed save cannot strand them.
        """
        if self._release is not None:
            raise RuntimeError(f"{self.name}: the leader already holds this parker")
        release = asyncio.Event()
        self._release, self._parked = release, set()
        try:
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            while missing := waiting_for(self.followers, self._parked, self._gone):
                self._changed.clear()
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    raise ParkingTimeout(f"{self.name}: followers {missing} did not park within {timeout} s")
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    continue  # the loop re-checks and raises with the current list
            self.rounds += 1
            yield frozenset(self._parked)
        finally:
            self._release = None
            release.set()
