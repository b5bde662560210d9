"""The built-in rewards, engines, algorithms and trainer backends against the seams they plug into
(`hpref.rl.protocols`).

Wrong if a built-in lost a method the rollout executor or the engine's Ray actor calls, or took it
with other parameter names than the protocol (a plugin written against the protocol would break).
"""

from __future__ import annotations

import inspect
import typing

import pytest

from hpref.plugins import load_plugins
from hpref.recipe.rl import PolicyConfig
from hpref.rl.protocols import (
    Algorithm,
    Engine,
    EngineConfig,
    EngineConfigBase,
    GroundTruthReward,
    PairJudge,
    Reward,
    TrainerBackend,
)
from hpref.rl.trainer.backends import trainer_backend


def _protocol_methods(protocol: type) -> dict[str, inspect.Signature]:
    """The methods a protocol asks for (its own and its protocol bases'), with their signatures."""
    methods = {}
    for klass in reversed(protocol.__mro__):
        if klass in (typing.Protocol, typing.Generic, object) or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if inspect.isfunction(value) and not name.startswith("_"):
                methods[name] = inspect.signature(value)
    return methods


def _check_class(cls: type, protocol: type) -> None:
    """Every method of `protocol` on `cls`, with the same parameters, then optional ones of its own (a
    rule reward's `rows`, passed only to a reward that `wants_rows`); a forwarder taking `*args,
    **kwargs`, like the engine's Ray host, takes anything."""
    for name, wanted in _protocol_methods(protocol).items():
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__name__} has no {name}() ({protocol.__name__})"
        # `ray.remote(cls)` adds a `_ray_trace_ctx` keyword to the methods of the class it wraps
        have = {k: p for k, p in inspect.signature(impl).parameters.items() if k != "_ray_trace_ctx"}
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in have.values()):
            continue
        names = list(have)
        assert names[: len(wanted.parameters)] == list(wanted.parameters), (cls.__name__, name, names)
        extra = names[len(wanted.parameters) :]
        assert all(have[k].default is not inspect.Parameter.empty for k in extra), (cls.__name__, name, extra)


def test_the_protocols_ask_for_what_the_rollout_executor_calls():
    assert set(_protocol_methods(Reward)) == {"score_groups"}
    assert set(_protocol_methods(GroundTruthReward)) == {"score_groups", "true_utility"}
    assert set(_protocol_methods(Engine)) == {
        "generate",
        "generate_batch",
        "weight_dtype",
        "weight_channel_device",
        "connect_weight_channel",
        "receive_weights",
        "sleep",
        "wake",
        "begin_update",
        "load_weights",
        "commit_update",
        "abort_update",
        "get_version",
    }


def test_builtin_rewards_are_rewards():
    from hpref.builtin.remote_reward import RemoteReward
    from hpref.builtin.rewards import JudgeReward, RuleReward

    registry = load_plugins()
    rule = registry.get("reward", "rule")
    for mode in ("utility", "pairwise"):
        reward = rule.build(rule.config.model_validate({"mode": mode}))
        assert isinstance(reward, Reward) and isinstance(reward, GroundTruthReward)
    _check_class(RuleReward, GroundTruthReward)
    _check_class(JudgeReward, GroundTruthReward)  # building one needs an exported judge model
    _check_class(RemoteReward, GroundTruthReward)  # building one needs a running server
    assert {c.name for c in registry.components["reward"].values()} >= {"rule", "judge", "remote"}


def test_builtin_engines_are_engines():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hpref.recipe.rl import PolicyModelConfig
    from hpref.rl.engines.host import EngineHost
    from hpref.rl.engines.transformers_engine import EngineActor
    from tests.rl.tiny import TINY

    component = load_plugins().get("engine", "transformers")
    engine = component.build(component.config(), policy="a", model=PolicyModelConfig(**TINY))
    assert isinstance(engine, Engine)
    _check_class(EngineActor, Engine)
    _check_class(EngineHost, Engine)  # the Ray actor around any engine forwards each method


def test_engine_configs_declare_what_placement_and_plan_read_and_a_plugins_gets_the_defaults():
    """Wrong if the `EngineConfig` protocol lost an attribute the placement, plan, shared-base checks
    or executor read, if a built-in engine's config did not satisfy it or changed a value those read
    (the transformers engine: CPU, float32, passes of 32 answers; vLLM: its own batches), or if a
    plugin's config inheriting `EngineConfigBase` did not get what a config without them got before
    the protocol (0.25 CPUs, no GPU, float32, no passes, no adapters, no knobs, no checks)."""
    from types import SimpleNamespace

    from hpref.recipe.rl_sampling import KNOBS_OFF
    from hpref.rl.engines.transformers_engine import TransformersEngineConfig
    from hpref.rl.engines.vllm_config import VLLMEngineConfig
    from hpref.rl.placement.resources import engine_resources

    attributes = {"serves_adapters", "sampling_knobs", "num_cpus", "num_gpus", "dtype", "batch_rows"}
    assert set(EngineConfig.__annotations__) == attributes
    assert set(_protocol_methods(EngineConfig)) == {"check_policies", "check_adapters"}

    class PluginConfig(EngineConfigBase):
        suffix: str = "!"

    # vLLM's config checks at validation that vLLM is installed: built unvalidated, its defaults
    built = [TransformersEngineConfig(), VLLMEngineConfig.model_construct(), PluginConfig()]
    for config in built:
        assert isinstance(config, EngineConfig), type(config).__name__
        _check_class(type(config), EngineConfig)
    read = [
        (
            c.serves_adapters,
            c.sampling_knobs,
            engine_resources(SimpleNamespace(engine_config=c)),
            c.dtype,
            c.batch_rows,
        )
        for c in built
    ]
    knobs = frozenset(KNOBS_OFF)
    assert read == [
        (True, knobs, (0.25, 0.0), "float32", 32),
        (True, knobs, (0.25, 0.0), "bfloat16", 0),
        (False, frozenset(), (0.25, 0.0), "float32", 0),
    ]
    assert PluginConfig().check_policies(None, ["a"], "r.toml") is None
    assert PluginConfig().check_adapters(None, ["a", "b"], "r.toml") is None
    assert set(TransformersEngineConfig.model_fields) == {
        "threads",
        "batch_rows",
        "num_cpus",
        "share_prefill",
        "prefill_precision",
    }  # a recipe sets these and nothing else: dtype and num_gpus are not the transformers engine's


def test_an_object_without_the_weight_updates_is_not_an_engine():
    class GenerateOnly:
        def generate(self, prompts, group_size, max_new_tokens, temperature, top_k=0, seed=0, greedy=False):
            return {}

    assert not isinstance(GenerateOnly(), Engine)


@pytest.mark.parametrize("name", ["transformers", "megatron"])
def test_every_registered_trainer_backend_satisfies_the_protocol(name):
    """Wrong if a built-in `trainer_backend` were not registered through `register_trainer_backends`,
    or were one the trainer could not drive through `TrainerBackend` alone (issue #27: no branch on
    the backend's name)."""
    assert set(load_plugins().components["trainer_backend"]) >= {"transformers", "megatron"}
    backend = trainer_backend(name)
    assert backend.name == name
    assert isinstance(backend, TrainerBackend)
    _check_class(type(backend), TrainerBackend)


def test_builtin_algorithms_are_algorithms_and_judging_rewards_judge_pairs():
    """Wrong if `grpo` / `online-dpo` were not registered through `register_algorithms` or lacked a
    method the trainer or executor calls, or if a reward whose config says `judges_pairs` could not
    give online DPO its verdicts (`PairJudge`)."""
    from hpref.builtin.rewards import JudgeReward, RuleReward
    from hpref.rl.algorithms.grpo import Grpo
    from hpref.rl.algorithms.online_dpo import OnlineDpo
    from hpref.rl.algorithms.registry import build_algorithm

    assert set(load_plugins().components["algorithm"]) >= {"grpo", "online-dpo"}
    for name, cls in (("grpo", Grpo), ("online-dpo", OnlineDpo)):
        algorithm = build_algorithm("a", PolicyConfig.model_validate({"algorithm": name}))
        assert isinstance(algorithm, Algorithm) and algorithm.name == name
        _check_class(cls, Algorithm)
    for cls in (RuleReward, JudgeReward):
        _check_class(cls, PairJudge)
    rule = RuleReward(load_plugins().get("reward", "rule").config())
    assert isinstance(rule, PairJudge)
