"""Plugin loading and the component registry.

One module-level plugin manager. `load_plugins()` is idempotent: it registers the built-in plugins,
then every third-party plugin from the `hpref` entry-point group (restricted by `HPREF_PLUGINS`),
then asks every plugin to register its components. A third-party plugin that fails to import, or
whose hook raises, is recorded with its reason (and its components, commands and hooks dropped)
instead of taking the CLI down; its name is surfaced when a recipe asks for a component nobody
provides. A built-in that raises is a bug in hpref and does propagate.

Models come in families (`hpref.families.ModelFamilySpec`, the `register_model_families` hook):
each model a family lists is registered as a `model` component that knows its family. A model
registered through the older `register_models` hook gets a family of its own with the default
spec, and its built model the judge's values of the attributes `hpref.protocols.PreferenceModel`
guarantees when it lacks them (`_with_judge_defaults`), so a plugin written for that hook keeps
working unchanged.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy
from pydantic import BaseModel

from hpref import hookspecs
from hpref.errors import ComponentError, did_you_mean
from hpref.families import Build, ModelBuilder, ModelFamilySpec

ENTRY_POINT_GROUP = "hpref"
PLUGINS_ENV = "HPREF_PLUGINS"

#: Component kinds, each with the hook that registers it. Order is the order `hpref components` shows.
KINDS: dict[str, str] = {
    "model": "register_models",
    "dataset": "register_datasets",
    "scheduler": "register_schedulers",
    "optimizer": "register_optimizers",
    "formatter": "register_formatters",
    "prompts": "register_prompts",
    "reward": "register_rewards",
    "engine": "register_engines",
    "algorithm": "register_algorithms",
    "environment": "register_environments",
    "tool": "register_tools",
    "trainer_backend": "register_trainer_backends",
    "logger": "register_loggers",
}

BUILTIN_PLUGINS = (
    "hpref.builtin.schedulers",
    "hpref.builtin.optimizers",
    "hpref.builtin.datasets",
    "hpref.builtin.formatters",
    "hpref.builtin.models",
    "hpref.builtin.megatron",
    "hpref.builtin.prompts",
    "hpref.builtin.rewards",
    "hpref.rl.engines.transformers_engine",
    "hpref.rl.engines.vllm_engine",
    "hpref.rl.algorithms.builtin",
    "hpref.rl.environments.builtin",
    "hpref.rl.environments.calculator",
    "hpref.rl.trainer.backends",
    "hpref.builtin.loggers",
)


@dataclass(frozen=True)
class Component:
    kind: str
    name: str
    config: type[BaseModel]
    build: Callable[..., Any]
    description: str
    plugin: str
    #: the model family's spec, for a `model` component (None for every other kind)
    family: ModelFamilySpec | None = None

    def parameters(self) -> list[dict[str, Any]]:
        """Name, type, default, whether required, and description of each parameter, from the config
        schema. A required parameter has no default (`default` None, `required` True), so a string
        default can never be mistaken for the marker."""
        rows = []
        for pname, info in self.config.model_fields.items():
            required = info.is_required()
            rows.append(
                {
                    "name": pname,
                    "type": _type_name(info.annotation),
                    "default": None if required else info.get_default(call_default_factory=True),
                    "required": required,
                    "description": info.description or "",
                }
            )
        return rows


def _type_name(annotation: Any) -> str:
    """A short, readable type: `int | None`, `'last' | 'first'`, `list[str]`."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None and args:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


@dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...]
    builtin: bool


@dataclass
class FailedPlugin:
    name: str
    distribution: str
    reason: str


@dataclass
class Registry:
    components: dict[str, dict[str, Component]] = field(default_factory=lambda: {k: {} for k in KINDS})
    failed: list[FailedPlugin] = field(default_factory=list)
    #: family name -> (its spec, the plugin that registered it)
    families: dict[str, tuple[ModelFamilySpec, str]] = field(default_factory=dict)

    def add_family(self, spec: ModelFamilySpec, plugin: str) -> None:
        """A model family and each of its models (a `model` component that knows its family)."""
        existing = self.families.get(spec.name)
        if existing is not None:
            raise ComponentError(
                f"model family '{spec.name}' is registered twice: by plugin '{existing[1]}' and by "
                f"plugin '{plugin}'"
            )
        self.families[spec.name] = (spec, plugin)
        for builder in spec.models:
            self.add(
                Component(
                    "model",
                    builder.name,
                    builder.config,
                    builder.build,
                    _description(builder.description, builder.build),
                    plugin,
                    family=spec,
                )
            )

    def family_of(self, model_name: str) -> ModelFamilySpec:
        """The family of the model component `model_name` (a `ComponentError` for an unknown one)."""
        family = self.get("model", model_name).family
        assert family is not None, f"model '{model_name}' was registered without a family"
        return family

    def add(self, component: Component) -> None:
        existing = self.components[component.kind].get(component.name)
        if existing is not None:
            raise ComponentError(
                f"{component.kind} '{component.name}' is registered twice: by plugin '{existing.plugin}' "
                f"and by plugin '{component.plugin}'"
            )
        self.components[component.kind][component.name] = component

    def get(self, kind: str, name: str) -> Component:
        """The component `name` of `kind`, or a `ComponentError` that suggests the nearest name."""
        if kind not in self.components:
            raise ComponentError(f"unknown component kind '{kind}'{did_you_mean(kind, KINDS)}")
        try:
            return self.components[kind][name]
        except KeyError:
            pass
        known = sorted(self.components[kind])
        hint = did_you_mean(name, known)
        if not hint and self.failed:
            broken = ", ".join(f"'{f.name}' ({f.reason})" for f in self.failed)
            hint = f"; plugins that failed to load and may provide it: {broken}"
        elif not hint:
            hint = f"; known: {', '.join(known) or 'none'}"
        raise ComponentError(f"unknown {kind} '{name}'{hint}")


class _Loader:
    """Holds the plugin manager and registry; `load_plugins()` uses one module-level instance."""

    def __init__(self) -> None:
        self.pm: pluggy.PluginManager | None = None
        self.registry: Registry | None = None
        self.infos: dict[str, PluginInfo] = {}

    def reset(self) -> None:
        self.pm = None
        self.registry = None
        self.infos = {}


_state = _Loader()


def _allowed_third_party() -> set[str] | None:
    """Entry-point names allowed by HPREF_PLUGINS; None when unset (all allowed)."""
    value = os.environ.get(PLUGINS_ENV)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def _hook_names(module: object) -> tuple[str, ...]:
    return tuple(
        sorted(
            n for n in dir(module) if n.startswith("register_") and hasattr(getattr(module, n), "hpref_impl")
        )
    )


def plugin_manager() -> pluggy.PluginManager:
    load_plugins()
    assert _state.pm is not None
    return _state.pm


def load_plugins(extra: list[object] | None = None) -> Registry:
    """Load built-in and third-party plugins once and return the component registry.

    `extra` plugin objects (used by tests) are registered beside the others; passing them forces a
    reload so the registry reflects them.
    """
    if _state.registry is not None and not extra:
        return _state.registry
    _state.reset()
    pm = pluggy.PluginManager("hpref")
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    version = importlib.import_module("hpref").__version__

    for module_name in BUILTIN_PLUGINS:
        module = importlib.import_module(module_name)
        pm.register(module, name=module_name)
        _state.infos[module_name] = PluginInfo(module_name, "hpref", version, _hook_names(module), True)

    allowed = _allowed_third_party()
    entry_points = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    installed = {ep.name for ep in entry_points}
    for name in sorted((allowed or set()) - installed):  # a typo in HPREF_PLUGINS must not pass silently
        hint = did_you_mean(name, installed) or f"; installed: {', '.join(sorted(installed)) or 'none'}"
        registry.failed.append(FailedPlugin(name, "-", f"named in {PLUGINS_ENV} but not installed{hint}"))
    for ep in entry_points:
        if allowed is not None and ep.name not in allowed:
            continue
        dist = ep.dist.name if ep.dist else "?"
        dist_version = ep.dist.version if ep.dist else "?"
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must not take the CLI down
            registry.failed.append(FailedPlugin(ep.name, dist, f"{type(exc).__name__}: {exc}"))
            continue
        if pm.is_registered(module):
            continue
        pm.register(module, name=ep.name)
        _state.infos[ep.name] = PluginInfo(ep.name, dist, dist_version, _hook_names(module), False)

    for i, plugin in enumerate(extra or []):
        name = getattr(plugin, "__name__", None) or f"extra-{i}"
        pm.register(plugin, name=name)
        _state.infos[name] = PluginInfo(name, "(in-process)", "-", _hook_names(plugin), False)

    pm.check_pending()  # a misspelt hook name in a plugin is an error, not silently ignored

    for impl in pm.hook.register_model_families.get_hookimpls():
        if not pm.is_registered(impl.plugin):
            continue

        def register_family(spec: ModelFamilySpec, *, _plugin: str = pm.get_name(impl.plugin) or "?") -> None:
            registry.add_family(spec, _plugin)

        _call_plugin_hook(pm, registry, impl, "register_model_families", register=register_family)

    for kind, hook_name in KINDS.items():
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            plugin_name = pm.get_name(impl.plugin) or "?"
            if not pm.is_registered(impl.plugin):  # dropped by an earlier hook's failure
                continue

            def register(
                name: str,
                config: type[BaseModel],
                build: Callable[..., Any],
                description: str | None = None,
                *,
                _kind: str = kind,
                _plugin: str = plugin_name,
            ) -> None:
                if _kind == "model":  # a model without a family: one of its own, the defaults'
                    builder = ModelBuilder(
                        name, config, _with_judge_defaults(build), _description(description, build)
                    )
                    registry.add_family(ModelFamilySpec.for_builder(builder), _plugin)
                    return
                registry.add(Component(_kind, name, config, build, _description(description, build), _plugin))

            _call_plugin_hook(pm, registry, impl, hook_name, register=register)

    _state.pm = pm
    _state.registry = registry
    return registry


def _description(description: str | None, build: Callable[..., Any]) -> str:
    """The one line `hpref components` shows: the given one, else the first of build's docstring."""
    if description is not None:
        return description
    return (build.__doc__ or "").strip().splitlines()[0] if build.__doc__ else ""


#: What a judge model is, for a `register_models` model that predates these attributes
#: (`hpref.protocols.PreferenceModel` guarantees them to the code that reads them).
JUDGE_DEFAULTS: dict[str, Any] = {
    "head_kind": "judge",
    "paired": False,
    "pooling": "last",
    "fresh_head": False,
    "exports_sequence_classifier": False,
    "head": None,
    "data_parallel": None,
}


def _with_judge_defaults(build: Build) -> Build:
    """`build`, whose model is given each `JUDGE_DEFAULTS` attribute it does not have (the one place
    a model is asked what it has: the compatibility of the older hook)."""

    @functools.wraps(build)
    def build_with_defaults(*args: Any, **kwargs: Any) -> Any:
        model = build(*args, **kwargs)
        for name, value in JUDGE_DEFAULTS.items():
            if not hasattr(model, name):
                setattr(model, name, value)
        if not callable(getattr(model, "set_output_bias", None)):
            model.fresh_head = False  # nothing to set a prior with: the head is left as built
        return model

    return build_with_defaults


def _call_plugin_hook(
    pm: pluggy.PluginManager, registry: Registry, impl: Any, hook_name: str, **kwargs: Any
) -> bool:
    """Run one plugin's implementation of a hook. If a third-party one raises, the plugin is dropped
    whole (unregistered, its components removed) and listed as failed, so `--help` and every recipe
    that does not use it still work. Duplicate names stay errors: they are the user's to resolve."""
    name = pm.get_name(impl.plugin) or "?"
    try:
        impl.function(**kwargs)
        return True
    except ComponentError:
        raise
    except Exception as exc:
        info = _state.infos.get(name)
        if info is None or info.builtin:
            raise
        pm.unregister(impl.plugin)
        del _state.infos[name]
        for by_name in registry.components.values():
            for comp_name in [n for n, c in by_name.items() if c.plugin == name]:
                del by_name[comp_name]
        for family_name in [n for n, (_, plugin) in registry.families.items() if plugin == name]:
            del registry.families[family_name]
        registry.failed.append(
            FailedPlugin(name, info.distribution, f"{hook_name} raised {type(exc).__name__}: {exc}")
        )
        return False


def register_plugin_commands(app: Any) -> None:
    """Let every plugin add its subcommands to the Typer `app` (a plugin that raises is dropped)."""
    registry = load_plugins()
    pm = plugin_manager()
    for impl in pm.hook.register_commands.get_hookimpls():
        if not pm.is_registered(impl.plugin):
            continue
        before = (len(app.registered_commands), len(app.registered_groups))
        if not _call_plugin_hook(pm, registry, impl, "register_commands", app=app):
            del app.registered_commands[before[0] :]  # what it added before raising
            del app.registered_groups[before[1] :]


def plugin_infos() -> list[PluginInfo]:
    load_plugins()
    return list(_state.infos.values())


def components_by_plugin() -> dict[str, list[Component]]:
    registry = load_plugins()
    out: dict[str, list[Component]] = {}
    for kind_components in registry.components.values():
        for comp in kind_components.values():
            out.setdefault(comp.plugin, []).append(comp)
    return out


def plugin_listing() -> dict[str, list[dict[str, Any]]]:
    """`hpref plugins --json`: every loaded plugin (version, distribution, hooks, components) and
    every one that failed to load."""
    registry = load_plugins()
    provided = components_by_plugin()
    rows = [
        {
            "name": info.name,
            "version": info.version,
            "distribution": info.distribution,
            "builtin": info.builtin,
            "hooks": list(info.hooks),
            "components": [f"{c.kind}:{c.name}" for c in provided.get(info.name, [])],
        }
        for info in plugin_infos()
    ]
    failed = [{"name": f.name, "distribution": f.distribution, "error": f.reason} for f in registry.failed]
    return {"plugins": rows, "failed": failed}


def component_kinds(kind: str | None) -> list[str]:
    """The kinds `hpref components [KIND]` lists: `kind` (singular or plural), or every kind; a
    `ComponentError` for an unknown one."""
    if kind is None:
        return list(KINDS)
    singular = kind[:-1] if kind not in KINDS and kind.endswith("s") else kind
    if singular not in KINDS:
        raise ComponentError(
            f"unknown component kind '{kind}'{did_you_mean(kind, KINDS)}; kinds: {', '.join(KINDS)}"
        )
    return [singular]


def component_listing(kinds: list[str]) -> list[dict[str, Any]]:
    """`hpref components --json`: each registered component of `kinds` with its parameters."""
    registry = load_plugins()
    return [
        {
            "kind": k,
            "name": c.name,
            "plugin": c.plugin,
            "description": c.description,
            "parameters": c.parameters(),
        }
        for k in kinds
        for c in sorted(registry.components[k].values(), key=lambda c: c.name)
    ]


def reset_plugins() -> None:
    """Forget loaded plugins (tests use this after changing HPREF_PLUGINS)."""
    _state.reset()
