"""The engine plugin point: `register_engines`, `[rl.engine]`, and the actor that hosts an engine."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import BaseModel

from hpref.errors import RecipeError
from hpref.hookspecs import hookimpl
from hpref.plugins import load_plugins
from hpref.recipe.rl import parse_rl_section
from hpref.rl.engines.transformers_engine import TransformersEngineConfig
from hpref.rl.protocols import EngineConfigBase
from tests.rl.tiny import TINY


@pytest.fixture(autouse=True)
def _fresh_registry(fresh_registry):
    """Every test here registers plugins of its own: each starts and ends with none loaded."""


class ReversedConfig(EngineConfigBase):
    suffix: str = "!"


class ReversedEngine:
    """A plugin's engine: the built-in one with every answer's text reversed (a visible change)."""

    def __init__(self, config, policy, model, env):
        from hpref.rl.engines.transformers_engine import EngineActor

        self.inner = EngineActor(policy, model, env=env)
        self.suffix = config.suffix

    def generate(self, *args, **kwargs):
        out = self.inner.generate(*args, **kwargs)
        return dataclasses.replace(out, texts=[t[::-1] + self.suffix for t in out.texts])

    def __getattr__(self, name):
        return getattr(self.inner, name)


class ReversedPlugin:
    __name__ = "reversed-engine"

    @hookimpl
    def register_engines(self, register):
        register(
            name="reversed",
            config=ReversedConfig,
            build=lambda config, *, policy, model, env=None: ReversedEngine(config, policy, model, env),
            description="reversed texts",
        )


def section(**over):
    data = {"defaults": {"model": TINY}, "policies": {"a": {}}}
    data.update(over)
    return parse_rl_section(data, "r.toml")


def test_the_builtin_engine_registers_through_the_hook():
    # Wrong if the transformers engine bypassed `register_engines` (then a vLLM plugin could not
    # stand in for it) or were not the default.
    engine = load_plugins().get("engine", "transformers")
    assert engine.plugin == "hpref.rl.engines.transformers_engine"
    assert engine.config is TransformersEngineConfig
    cfg = section()
    assert cfg.engine.name == "transformers" and cfg.engine_config == TransformersEngineConfig()
    assert section(engine={"threads": 2}).engine_config.threads == 2


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"name": "sglang"}, "r.toml: rl.engine.name: unknown engine 'sglang'; known: transformers, vllm"),
        ({"threads": 0}, "r.toml: rl.engine.threads: Input should be greater than or equal to 1, got 0"),
        ({"thread": 2}, "r.toml: rl.engine.thread: unknown key (did you mean 'threads'?)"),
    ],
)
def test_bad_engine_settings_name_the_key(engine, message):
    with pytest.raises(RecipeError) as err:
        section(engine=engine)
    assert str(err.value).startswith(message), str(err.value)


def test_a_plugin_engine_is_chosen_by_name_and_hosted(monkeypatch, tmp_path):
    # Wrong if `[rl.engine] name` did not reach the actor that builds the engine, or the host
    # did not forward the engine calls the executor and the driver make.
    pytest.importorskip("torch")
    from hpref.rl.engines.host import EngineHost
    from hpref.rl.rollout.prompts import build_prompt_source, rollout_prompts

    monkeypatch.setenv("HPREF_CACHE", str(tmp_path / "cache"))
    load_plugins(extra=[ReversedPlugin()])
    cfg = section(engine={"name": "reversed", "suffix": "?"})
    assert cfg.engine_config == ReversedConfig(suffix="?")
    host = EngineHost(cfg.engine.name, cfg.engine_config, "a", cfg.policies["a"].model)
    plain = EngineHost("transformers", {}, "a", cfg.policies["a"].model)
    prompts = rollout_prompts(build_prompt_source(cfg), cfg.rollout, 0)[:2]
    got = host.generate(prompts, 2, 5, 1.0, 0, 7)
    want = plain.generate(prompts, 2, 5, 1.0, 0, 7)
    assert got.completions == want.completions  # same weights and seed: same tokens
    assert got.texts == [t[::-1] + "?" for t in want.texts]
    state = plain.engine.model.state_dict()
    host.begin_update(3)
    host.load_weights(state)
    assert host.commit_update() == 3 and host.get_version() == 3


def test_a_request_is_a_value_that_crosses_ray_as_it_was_made():
    """Wrong if a `GenerationRequest` changed on its way to the engine's actor (Ray pickles it), could
    be changed after it was made (the batcher and the engine read the same one), held a recipe's
    stop strings as a list (a knob compares with its off value, a tuple), or counted its answers
    other than `group_size` per prompt (the batcher's and the engine's passes)."""
    import pickle

    from hpref.rl.rollout_types import GenerationRequest

    asked = GenerationRequest([("hi",), ("a", "b", "c")], 3, 8, 0.7, seed=5, adapter="b", stop=["</a>"])
    assert pickle.loads(pickle.dumps(asked)) == asked
    assert asked.stop == ("</a>",) and asked.rows == 6
    assert (asked.top_k, asked.greedy, asked.top_p, asked.min_p, asked.repetition_penalty) == (
        0,
        False,
        1.0,
        0.0,
        1.0,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        asked.seed = 6  # type: ignore[misc]


def test_a_sleeping_engine_holds_generation_until_it_wakes(monkeypatch, tmp_path):
    # Wrong if a colocated engine (`rl.colocate`) generated while its trainer steps (both would hold
    # the GPU's memory at once), or if a generate that arrived during the step were lost or hung
    # after the wake. The built-in engine has nothing to free on the CPU: what is checked is the host.
    pytest.importorskip("torch")
    import threading
    import time

    from hpref.rl.engines.host import EngineHost
    from hpref.rl.rollout.prompts import build_prompt_source, rollout_prompts

    monkeypatch.setenv("HPREF_CACHE", str(tmp_path / "cache"))
    load_plugins()
    cfg = section()
    host = EngineHost("transformers", {}, "a", cfg.policies["a"].model)
    prompts = rollout_prompts(build_prompt_source(cfg), cfg.rollout, 0)[:1]
    host.sleep()
    done = []
    worker = threading.Thread(target=lambda: done.append(host.generate(prompts, 2, 3, 1.0, 0, 1)))
    worker.start()
    time.sleep(0.5)
    assert not done  # asleep: the rollout waits
    host.wake()
    worker.join(timeout=30)
    assert len(done) == 1 and len(done[0].completions) == 2


class BareConfig(BaseModel):
    """A plugin engine's config that declares its own settings only (no `EngineConfigBase`)."""

    threads: int = 1


class BarePlugin:
    __name__ = "bare-engine"

    @hookimpl
    def register_engines(self, register):
        register(name="bare", config=BareConfig, build=lambda config, **kw: None, description="bare")


def test_an_engine_config_without_what_hpref_rl_reads_is_refused_when_the_recipe_loads():
    """A plugin's engine config that does not inherit `EngineConfigBase` is refused in one line at
    recipe load, naming the engine and what its config lacks; and the attributes checked are exactly
    the `EngineConfig` protocol's. If this fails, such a plugin fails later with an AttributeError in
    the placement or the executor, or the check and the protocol have drifted apart."""
    from hpref.recipe.rl_components import ENGINE_CONFIG_ATTRIBUTES
    from hpref.rl.protocols import EngineConfig

    declared = set(EngineConfig.__annotations__) | {
        name for name, value in vars(EngineConfig).items() if callable(value) and not name.startswith("_")
    }
    assert set(ENGINE_CONFIG_ATTRIBUTES) == declared
    load_plugins(extra=[BarePlugin()])
    with pytest.raises(RecipeError) as refused:
        section(engine={"name": "bare"})
    message = str(refused.value)
    assert "\n" not in message and message.startswith("r.toml: rl.engine.name: the 'bare' engine's config")
    assert "serves_adapters" in message and "EngineConfigBase" in message
