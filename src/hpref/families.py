"""Model families: one `ModelFamilySpec` per family of models (torchtitan's `TrainSpec`, for hpref).

A family is the set of model components that are built, parallelised, reduced, checkpointed and
exported the same way: the transformers preference model (`transformers`: `hf-classifier`,
`tiny-llama`, `minilm`, `smollm2`, the gguf decoder included, `hpref.builtin.models`) and the
megatron-core one (`megatron-core`: `megatron-gpt`, `hpref.builtin.megatron`). A plugin registers a
family through the `register_model_families` hook exactly as the built-ins do:

    from hpref.hookspecs import hookimpl
    from hpref.families import FamilySupport, ModelBuilder, ModelFamilySpec

    @hookimpl
    def register_model_families(register):
        register(ModelFamilySpec(
            name="my-family",
            models=(ModelBuilder("my-model", MyConfig, build_my_model),),
            supports=FamilySupport(lora=False, no_lora_reason="its linears are fused"),
        ))

What the spec says and who reads it:

    models          the `[model]` components (name, pydantic config, `build`): registered like any
                    component, each knowing its family (`hpref.plugins.Registry.family_of`)
    parallelize     how the model is parallelised: `None` is hpref's FSDP2 over `model.blocks()`
                    (`hpref.models.parallelize`); a callable `(model, *, param_dtype,
                    activation_checkpointing) -> model` replaces it (megatron: tensor, pipeline and
                    sequence parallel inside, data parallel by a gradient all-reduce).
                    `Components.parallelize` calls it.
    capabilities    what every model of the family does itself beyond `PreferenceModel`, as
                    `hpref.protocols` capability Protocols: reduce and clip its gradients
                    (`ReducesOwnGradients`, the train step), store its checkpoint as views of the
                    full tensors (`ViewsCheckpoint`, train checkpoints and `hpref save`), load a
                    plain state (`LoadsPlainState`, `hpref init` weights). The code that uses one
                    asks the model with `isinstance`; `Components.model` refuses a model that lacks
                    a capability its family declares (otherwise it would silently take the FSDP2
                    path), so the spec and the model cannot disagree.
    supports        `FamilySupport`: LoRA, the head kinds (judge, reward), the poolings, the
                    transformers sequence-classifier export and the parallelisms; `Components.model`
                    refuses `[lora]` for a family without LoRA before anything is built, and a
                    built model outside the declared head kinds, poolings or export.

What one built model is (judge or reward, its pooling, whether its head is new) is read from the
model itself, as the attributes of `hpref.protocols.PreferenceModel`.

A plugin that only has the older `register_models` hook (a name, a config and a build) keeps
working: `hpref.plugins` wraps each such model in a family of its own with the defaults below
(`ModelFamilySpec.for_builder`), which are the transformers family's: FSDP2, LoRA, every head kind.

This module imports nothing of hpref's but the Protocols, so any layer above may name these types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from hpref.protocols import PreferenceModel

HeadKind = Literal["judge", "reward"]
Pooling = Literal["last", "first", "mean"]
#: fsdp2: hpref's sharding over data-parallel ranks; tensor / pipeline / sequence: megatron's
Parallelism = Literal["fsdp2", "tensor", "pipeline", "sequence"]

#: `parallelize(model, *, param_dtype, activation_checkpointing) -> model`
Parallelize = Callable[..., PreferenceModel]
#: `build(config, *, num_labels, device, meta) -> PreferenceModel` (`hpref.hookspecs.register_models`)
Build = Callable[..., PreferenceModel]


@dataclass(frozen=True)
class ModelBuilder:
    """One `[model]` component of a family: the name recipes spell, its pydantic config and its
    build (`hpref.hookspecs.register_models` documents the signature)."""

    name: str
    config: type[BaseModel]
    build: Build
    description: str | None = None


@dataclass(frozen=True)
class FamilySupport:
    """What a family can do; the defaults are the transformers family's (and a `register_models`
    plugin's)."""

    #: `[lora]` adapters (PEFT wraps the backbone's transformers linears: `hpref.models.adapters`)
    lora: bool = True
    #: why not, in the one-line refusal (`[lora] is not supported with model 'x' (<reason>); ...`)
    no_lora_reason: str = ""
    heads: frozenset[HeadKind] = frozenset({"judge", "reward"})
    poolings: frozenset[Pooling] = frozenset({"last", "first", "mean"})
    #: a reward model may export as transformers' one-label sequence classifier (`hpref save`)
    sequence_classifier_export: bool = True
    parallelisms: frozenset[Parallelism] = frozenset({"fsdp2"})

    def lora_refusal(self, model_name: str) -> str:
        reason = self.no_lora_reason or "its family declares no LoRA support"
        return (
            f"[lora] is not supported with model '{model_name}' ({reason}); remove [lora] to fine-tune "
            "it fully"
        )


@dataclass(frozen=True)
class ModelFamilySpec:
    """A model family: how its models are built, parallelised, reduced, checkpointed and what they
    support (see the module docstring)."""

    name: str
    models: tuple[ModelBuilder, ...]
    description: str = ""
    parallelize: Parallelize | None = None
    capabilities: tuple[type, ...] = ()
    supports: FamilySupport = field(default_factory=FamilySupport)

    @classmethod
    def for_builder(cls, builder: ModelBuilder) -> ModelFamilySpec:
        """The family a `register_models` model gets: its own, with the defaults."""
        return cls(name=builder.name, models=(builder,), description=builder.description or "")

    def problems(self, model: PreferenceModel) -> list[str]:
        """How a built model disagrees with this spec (empty when it does not): a declared
        capability it lacks, or a head kind, pooling or export the family does not declare."""
        out = [
            f"it lacks {protocol.__name__}, which family '{self.name}' declares"
            for protocol in self.capabilities
            if not isinstance(model, protocol)
        ]
        supports = self.supports
        if model.head_kind not in supports.heads:
            out.append(
                f"it is a {model.head_kind} model, and family '{self.name}' declares {sorted(supports.heads)}"
            )
        if model.pooling not in supports.poolings:
            out.append(
                f"it pools '{model.pooling}', and family '{self.name}' declares {sorted(supports.poolings)}"
            )
        if model.exports_sequence_classifier and not supports.sequence_classifier_export:
            out.append(f"it exports a sequence classifier, which family '{self.name}' does not declare")
        return out
