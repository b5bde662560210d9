"""Model families (`hpref.families.ModelFamilySpec`, the `register_model_families` hook): the
built-ins register theirs through the hook like any plugin, a plugin's family is found and what it
declares decides what `Components` does, and a `register_models` plugin keeps working unchanged."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from hpref.components import Components
from hpref.errors import ComponentError, UserError
from hpref.families import FamilySupport, ModelBuilder, ModelFamilySpec
from hpref.hookspecs import hookimpl
from hpref.plugins import JUDGE_DEFAULTS, load_plugins
from hpref.protocols import ReducesOwnGradients
from hpref.recipe import recipe_from_dict


@pytest.fixture(autouse=True)
def _fresh_registry(fresh_registry):
    """Every test here registers plugins of its own: each starts and ends with none loaded."""


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    head: str = "judge"


class _Model:
    """A model object with what `PreferenceModel` guarantees (nothing is run on it here)."""

    def __init__(self, head: str = "judge") -> None:
        self.head_kind = head
        self.paired = head == "reward"
        self.pooling = "last"
        self.fresh_head = True
        self.exports_sequence_classifier = False
        self.head = None
        self.data_parallel = None

    def set_output_bias(self, bias) -> None:
        self.bias = bias


def _recipe(model_name: str, model: dict | None = None, **extra):
    return recipe_from_dict(
        {
            "run": {"name": "t"},
            "model": {"name": model_name, **(model or {})},
            "dataset": {"train": {"name": "synthetic-arena", "num_battles": 10}},
            **extra,
        }
    )


def test_builtin_families_register_through_the_hook():
    """Wrong if a built-in family bypassed `register_model_families` (a plugin could not do the
    same) or a built-in model were registered outside its family."""
    registry = load_plugins()
    plugins = {name: plugin for name, (_, plugin) in registry.families.items()}
    assert plugins["transformers"] == "hpref.builtin.models"
    assert plugins["megatron-core"] == "hpref.builtin.megatron"
    for name in ("hf-classifier", "tiny-llama", "minilm", "smollm2"):
        assert registry.family_of(name).name == "transformers"
    megatron = registry.family_of("megatron-gpt")
    assert megatron.name == "megatron-core" and megatron.parallelize is not None
    assert not megatron.supports.lora and megatron.supports.poolings == {"last"}
    transformers = registry.family_of("tiny-llama")
    assert transformers.parallelize is None and transformers.supports.lora  # FSDP2, LoRA
    for component in registry.components["model"].values():
        assert component.family is not None and component in [
            registry.get("model", b.name) for b in component.family.models
        ]


def _family_plugin(spec: ModelFamilySpec):
    class FamilyPlugin:
        __name__ = "family-plugin"

        @hookimpl
        def register_model_families(self, register):
            register(spec)

    return FamilyPlugin()


def test_a_plugin_family_is_found_and_its_parallelize_is_used():
    calls = []

    def parallelize(model, *, param_dtype, activation_checkpointing):
        calls.append((model, param_dtype, activation_checkpointing))
        return model

    spec = ModelFamilySpec(
        name="fake-family",
        models=(ModelBuilder("fake", _Config, lambda config, **kw: _Model(config.head), "a fake"),),
        parallelize=parallelize,
    )
    registry = load_plugins(extra=[_family_plugin(spec)])
    component = registry.get("model", "fake")
    assert component.plugin == "family-plugin" and component.description == "a fake"
    assert registry.family_of("fake") is spec
    parts = Components(_recipe("fake"), registry)
    model = parts.model()
    assert parts.parallelize(model, param_dtype="bf16", activation_checkpointing=True) is model
    assert calls == [(model, "bf16", True)]


def test_a_family_without_lora_is_refused_before_anything_is_built():
    built = []
    spec = ModelFamilySpec(
        name="no-lora",
        models=(ModelBuilder("fused", _Config, lambda config, **kw: built.append(1) or _Model()),),
        supports=FamilySupport(lora=False, no_lora_reason="its linears are fused"),
    )
    registry = load_plugins(extra=[_family_plugin(spec)])
    parts = Components(_recipe("fused", lora={"r": 4}), registry)
    with pytest.raises(UserError) as caught:
        parts.model()
    assert str(caught.value) == (
        "[lora] is not supported with model 'fused' (its linears are fused); remove [lora] to "
        "fine-tune it fully"
    )
    assert "\n" not in str(caught.value) and built == []


def test_megatron_refuses_lora_with_the_same_line_without_megatron_installed():
    """The megatron-core family declares no LoRA: refused from its spec, so even before
    megatron-core is imported."""
    registry = load_plugins()
    recipe = recipe_from_dict(
        {
            "run": {"name": "t"},
            "model": {"name": "megatron-gpt", "path": "/nowhere"},
            "dataset": {"train": {"name": "synthetic-arena", "num_battles": 10}},
            "lora": {"r": 4},
        }
    )
    with pytest.raises(UserError, match=r"^\[lora\] is not supported with model 'megatron-gpt' \(its layers"):
        Components(recipe, registry).model()


def test_a_model_outside_what_its_family_declares_is_refused():
    spec = ModelFamilySpec(
        name="judges-only",
        models=(ModelBuilder("judge-only", _Config, lambda config, **kw: _Model(config.head)),),
        capabilities=(ReducesOwnGradients,),
        supports=FamilySupport(heads=frozenset({"judge"})),
    )
    registry = load_plugins(extra=[_family_plugin(spec)])
    recipe = _recipe("judge-only", model={"head": "reward"})
    with pytest.raises(ComponentError) as caught:
        Components(recipe, registry).model()
    message = str(caught.value)
    assert "lacks ReducesOwnGradients, which family 'judges-only' declares" in message
    assert "it is a reward model, and family 'judges-only' declares ['judge']" in message


def test_a_family_registered_twice_names_both_plugins():
    spec = ModelFamilySpec(name="transformers", models=())
    with pytest.raises(ComponentError, match=r"model family 'transformers' is registered twice"):
        load_plugins(extra=[_family_plugin(spec)])


class _Bare:
    """A model of a plugin written for `register_models`, before the family attributes."""


def test_register_models_plugin_gets_a_default_family_and_the_judge_attributes():
    class OldPlugin:
        __name__ = "old-plugin"

        @hookimpl
        def register_models(self, register):
            def build(config, *, num_labels=3, device="cpu", meta=False):
                """An old-style model."""
                return _Bare()

            register(name="old", config=_Config, build=build)

    registry = load_plugins(extra=[OldPlugin()])
    component = registry.get("model", "old")
    assert component.plugin == "old-plugin" and component.description == "An old-style model."
    family = registry.family_of("old")
    assert family.name == "old" and family.parallelize is None and family.supports.lora
    model = Components(_recipe("old"), registry).model()
    assert {name: getattr(model, name) for name in JUDGE_DEFAULTS} == JUDGE_DEFAULTS
    assert model.fresh_head is False  # no set_output_bias: the trainer leaves its head alone


def test_a_family_hook_that_raises_drops_the_plugin_and_its_families():
    class Broken:
        __name__ = "broken"

        @hookimpl
        def register_model_families(self, register):
            register(ModelFamilySpec(name="half", models=(ModelBuilder("half", _Config, _Model),)))
            raise RuntimeError("boom")

    registry = load_plugins(extra=[Broken()])
    assert "half" not in registry.families and "half" not in registry.components["model"]
    assert any(f.name == "broken" and "register_model_families raised" in f.reason for f in registry.failed)
