"""Where a policy's actors go (`hpref.rl.placement.resources`): the asks, the refusals before anything starts,
the simulated PACK of the plan, and real placement groups on a Ray cluster that declares 8 logical
GPUs (this machine has none: Ray only hands out the ids, which is what placement is about)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from hpref.errors import RecipeError
from hpref.recipe.rl import parse_rl_section
from hpref.rl.placement.nodes import Node, pack
from hpref.rl.placement.resources import actor_asks, bundles, check_cluster, reserve
from tests.rl.conftest import start_ray


def _config(policies: dict, *, colocate: bool = False, engine_gpus: float = 0.0, engine_cpus: float = 0.25):
    config = parse_rl_section({"policies": policies, "colocate": colocate}, "recipe.toml")
    # a GPU engine's config (vLLM's has num_cpus / num_gpus); the built-in engine is CPU-only
    config.engine_config = SimpleNamespace(num_cpus=engine_cpus, num_gpus=engine_gpus)
    return config


def test_colocated_engine_shares_rank_0s_bundle_and_gpu():
    config = _config({"a": {"ranks": 2, "gpus_per_rank": 1}}, colocate=True, engine_gpus=1)
    asks = actor_asks(config, ["a"])["a"]
    # engine and rank 0 in bundle 0, each half of its one GPU; rank 1 a whole GPU of its own. If
    # they were separate bundles, Ray would hand them two devices and colocation would be a lie.
    assert [(a.role, a.rank, a.gpus, a.bundle) for a in asks] == [
        ("engine", None, 0.5, 0),
        ("trainer", 0, 0.5, 0),
        ("trainer", 1, 1.0, 1),
    ]
    assert bundles(asks) == [{"CPU": 0.5, "GPU": 1.0}, {"CPU": 0.25, "GPU": 1.0}]


def test_without_colocation_or_gpus_every_actor_has_its_own_bundle():
    config = _config({"a": {"ranks": 3}}, colocate=True)  # colocate, but nothing to share on a CPU
    asks = actor_asks(config, ["a"])["a"]
    assert [a.bundle for a in asks] == [0, 1, 2, 3]
    # Ray refuses a 0 resource in a bundle: a CPU-only bundle must not name GPU at all
    assert bundles(asks) == [{"CPU": 0.25}] * 4


def test_gpus_on_a_cpu_cluster_are_refused_in_one_line_naming_the_key():
    config = _config({"a": {"ranks": 2, "gpus_per_rank": 1}, "b": {}}, engine_gpus=1)
    with pytest.raises(RecipeError) as err:
        check_cluster(config, ["a", "b"], {"CPU": 2.0}, "recipe.toml")
    assert str(err.value) == (
        "recipe.toml: rl.policies.a.gpus_per_rank: the run asks 4 GPUs (policy a: 2 trainer ranks x 1 GPU"
        " + engine 1 GPU; policy b: engine 1 GPU), the Ray cluster has 0"
    )


def test_cpus_count_the_rollout_executor_too():
    config = _config({"a": {}, "b": {"ranks": 2, "cpus_per_rank": 0.5}})
    # a: engine 0.25 + rank 0.25; b: engine 0.25 + 2 ranks x 0.5; the executor 0.25: 2 CPUs exactly
    check_cluster(config, ["a", "b"], {"CPU": 2.0}, "recipe.toml")
    with pytest.raises(RecipeError) as err:
        check_cluster(config, ["a", "b"], {"CPU": 1.5}, "recipe.toml")
    # the key named is the one asking the most (b's ranks: 1 CPU, the engines 0.5 together)
    assert str(err.value) == (
        "recipe.toml: rl.policies.b.cpus_per_rank: the run asks 2 CPUs (policy a: 1 trainer rank x 0.25 CPU"
        " + engine 0.25 CPU; policy b: 2 trainer ranks x 0.5 CPU + engine 0.25 CPU; the rollout executor "
        "0.25), the Ray cluster has 1.5"
    )


def test_a_bundle_larger_than_every_node_is_refused():
    # 8 GPUs in all, but no node holds the 4-GPU engine (tensor_parallel_size 4) on its own
    config = _config({"a": {}}, engine_gpus=4)
    nodes = [{"CPU": 8.0, "GPU": 2.0}] * 4
    check_cluster(config, ["a"], {"CPU": 32.0, "GPU": 8.0}, "recipe.toml")  # the totals alone pass
    with pytest.raises(RecipeError) as err:
        check_cluster(config, ["a"], {"CPU": 32.0, "GPU": 8.0}, "recipe.toml", nodes=nodes)
    assert str(err.value) == (
        "recipe.toml: rl.engine.num_gpus: policy a's engine asks 0.25 CPUs and 4 GPUs on one node, the "
        "largest node of the Ray cluster has 8 CPUs and 2 GPUs"
    )


def test_a_colocated_engine_cannot_ask_more_than_the_device_it_shares():
    config = _config({"a": {"gpus_per_rank": 1}}, colocate=True, engine_gpus=2)
    with pytest.raises(RecipeError, match=r"^recipe\.toml: rl\.colocate: policy a's engine \(2 GPUs\)"):
        check_cluster(config, ["a"], {"CPU": 8.0, "GPU": 8.0}, "recipe.toml")


def test_pack_keeps_a_policy_on_one_node_and_spreads_what_does_not_fit():
    config = _config({"a": {"ranks": 2, "gpus_per_rank": 1}, "b": {"ranks": 3, "gpus_per_rank": 1}})
    nodes = [Node("n1", 4, 3, 2**34), Node("n2", 4, 2, 2**34)]
    spots = pack(nodes, actor_asks(config, ["a", "b"]))
    where = {a.name: (spot[0].name, spot[1]) for a, spot in spots.items() if spot is not None}
    # a's three actors fit n1 together; b's three GPU ranks fit no single node after that, so they
    # spread (first fit); every rank holds a GPU id no other rank of its node holds
    assert where == {
        "a engine": ("n1", []),
        "a trainer 0": ("n1", [0]),
        "a trainer 1": ("n1", [1]),
        "b engine": ("n1", []),
        "b trainer 0": ("n1", [2]),
        "b trainer 1": ("n2", [0]),
        "b trainer 2": ("n2", [1]),
    }
    more = pack([Node("n1", 4, 1, 2**34)], actor_asks(config, ["a"]))
    assert [spot is None for spot in more.values()] == [False, False, True]  # one GPU for two ranks


# --------------------------------------------------------------------------------------------------
# on Ray, with logical GPUs


@pytest.fixture(scope="module")
def gpu_cluster():
    """A local Ray cluster of 2 CPUs and 8 logical GPUs for this module; the shared one (`ray_cluster`,
    which declares none), if it was up, comes back afterwards."""
    ray = pytest.importorskip("ray")
    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    ray.init(num_cpus=2, num_gpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
    if was_up:
        start_ray()


class Probe:
    """What Ray gave the actor: its GPU ids and its node."""

    def where(self) -> tuple[list[str], str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()], ray.get_runtime_context().get_node_id()


def test_actors_created_through_the_reservation_get_their_gpus(gpu_cluster):
    ray = gpu_cluster
    config = _config({"a": {"ranks": 2, "gpus_per_rank": 1}}, colocate=True, engine_gpus=1)
    check_cluster(config, ["a"], ray.cluster_resources(), "recipe.toml")
    reservation = reserve(config, ["a"], timeout_s=30)
    try:
        probe = ray.remote(Probe)
        actors = [probe.options(**reservation.engine_options("a")).remote()]
        actors += [probe.options(**reservation.rank_options("a", r)).remote() for r in (0, 1)]
        (engine_gpus, engine_node), (rank0_gpus, rank0_node), (rank1_gpus, rank1_node) = ray.get(
            [a.where.remote() for a in actors], timeout=60
        )
        # colocated: the engine sees rank 0's device; rank 1 has one of its own; all on one node
        assert len(rank0_gpus) == 1 and engine_gpus == rank0_gpus
        assert len(rank1_gpus) == 1 and rank1_gpus != rank0_gpus
        assert engine_node == rank0_node == rank1_node
        # the group holds its GPUs: a second run asking 7 more cannot be placed, and says so in one line
        greedy = _config({"b": {"ranks": 7, "gpus_per_rank": 1}})
        with pytest.raises(RecipeError) as err:
            reserve(greedy, ["b"], timeout_s=1)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith("recipe: rl.policies.b: Ray could not place policy b's 8 actors")
        assert "free now: 1.25 CPUs and 6 GPUs" in message
        for actor in actors:
            ray.kill(actor)
    finally:
        reservation.release()
    # released: the 8 GPUs are free again for the next run (removal is asynchronous)
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU", 0) < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("GPU", 0) == 8


def test_a_trainer_rank_placed_on_a_logical_gpu_torch_cannot_see_stops_in_one_line(gpu_cluster):
    """A real trainer rank actor, placed through the reservation on one of the cluster's logical
    GPUs, in a process whose torch has no CUDA (this machine's CPU build): its construction fails
    with one line naming the policy, the rank and the GPU id Ray gave it, before any model is built.
    If this fails, a rank asked to train on a GPU trains on the CPU and looks like a run."""
    ray = gpu_cluster
    from hpref.errors import UserError
    from hpref.rl.trainer.actor import TrainerActor
    from hpref.runtime.ray_cluster import ray_cause

    config = _config({"a": {"ranks": 2, "gpus_per_rank": 1}})
    reservation = reserve(config, ["a"], timeout_s=30)
    try:
        rank = (
            ray.remote(TrainerActor)
            .options(**reservation.rank_options("a", 1))
            .remote("a", config.policies["a"], 1, rank=1, world_size=2)
        )
        with pytest.raises(Exception) as err:
            ray.get(rank.device_type.remote(), timeout=60)
        cause = ray_cause(err.value)
        assert isinstance(cause, UserError), err.value
        message = str(cause)
        assert "\n" not in message
        assert message.startswith("policy 'a' trainer rank 1: Ray assigned it GPU ")
        assert "(gpus_per_rank = 1) but torch" in message and "sees no CUDA device" in message
        ray.kill(rank)
    finally:
        reservation.release()


def test_hpref_rl_asked_for_a_gpu_torch_cannot_see_ends_in_that_one_line(gpu_cluster, tmp_path):
    """`hpref rl` on the logical-GPU cluster with `gpus_per_rank = 1`: placement passes (Ray has the
    GPU ids), the rank refuses to start, and the run ends with that user error (one line, exit 2
    from the CLI) rather than a dead actor's report or a run on the CPU."""
    from hpref.errors import UserError
    from hpref.recipe import recipe_from_dict
    from hpref.rl.launch import run_rl
    from tests.rl.tiny import TINY

    rl = {
        "num_rollouts": 1,
        "rollout": {"group_size": 2, "prompts_per_rollout": 1, "max_new_tokens": 2},
        "reward": {"name": "rule"},
        "policies": {"a": {"model": TINY, "gpus_per_rank": 1}},
    }
    recipe = recipe_from_dict({"run": {"name": "gpu", "output_dir": str(tmp_path)}, "rl": rl}, resolve=False)
    with pytest.raises(UserError) as err:
        run_rl(recipe, ["a"])
    assert str(err.value).startswith("policy 'a' trainer rank 0: Ray assigned it GPU ")
    assert "\n" not in str(err.value)
