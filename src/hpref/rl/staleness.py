"""The staleness rule of `hpref rl`'s rollouts: how far behind its trainer the weights that made a
rollout may be (`rl.staleness_limit`), and what the executor does with data that is not fresh
enough. Pure functions: the `RolloutExecutor` (`hpref.rl.rollout.executor`) and the trainer apply them."""

from __future__ import annotations

from typing import Literal

Decision = Literal["use", "regenerate"]


class StaleWeightsError(RuntimeError):
    """An engine is further behind its trainer than the staleness limit allows."""


def expected_version(rollout_id: int, update_interval: int) -> int:
    """The trainer's weight version when it starts rollout `rollout_id` (one publish per interval)."""
    return rollout_id // update_interval


def staleness_decision(
    policy: str,
    rollout_id: int,
    data_version: int | None,
    engine_version: int,
    update_interval: int,
    limit: int,
) -> Decision:
    """Serve buffered data, regenerate it, or fail.

    Data of rollout `r` is fresh enough when its weights are at most `limit` versions behind the
    trainer's. Stale data is regenerated if the engine now has fresh enough weights; if the engine
    itself is too far behind, the trainer did not publish a new version in time: an error, because
    waiting would deadlock (the trainer waits for this very rollout).
    """
    needed = expected_version(rollout_id, update_interval) - limit
    if data_version is not None and data_version >= needed:
        return "use"
    if engine_version >= needed:
        return "regenerate"
    raise StaleWeightsError(
        f"policy '{policy}': rollout {rollout_id} needs weights of version >= {needed} but the engine "
        f"serves version {engine_version}: no weight update was published in time"
    )
