"""Which process runs each policy's engine (`rl.engines_in_executor`) and the rollout executor
(`rl.executor_in_driver`): the decisions and their refusals, what the placement reserves and the plan says
for engines in the rollout executor's process and an executor in the driver's, and the line that names a
dead executor hosting them (and no executor at all when it was the driver). That a run with hosted engines
trains bit for bit as one with engine actors is tests/rl/control/test_chaos_rl.py's (its reference has
engine actors); that a default run starts no engine actor, test_stop_signals.py's actor counts."""

from __future__ import annotations

import pytest

from hpref.errors import RecipeError
from hpref.recipe.rl import parse_rl_section
from hpref.rl.placement.engine_process import (
    HOSTED_REASON,
    IN_DRIVER_REASON,
    engine_process_line,
    executor_process_line,
    resolve_engine_process,
)
from hpref.rl.placement.resources import (
    EXECUTOR_CPUS,
    HOSTED,
    actor_asks,
    bundles,
    check_cluster,
    executor_cpus,
)
from tests.rl.tiny import TINY


def rl_config(engine=None, **over):
    data = {
        "defaults": {"model": TINY},
        "policies": {"a": {}, "b": {"model": {"seed": 1}}},
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 4},
        **over,
    }
    if engine is not None:
        data["engine"] = engine
    return parse_rl_section(data)


def test_cpu_transformers_engines_go_into_the_executor_and_the_recipe_overrides_it():
    # Wrong if the default put CPU engines in processes of their own (the suite's and a laptop's
    # runs pay ~4.3 CPU-s of imports per engine for nothing), put a vLLM or GPU engine in the
    # executor (vLLM's worker processes and a GPU want a process of their own), or if the recipe's
    # word did not hold
    default = resolve_engine_process(rl_config())
    assert default.engines_in_executor is True and default.engines_in_executor_reason == HOSTED_REASON
    assert engine_process_line(default).startswith("engines_in_executor = true (in the rollout executor's")
    off = resolve_engine_process(rl_config(engines_in_executor=False))
    assert off.engines_in_executor is False
    assert off.engines_in_executor_reason == "set in the recipe (rl.engines_in_executor = false)"
    vllm = resolve_engine_process(rl_config({"name": "vllm"}))
    assert vllm.engines_in_executor is False and "not hostable" in vllm.engines_in_executor_reason
    gpu = resolve_engine_process(rl_config({"name": "vllm", "num_gpus": 1}))
    assert gpu.engines_in_executor is False
    # a decided config comes back as it was (the actors and the plan resolve it again)
    assert resolve_engine_process(default) is default


def test_the_executor_comes_into_the_driver_with_the_engines_it_hosts_and_the_recipe_overrides_it():
    # Wrong if a CPU run still started an executor actor (~5 CPU-s of imports for a process that only
    # calls engines living in it), if engine actors (vLLM, GPU, or the recipe's false) left the
    # executor outside Ray's placement, if the recipe's word did not hold, or if `true` beside engine
    # actors started a run rather than saying in one line what to change
    default = resolve_engine_process(rl_config())
    assert default.executor_in_driver is True and default.executor_in_driver_reason == IN_DRIVER_REASON
    assert executor_process_line(default).startswith("executor_in_driver = true (in the hpref rl process)")
    actor = resolve_engine_process(rl_config(executor_in_driver=False))
    assert (actor.engines_in_executor, actor.executor_in_driver) == (True, False)
    assert actor.executor_in_driver_reason == "set in the recipe (rl.executor_in_driver = false)"
    for apart in (rl_config(engines_in_executor=False), rl_config({"name": "vllm"})):
        resolved = resolve_engine_process(apart)
        assert (
            resolved.executor_in_driver is False
            and "actors of their own" in resolved.executor_in_driver_reason
        )
    with pytest.raises(RecipeError) as err:
        resolve_engine_process(rl_config(engines_in_executor=False, executor_in_driver=True), "r.toml")
    assert str(err.value) == (
        "r.toml: rl.executor_in_driver = true, but the engines run in actors of their own "
        "(rl.engines_in_executor = false, a vLLM or a GPU engine): the executor comes into the driver "
        "only with the engines it hosts (set it to false)"
    )


def test_engines_in_the_executor_are_refused_for_an_engine_that_cannot_be_hosted():
    # Wrong if `engines_in_executor = true` on vLLM started a run whose engines could not work, or
    # the refusal did not name the key and the way out
    with pytest.raises(RecipeError) as err:
        resolve_engine_process(rl_config({"name": "vllm"}, engines_in_executor=True), "r.toml")
    assert str(err.value) == (
        "r.toml: rl.engines_in_executor = true, but the 'vllm' engine cannot run in the rollout "
        "executor's process (set it to false)"
    )


def test_hosted_engines_reserve_no_bundle_and_the_executor_asks_their_cpus():
    # Wrong if a hosted engine still reserved a bundle in its policy's group (CPUs held by no
    # process), or the executor that runs the engines did not ask for their CPUs, so the cluster
    # check would pass a run its engines' CPUs do not fit
    hosted = resolve_engine_process(rl_config(executor_in_driver=False))
    asks = actor_asks(hosted, ["a", "b"])
    for p in ("a", "b"):
        engine, trainer = asks[p]
        assert (engine.role, engine.bundle) == ("engine", HOSTED)
        assert bundles(asks[p]) == [{"CPU": trainer.cpus}]  # the trainer rank's bundle alone
    assert executor_cpus(hosted, ["a", "b"]) == EXECUTOR_CPUS + 2 * asks["a"][0].cpus
    apart = resolve_engine_process(rl_config(engines_in_executor=False))
    assert [len(bundles(asks)) for asks in actor_asks(apart, ["a", "b"]).values()] == [2, 2]
    assert executor_cpus(apart, ["a", "b"]) == EXECUTOR_CPUS
    # the same total either way, and the refusal counts the executor's own CPUs once
    total = executor_cpus(hosted, ["a", "b"]) + sum(b["CPU"] for p in "ab" for b in bundles(asks[p]))
    with pytest.raises(RecipeError) as err:
        check_cluster(hosted, ["a", "b"], {"CPU": total - 0.1}, "r.toml")
    assert f"the run asks {total:g} CPUs" in str(err.value)
    assert str(err.value).count("the rollout executor") == 1
    assert f"the rollout executor {EXECUTOR_CPUS:g})" in str(err.value)
    check_cluster(hosted, ["a", "b"], {"CPU": total}, "r.toml")
    # in the driver (the default for CPU engines), Ray reserves nothing for it or its engines: the
    # cluster holds the trainers
    driver = resolve_engine_process(rl_config())
    assert executor_cpus(driver, ["a", "b"]) == 0.0
    trainers = sum(b["CPU"] for p in "ab" for b in bundles(actor_asks(driver, ["a", "b"])[p]))
    check_cluster(driver, ["a", "b"], {"CPU": trainers}, "r.toml")
    with pytest.raises(RecipeError) as err:
        check_cluster(driver, ["a", "b"], {"CPU": trainers - 0.1}, "r.toml")
    assert "the rollout executor" not in str(err.value)


def test_the_plan_puts_hosted_engines_in_the_executor_process_without_a_baseline_of_their_own():
    # Wrong if `hpref rl --plan` showed an engine process that does not exist (its own baseline
    # memory, its own node) for an engine that lives in the rollout executor
    pytest.importorskip("torch")
    from hpref.rl.placement.nodes import Node
    from hpref.rl.plan.table import plan_rows

    nodes = [Node("n1", 2.0, 0, 16 << 30)]
    for in_driver, name, cpus in (
        (False, "rollout executor", EXECUTOR_CPUS),
        (True, "rollout executor (in hpref rl)", 0),
    ):
        config = resolve_engine_process(rl_config(executor_in_driver=in_driver))
        rows = plan_rows(config, ["a", "b"], nodes, {"a": 10, "b": 10}, baseline=300 << 20)
        engines = [r for r in rows if " engine" in r.actor]
        executor = rows[-1]
        assert [r.actor for r in engines] == [
            "a engine in the rollout executor",
            "b engine in the rollout executor",
        ]
        # in the driver: one process's baseline, the driver's, and no Ray CPUs of its own
        assert (executor.actor, executor.cpus, executor.memory.terms["baseline"]) == (name, cpus, 300 << 20)
        assert all(r.node is executor.node is nodes[0] for r in engines)
        assert all(not r.memory.terms.get("baseline") for r in engines)
        trainers = [r for r in rows if "trainer" in r.actor]
        assert all(r.memory.terms.get("baseline") == 300 << 20 for r in trainers)


def test_a_dead_executor_that_hosts_the_engines_is_named_as_such():
    # Wrong if the one line of a run whose executor died (and with it every engine it hosted) named
    # an engine actor that never existed, or did not say the engines went with it
    from types import SimpleNamespace

    from hpref.rl.engines.host import HostedEngine
    from hpref.runtime.ray_cluster import actor_names

    def actor(hex_id):
        return SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: hex_id))

    executor = actor("e0")
    handles = SimpleNamespace(
        executor=executor,
        engines={p: HostedEngine(executor, p) for p in ("a", "b")},
        trainers={p: SimpleNamespace(ranks=[actor(f"t{p}")]) for p in ("a", "b")},
    )
    assert actor_names(handles) == {
        "ta": "policy 'a': trainer actor",
        "tb": "policy 'b': trainer actor",
        "e0": "the rollout executor actor (shared by all policies, hosting the engines)",
    }
    # the executor and its engines in the driver: no actor of theirs to name (a trainer's death
    # is still named; nothing answers for the driver's own objects)
    from hpref.rl.control.actors import InDriverExecutor
    from hpref.rl.engines.host import InProcessEngine

    here = InProcessEngine(SimpleNamespace(), "a")
    try:
        in_driver = InDriverExecutor(SimpleNamespace(engines={"a": here, "b": here}))
        handles = SimpleNamespace(executor=in_driver, engines=in_driver.engines, trainers=handles.trainers)
        assert actor_names(handles) == {"ta": "policy 'a': trainer actor", "tb": "policy 'b': trainer actor"}
    finally:
        in_driver.stop()


def test_an_engine_in_this_process_calls_from_a_thread_on_its_own_torch_threads(monkeypatch):
    # Wrong if an engine hosted in the executor (in the driver's process, by default) generated on
    # every core whatever `rl.engine.threads` says: OpenMP keeps a thread count per thread, so the
    # count the engine set in the thread that built it does not reach the thread its calls run in
    # (measured: two SmolLM2 engines in the driver on two threads each, 2x their trainers' step time)
    import asyncio
    import threading
    from types import SimpleNamespace

    import torch

    from hpref.rl.engines.host import InProcessEngine

    set_in = []
    monkeypatch.setattr(
        torch, "set_num_threads", lambda n: set_in.append((threading.current_thread().name, n))
    )
    engine = InProcessEngine(
        SimpleNamespace(get_version=lambda: threading.current_thread().name), "a", threads=3
    )

    async def two_calls():
        return [await engine.get_version.remote(), await engine.get_version.remote()]

    try:
        first, second = asyncio.run(two_calls())
    finally:
        engine.stop_thread()
    assert first == second and first.startswith("engine-a")  # one thread of its own, calls in it
    assert set_in == [(first, 3)]  # set there, once, to the engine's count
