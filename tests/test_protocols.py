"""Every built-in component satisfies its seam's Protocol (`hpref.protocols`), signatures included.

A `runtime_checkable` isinstance only sees that the members exist; `assert_conforms` also checks that
each method accepts the Protocol's parameters (same names, same kinds), so a built-in that drifts
from the contract a plugin is written against fails here.
"""

from __future__ import annotations

import csv
import inspect
import json
import os
import typing

import pytest

from hpref import protocols
from hpref.data.records import LABELS
from hpref.plugins import KINDS, load_plugins
from tests.conftest import TINY_LLAMA

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _fresh_registry(tmp_path_factory, monkeypatch, fresh_registry):
    monkeypatch.setenv("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))


def _methods(protocol: type) -> dict[str, typing.Callable]:
    own = {}
    for klass in protocol.__mro__:
        if klass in (typing.Protocol, typing.Generic, object):
            continue
        for name, value in vars(klass).items():
            if callable(value) and not name.startswith("_"):
                own.setdefault(name, value)
    return own


def assert_conforms(obj: object, protocol: type) -> None:
    """isinstance, then every Protocol method's parameters present in the object's method with the
    same kind (positional or keyword-only); extra optional parameters are allowed."""
    assert isinstance(obj, protocol), f"{type(obj).__name__} lacks a member of {protocol.__name__}"
    for name, spec in _methods(protocol).items():
        implementation = getattr(obj, name)
        have = inspect.signature(implementation).parameters
        for pname, param in inspect.signature(spec).parameters.items():
            if pname == "self":
                continue
            assert pname in have, f"{type(obj).__name__}.{name} has no parameter '{pname}'"
            positional = param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD)
            their = have[pname].kind
            if positional:
                assert their in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD), f"{name}({pname})"
            else:
                assert their in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD), f"{name}({pname})"
        for pname, param in have.items():  # what the object needs beyond the Protocol must be optional
            if pname not in inspect.signature(spec).parameters and param.kind not in (
                param.VAR_POSITIONAL,
                param.VAR_KEYWORD,
            ):
                assert param.default is not param.empty, f"{type(obj).__name__}.{name} requires '{pname}'"


def test_every_protocol_names_a_component_kind():
    assert set(protocols.PROTOCOLS) <= set(KINDS)
    assert {"model", "dataset", "formatter", "optimizer"} <= set(protocols.PROTOCOLS)


def _tiny_model():
    component = load_plugins().get("model", "tiny-llama")
    return component.build(component.config(**TINY_LLAMA), num_labels=3, device="cpu")


def test_builtin_models_are_preference_models():
    """tiny-llama is built and checked; the pretrained components (weights not in the test
    environment) are declared to build the same class, which the built one is."""
    from hpref.models import PreferenceModel

    model = _tiny_model()
    assert_conforms(model, protocols.PreferenceModel)
    for name, component in load_plugins().components["model"].items():
        if component.plugin != "hpref.builtin.models":
            continue
        # the module imports PreferenceModel for type checking only (torch stays out of --help)
        returns = typing.get_type_hints(component.build, localns={"PreferenceModel": PreferenceModel})[
            "return"
        ]
        assert returns is PreferenceModel, f"model '{name}' builds {returns}, not a PreferenceModel"


def _dataset_configs(tmp_path):
    """One small file per reader (Kaggle LMSYS arena CSV, HH-RLHF pairs) and a synthetic arena."""
    arena = tmp_path / "arena.csv"
    with open(arena, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "prompt", "response_a", "response_b", *LABELS])
        for i in range(3):
            writer.writerow([i, json.dumps([f"q{i}"]), json.dumps(["a"]), json.dumps(["b"]), 1, 0, 0])
    pairwise = tmp_path / "pairs.jsonl"
    rows = [
        {"chosen": f"\n\nHuman: q{i}\n\nAssistant: good", "rejected": f"\n\nHuman: q{i}\n\nAssistant: bad"}
        for i in range(3)
    ]
    pairwise.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "arena": {"path": str(arena)},
        "pairwise": {"path": str(pairwise)},
        "synthetic-arena": {"num_battles": 6},
    }


def test_builtin_datasets_are_battle_sources(tmp_path):
    from hpref.data.records import Battle

    configs = _dataset_configs(tmp_path)
    builtin = {
        n: c for n, c in load_plugins().components["dataset"].items() if c.plugin == "hpref.builtin.datasets"
    }
    assert set(builtin) == set(configs)
    for name, component in builtin.items():
        source = component.build(component.config(**configs[name]), 0)
        assert_conforms(source, protocols.BattleSource)
        battles = list(source.battles())
        assert battles and all(isinstance(b, Battle) for b in battles), name


def test_builtin_formatters_are_formatters():
    model = _tiny_model()
    builtin = {
        n: c
        for n, c in load_plugins().components["formatter"].items()
        if c.plugin == "hpref.builtin.formatters"
    }
    assert set(builtin) >= {"pab", "papb", "answers"}
    for component in builtin.values():
        formatter = component.build(component.config(), model.tokenizer, 256)
        assert_conforms(formatter, protocols.Formatter)


def test_builtin_optimizers_are_optimizers():
    model = _tiny_model()
    builtin = {
        n: c
        for n, c in load_plugins().components["optimizer"].items()
        if c.plugin == "hpref.builtin.optimizers"
    }
    assert set(builtin) == {"adamw"}
    for component in builtin.values():
        assert_conforms(component.build(component.config(), model), protocols.Optimizer)


def _class_conforms(cls: type, protocol: type) -> None:
    """Every method of `protocol` on the class `cls`, with the Protocol's parameters (by name and
    kind) and nothing more it requires."""
    for name, spec in _methods(protocol).items():
        implementation = getattr(cls, name, None)
        assert callable(implementation), f"{cls.__name__} has no {name}() ({protocol.__name__})"
        want = list(inspect.signature(spec).parameters.items())
        have = list(inspect.signature(implementation).parameters.items())
        assert [(n, p.kind) for n, p in have if p.default is p.empty] == [
            (n, p.kind) for n, p in want if p.default is p.empty
        ], (cls.__name__, name)


CAPABILITIES = (
    protocols.ParallelizesItself,
    protocols.ReducesOwnGradients,
    protocols.ViewsCheckpoint,
    protocols.LoadsPlainState,
)


def test_the_megatron_family_has_the_capabilities_the_trainer_asks_for():
    """Wrong if a megatron model lost a method the train step, `Components.parallelize`, checkpoints
    or `hpref init` weights find it by (issue #27: `isinstance` with these Protocols, no name probes):
    the model would silently take the FSDP2 path instead."""
    pytest.importorskip("megatron.core")
    from hpref.models.megatron.pipeline import MegatronPipelineModel
    from hpref.models.megatron.preference import MegatronPreferenceModel

    for protocol in CAPABILITIES:
        _class_conforms(MegatronPreferenceModel, protocol)
        _class_conforms(MegatronPipelineModel, protocol)
    for protocol in (protocols.RunsOwnSchedule, protocols.KeysCheckpoint):
        _class_conforms(MegatronPipelineModel, protocol)


def test_a_transformers_model_has_none_of_them_and_fsdp2_syncs_on_demand():
    model = _tiny_model()
    every = (*CAPABILITIES, protocols.RunsOwnSchedule, protocols.KeysCheckpoint)
    assert not any(isinstance(model, protocol) for protocol in every)
    from torch.distributed.fsdp import FSDPModule

    _class_conforms(FSDPModule, protocols.SyncsGradientsOnDemand)
