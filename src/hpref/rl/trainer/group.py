"""A policy's trainer as the driver sees it: its ranks (one Ray actor each) called as one trainer.

    group = TrainerGroup("a", [rank0, rank1])
    await group.start()                            # ranks > 1: rendezvous, process group, FSDP2
    stats = await group.train(rollout)             # each rank its share; the group's metrics
    version = await push_weights(group, engine, "a", bucket_bytes)   # rank 0 -> engine, in buckets
    await group.save(folder); start = await group.load(folder)

Every call goes to every rank at once (their collectives pair up inside the calls) and the driver
takes rank 0's answer, which is the group's: the ranks all-reduce their metrics, and rank 0 alone
writes a save and sends the weights. A group of one rank is today's one trainer actor, called the
same way. Handles are Ray actor handles or the tests' in-process `LocalActor`s.

Policies that share one base (`rl.share_base`, `hpref.rl.placement.shared_base`) share one group of ranks:
each policy's `TrainerGroup` is bound to it (`base`), names itself in every call that acts on one
policy, starts the ranks and connects the weight channel once for all, and syncs one at a time.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hpref.rl.placement.shared_base import SharedBase
from hpref.runtime.ray_cluster import actor_death, ray_cause

#: Ray keeps at most this many of a sync's bucket layouts waiting for the driver (the bytes wait in
#: the channel: the trainer's `send` returns once the engine has received them)
BUCKETS_IN_FLIGHT = 2


#: seconds a group call that failed waits for its other ranks' outcome, in case one of them died
DEATH_NOTICE_S = 10.0


class WeightSyncError(RuntimeError):
    """A weight update that did not reach an engine whole; the engine still serves its old version."""


class TrainerGroup:
    """One policy's trainer ranks, called as one trainer (see the module docstring)."""

    def __init__(self, policy: str, ranks: list[Any], base: SharedBase | None = None) -> None:
        if not ranks:
            raise ValueError(f"policy '{policy}': a trainer group needs at least one rank")
        self.policy = policy
        self.ranks = list(ranks)
        #: what the policies on one shared base hold in common (a group of its own: its own holder)
        self.base = base if base is not None else SharedBase()
        #: calls that act on one policy name it when the ranks train several (`rl.share_base`)
        self._which: dict[str, str] = {"policy": policy} if base is not None else {}

    @property
    def sync_lock(self) -> asyncio.Lock:
        """Held by a sync: the policies of a shared base send through one channel, one at a time."""
        return self.base.sync_lock

    async def connect_engine(self, engine: Any) -> None:
        """The weight channel between rank 0 and `engine`, made once (both ends join at once):
        NCCL when both are on GPUs, else gloo."""
        if self.base.connected == engine:
            return
        host, port = await self.ranks[0].open_weight_channel.remote()
        engine_device = await engine.weight_channel_device.remote()
        trainer_device = await self.ranks[0].device_type.remote()
        device = "cuda" if engine_device == trainer_device == "cuda" else "cpu"
        await asyncio.gather(
            self.ranks[0].connect_weight_channel.remote(host, port, device),
            engine.connect_weight_channel.remote(host, port, device),
        )
        self.base.connected = engine

    async def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`method(*args)` on every rank at once. When ranks fail, a dead rank's death is the call's
        error: the rank it was in a collective with fails too (gloo: "connection reset by peer"),
        often first, and that error would name the survivor instead of the rank that died. So a
        failure that is not a death waits a little (`DEATH_NOTICE_S`) for the others' outcome; a
        survivor stuck in a collective (NCCL may wait for its timeout) does not hold the call."""
        calls = [asyncio.ensure_future(getattr(r, method).remote(*args, **kwargs)) for r in self.ranks]
        done, pending = await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
        failures = [c.exception() for c in calls if c in done and c.exception() is not None]
        if not failures:
            return [c.result() for c in calls]
        if pending and all(actor_death(f) is None for f in failures):
            more, pending = await asyncio.wait(
                pending, timeout=DEATH_NOTICE_S, return_when=asyncio.FIRST_EXCEPTION
            )
            failures += [c.exception() for c in more if c.exception() is not None]
        for call in pending:
            call.cancel()
        raise next((f for f in failures if actor_death(f) is not None), failures[0])

    async def start(self) -> None:
        """Form the process group (ranks > 1): rank 0 serves the rendezvous, every rank joins,
        then builds and shards the policy. A group of one built itself when it was created.
        The policies of a shared base start their one group once."""
        if len(self.ranks) == 1:
            return
        if self.base.started is None:
            self.base.started = asyncio.ensure_future(self._start())
        await asyncio.shield(self.base.started)

    async def _start(self) -> None:
        host, port = await self.ranks[0].open_rendezvous.remote()
        await self._all("join_group", host, port)

    async def train(self, rollout: dict[str, Any]) -> dict[str, float]:
        if len(self.ranks) > 1:  # sent once to Ray's object store, read there by every rank
            import ray

            rollout = ray.put(rollout)
        return (await self._all("train", rollout))[0]

    async def sync_version(self) -> int:
        return (await self._all("sync_version", **self._which))[0]

    async def save(self, folder: str) -> None:
        await self._all("save", folder, **self._which)

    async def load(self, folder: str) -> int:
        return (await self._all("load", folder, **self._which))[0]

    def send_weights(self, rank: Any, bucket_bytes: int, dtype: str) -> Any:
        """`rank`'s stream of this policy's weights (a Ray streaming generator)."""
        return rank.send_weights.options(
            num_returns="streaming", _generator_backpressure_num_objects=BUCKETS_IN_FLIGHT
        ).remote(bucket_bytes, dtype, **self._which)


async def push_weights(group: TrainerGroup, engine: Any, policy: str, bucket_bytes: int = 256 << 20) -> int:
    """Trainer -> engine in begin/load/commit steps, the weights streamed in buckets of at most
    `bucket_bytes` in the engine's dtype through the pair's weight channel
    (`hpref.rl.transport.weight_channel`; connected at the first sync); an interrupted or refused transfer is
    aborted, so the engine keeps serving its previous version rather than a half-loaded one, and the
    `WeightSyncError` says which version that is (asked of the engine after the abort).

    Only each bucket's layout passes through the driver (names and shapes); the bytes go from the
    trainer's rank 0 to the engine directly. The other ranks' streams yield nothing: they only join
    rank 0's gathers of their shards. Policies on one shared base sync one at a time."""
    async with group.sync_lock:
        return await _push(group, engine, policy, bucket_bytes)


async def _push(group: TrainerGroup, engine: Any, policy: str, bucket_bytes: int) -> int:
    version = await group.sync_version()
    dtype = await engine.weight_dtype.remote()
    await group.connect_engine(engine)
    await engine.begin_update.remote(version)
    try:
        streams = [group.send_weights(rank, bucket_bytes, dtype) for rank in group.ranks]

        async def forward() -> None:
            async for layout in streams[0]:
                # its names and shapes, read here: an engine in this process (`rl.executor_in_driver`)
                # takes values, where Ray would resolve a ref for an actor
                await engine.receive_weights.remote(await layout)

        async def drain(stream: Any) -> None:
            async for ref in stream:
                await ref  # nothing but a failure: the rank's error, raised here

        await asyncio.gather(forward(), *(drain(s) for s in streams[1:]))
        return await engine.commit_update.remote()
    except BaseException as exc:
        await asyncio.shield(engine.abort_update.remote())
        if not isinstance(exc, Exception) or actor_death(exc) is not None:
            raise  # cancelled, or a dead actor (`run_rl` names it)
        serving = await engine.get_version.remote()
        cause = ray_cause(exc)
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise WeightSyncError(
            f"policy '{policy}': the weight update to version {version} failed on its way to the "
            f"engine ({type(cause).__name__}: {reason}); the engine keeps serving version {serving}"
        ) from exc
