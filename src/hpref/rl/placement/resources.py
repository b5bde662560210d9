"""Where each policy's actors go: what every actor asks Ray for, whether the cluster can ever hold
it, and one Ray placement group per policy that reserves it before any actor starts.

    check_cluster(config, order, ray.cluster_resources(), where, nodes=cluster_nodes())
    reservation = reserve(config, order, where=where)
    teardown.add("placement groups", reservation.release)
    ray.remote(EngineHost).options(**reservation.engine_options("a")).remote(...)
    ray.remote(TrainerActor).options(**reservation.rank_options("a", 0)).remote(...)

A policy's group holds one bundle per actor: its engine first, then trainer ranks 0 .. ranks-1, and
Ray packs it on one node when it fits, spreading it otherwise (strategy PACK, as verl's and
OpenRLHF's actor groups are placed). With `rl.colocate` and a GPU on both sides, the engine and
trainer rank 0 share bundle 0: its GPU is the larger of their two asks and each actor asks half of
it, so Ray hands both the same device (the split is Ray's bookkeeping only; what each really holds
is the engine's `gpu_memory_utilization` and its sleep while the trainer steps).

`hpref.rl.placement.nodes` simulates that placement for `hpref rl --plan`. Whether the engines run
on a GPU (`engines_on_gpu`) is one answer for the plan, the run's placement and `rl.share_base`'s
default.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from hpref.errors import RecipeError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from hpref.recipe.rl import RLConfig
    from hpref.rl.protocols import EngineConfig

#: The Ray CPUs of the rollout executor, which stays outside the policies' groups (it serves them
#: all; the launcher asks this), as many as an engine's by default (`EngineConfigBase.num_cpus`).
#: Actors mostly wait on each other, so a 2-core machine holds two policies.
EXECUTOR_CPUS = 0.25
#: How long `reserve` waits for Ray to place the groups. Resources that exist but are held by other
#: work free up in seconds or never; a minute separates the two without hanging a run for long.
RESERVE_TIMEOUT_S = 60.0

Role = Literal["engine", "trainer"]
#: The `bundle` of an engine hosted by the rollout executor (`rl.engines_in_executor`): in no group
HOSTED = -1


@dataclass(frozen=True)
class ActorAsk:
    """What one actor of a policy asks Ray for: `bundle` is its bundle's index in the policy's
    placement group (the engine and trainer rank 0 share bundle 0 when colocated on a GPU;
    `HOSTED`: an engine in the rollout executor's process, whose CPUs the executor asks)."""

    policy: str
    role: Role
    rank: int | None
    cpus: float
    gpus: float
    bundle: int

    @property
    def name(self) -> str:
        return f"{self.policy} engine" if self.role == "engine" else f"{self.policy} trainer {self.rank}"


def engine_config(config: RLConfig) -> EngineConfig:
    """The engine's config: the one the recipe resolved, or (a recipe loaded with `resolve=False`)
    its `[rl.engine]` resolved now."""
    from hpref.recipe.rl import resolve_engine

    return config.engine_config or resolve_engine(config.engine)


def engine_resources(config: RLConfig) -> tuple[float, float]:
    """(CPUs, GPUs) each engine actor asks: its config's `num_cpus` / `num_gpus`."""
    engine = engine_config(config)
    return float(engine.num_cpus), float(engine.num_gpus)


def engines_on_gpu(config: RLConfig) -> bool:
    """Whether the policies' engines run on a GPU: they ask Ray for one (`engine_resources`), so the
    run puts them on one or refuses to start. One answer for the plan and the run
    (`hpref.rl.placement.shared_base.share_base_decision`, `hpref.rl.plan.memory.engine_memory`)."""
    return engine_resources(config)[1] > 0


def colocated(config: RLConfig, policy: str) -> bool:
    """Whether the policy's engine shares trainer rank 0's GPU: `rl.colocate` with a GPU on both
    sides (without one there is no device to share, and each actor keeps a bundle of its own)."""
    return config.colocate and engines_on_gpu(config) and config.policies[policy].gpus_per_rank > 0


def actor_asks(config: RLConfig, order: Sequence[str]) -> dict[str, list[ActorAsk]]:
    """Per policy: its engine, then trainer ranks 0 .. ranks-1, each with its Ray CPUs and GPUs (an
    engine in the rollout executor's process in no bundle: `HOSTED`)."""
    engine_cpus, engine_gpus = engine_resources(config)
    out: dict[str, list[ActorAsk]] = {}
    for p in order:
        policy = config.policies[p]
        if config.engines_in_executor:
            asks = [ActorAsk(p, "engine", None, engine_cpus, engine_gpus, HOSTED)]
            asks.append(ActorAsk(p, "trainer", 0, policy.cpus_per_rank, policy.gpus_per_rank, 0))
            first = 1
        elif colocated(config, p):
            half = max(engine_gpus, policy.gpus_per_rank) / 2  # one device, split for Ray's books
            asks = [ActorAsk(p, "engine", None, engine_cpus, half, 0)]
            asks.append(ActorAsk(p, "trainer", 0, policy.cpus_per_rank, half, 0))
            first = 1
        else:
            asks = [ActorAsk(p, "engine", None, engine_cpus, engine_gpus, 0)]
            asks.append(ActorAsk(p, "trainer", 0, policy.cpus_per_rank, policy.gpus_per_rank, 1))
            first = 2
        asks += [
            ActorAsk(p, "trainer", r, policy.cpus_per_rank, policy.gpus_per_rank, first + r - 1)
            for r in range(1, policy.ranks)
        ]
        out[p] = asks
    return out


def bundles(asks: Sequence[ActorAsk]) -> list[dict[str, float]]:
    """One policy's placement-group bundles: the sum of the asks that share each (Ray refuses a
    resource of 0 in a bundle, so a CPU-only bundle names no GPU)."""
    out: list[dict[str, float]] = []
    for ask in asks:
        if ask.bundle == HOSTED:
            continue
        if ask.bundle == len(out):
            out.append({"CPU": 0.0, "GPU": 0.0})
        out[ask.bundle]["CPU"] += ask.cpus
        out[ask.bundle]["GPU"] += ask.gpus
    return [{k: round(v, 4) for k, v in b.items() if v > 0} for b in out]


# --------------------------------------------------------------------------------------------------
# refusals before anything starts


def _key(ask: ActorAsk, what: Literal["cpus", "gpus"]) -> str:
    if ask.role == "engine":
        return f"rl.engine.num_{what}"
    return f"rl.policies.{ask.policy}.{what}_per_rank"


def _describe(config: RLConfig, policy: str, what: Literal["cpus", "gpus"], unit: str) -> str:
    """`2 trainer ranks x 1 GPU + engine 1 GPU` for one policy (colocated: the shared device once)."""
    ranks = config.policies[policy].ranks
    each = getattr(config.policies[policy], f"{what}_per_rank")
    engine = engine_resources(config)[0 if what == "cpus" else 1]
    parts = [f"{ranks} trainer rank{'s' if ranks > 1 else ''} x {each:g} {unit}"] if each else []
    if what == "gpus" and colocated(config, policy):
        return parts[0] + f" (the engine on rank 0's {unit})"
    parts += [f"engine {engine:g} {unit}"] if engine else []
    return " + ".join(parts) or "none"


def check_cluster(
    config: RLConfig,
    order: Sequence[str],
    resources: Mapping[str, float],
    where: str,
    *,
    nodes: Sequence[Mapping[str, float]] | None = None,
) -> None:
    """Refuse, in one `RecipeError` line naming the key, a run the cluster can never hold: more CPUs
    or GPUs in all than `resources` (`ray.cluster_resources()`) has, a colocated engine that asks more
    than the one device it shares, or a bundle larger than every node in `nodes` (each node's
    resources, `cluster_nodes()`; None skips that check)."""
    asks = actor_asks(config, order)
    engine_gpus = engine_resources(config)[1]
    for p in order:
        if colocated(config, p) and max(engine_gpus, config.policies[p].gpus_per_rank) > 1:
            raise RecipeError(
                f"{where}: rl.colocate: policy {p}'s engine ({engine_gpus:g} GPUs) and trainer rank 0 "
                f"({config.policies[p].gpus_per_rank:g}) would share one device; colocation needs at most "
                "1 GPU on each side (set rl.engine.num_gpus and gpus_per_rank to 1, or colocate = false)"
            )
    _check_total(config, order, asks, "gpus", float(resources.get("GPU", 0.0)), where)
    _check_total(config, order, asks, "cpus", float(resources.get("CPU", 0.0)), where)
    if not nodes:
        return
    for p in order:
        for i, bundle in enumerate(bundles(asks[p])):
            if any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()) for node in nodes):
                continue
            ask = max((a for a in asks[p] if a.bundle == i), key=lambda a: (a.gpus, a.cpus))
            largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)))
            key = _key(ask, "gpus" if bundle.get("GPU", 0.0) > largest.get("GPU", 0.0) else "cpus")
            who = "engine" if ask.rank is None else f"trainer rank {ask.rank}"
            raise RecipeError(
                f"{where}: {key}: policy {p}'s {who} asks "
                f"{_amount(bundle)} on one node, the largest "
                f"node of the Ray cluster has {_amount(largest)}"
            )


def _check_total(
    config: RLConfig,
    order: Sequence[str],
    asks: dict[str, list[ActorAsk]],
    what: Literal["cpus", "gpus"],
    have: float,
    where: str,
) -> None:
    """The run's CPUs (the rollout executor's included) or GPUs against the cluster's total."""
    unit = "GPU" if what == "gpus" else "CPU"
    extra = executor_cpus(config, order) if what == "cpus" else 0.0
    asked = extra + sum(b.get(unit, 0.0) for p in order for b in bundles(asks[p]))
    if asked <= have + 1e-9:
        return
    by_key: dict[str, float] = {}  # the key that asks the most is the one to name
    for ask in (a for p in order for a in asks[p]):
        by_key[_key(ask, what)] = by_key.get(_key(ask, what), 0.0) + getattr(ask, what)
    key = max(by_key, key=lambda k: (by_key[k], not k.startswith("rl.engine")))
    described = {p: _describe(config, p, what, unit) for p in order}
    detail = "; ".join(f"policy {p}: {text}" for p, text in described.items() if text != "none")
    if extra:  # its own CPUs; those of the engines it hosts are their policies' above
        detail += f"; the rollout executor {EXECUTOR_CPUS:g}"
    raise RecipeError(
        f"{where}: {key}: the run asks {asked:g} {unit}s ({detail}), the Ray cluster has {have:g}"
    )


def executor_cpus(config: RLConfig, order: Sequence[str]) -> float:
    """The rollout executor's Ray CPUs: its own and those of the engines it hosts; none in the
    driver's process (`rl.executor_in_driver`: Ray reserves nothing for it)."""
    if config.executor_in_driver:
        return 0.0
    hosted = engine_resources(config)[0] * len(order) if config.engines_in_executor else 0.0
    return EXECUTOR_CPUS + hosted


def _amount(resources: Mapping[str, float]) -> str:
    return f"{resources.get('CPU', 0.0):g} CPUs and {resources.get('GPU', 0.0):g} GPUs"


def cluster_nodes() -> list[dict[str, float]]:
    """The CPUs, GPUs and memory of each live node of the Ray cluster this process joined."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


# --------------------------------------------------------------------------------------------------
# reserving on the cluster


@dataclass
class Reservation:
    """The policies' placement groups and, per actor, the `.options(...)` that put it in its bundle."""

    asks: dict[str, list[ActorAsk]]
    groups: dict[str, Any]
    released: bool = field(default=False)

    def _options(self, ask: ActorAsk) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": ask.cpus,
            "num_gpus": ask.gpus,
            # hpref's actors start no Ray tasks of their own; a child captured into a bundle sized
            # exactly for its parent would wait for resources forever
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.groups[ask.policy],
                placement_group_bundle_index=ask.bundle,
                placement_group_capture_child_tasks=False,
            ),
        }

    def engine_options(self, policy: str) -> dict[str, Any]:
        return self._options(self.asks[policy][0])

    def rank_options(self, policy: str, rank: int) -> dict[str, Any]:
        return self._options(self.asks[policy][1 + rank])

    def release(self) -> None:
        """Remove the placement groups (their actors, killed first by the teardown, free nothing)."""
        if self.released:
            return
        from ray.util.placement_group import remove_placement_group

        self.released = True
        for group in self.groups.values():
            remove_placement_group(group)


def reserve(
    config: RLConfig, order: Sequence[str], *, where: str = "recipe", timeout_s: float = RESERVE_TIMEOUT_S
) -> Reservation:
    """One placement group per policy (PACK), placed before any actor starts; a group Ray cannot
    place within `timeout_s` removes them all and is one `RecipeError` line naming the policy."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    asks = actor_asks(config, order)
    groups: dict[str, Any] = {}
    try:
        for p in order:
            groups[p] = placement_group(bundles(asks[p]), strategy="PACK")
        deadline = time.monotonic() + timeout_s
        for p in order:
            if not groups[p].wait(max(deadline - time.monotonic(), 0.1)):
                free = ray.available_resources()
                raise RecipeError(
                    f"{where}: rl.policies.{p}: Ray could not place policy {p}'s {len(asks[p])} actors "
                    f"({_bundles_text(bundles(asks[p]))}) within {timeout_s:g} s; free now: {_amount(free)} "
                    "(other work holds the rest, or no node is large enough)"
                )
    except BaseException:
        for group in groups.values():
            remove_placement_group(group)
        raise
    return Reservation(asks, groups)


def _bundles_text(items: Sequence[Mapping[str, float]]) -> str:
    return ", ".join("{" + ", ".join(f"{k} {v:g}" for k, v in b.items()) + "}" for b in items)
