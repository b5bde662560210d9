"""One place that turns a recipe into its parts: model, formatter, sources, optimizer, scheduler,
loss and the parallelise function (a "train spec", in torchtitan's words).

Every command that needs a component asks `Components(recipe)` for it, so a component is built with
the same arguments everywhere (the number of labels, the run seed, the max length, LoRA adapters):

    parts = Components(recipe)
    model = parts.model(device=device, meta=True)       # [model] (+ [lora] adapters)
    formatter = parts.formatter(model.tokenizer)        # [formatter] at train.max_length
    source = parts.source("train")                      # [dataset.train] with the run seed
    parts.parallelize(model, param_dtype=..., activation_checkpointing=...)
    optimizer = parts.optimizer(model)                  # [optimizer], after sharding
    scheduler = parts.scheduler(optimizer, total_steps) # [scheduler] as a LambdaLR
    loss = parts.loss(logits, labels)                   # per-sequence soft cross-entropy

Each part is built only when asked for (heavy imports stay inside), from the registry that
`load_plugins()` holds, so a third-party component is built exactly like a built-in one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from hpref.data.records import LABELS
from hpref.errors import ComponentError, UserError
from hpref.families import ModelFamilySpec
from hpref.plugins import Registry, load_plugins
from hpref.protocols import BattleSource, Formatter, Optimizer, PreferenceModel
from hpref.recipe import Recipe

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import PreTrainedTokenizerBase

#: Classes a preference model predicts: A wins, B wins, tie.
NUM_LABELS = len(LABELS)

#: `max_length` of the formatter when there is no recipe to say it (`hpref eval` of an export alone).
DEFAULT_MAX_LENGTH = 1024


@dataclass
class Components:
    """The recipe's components, each built on request (see the module docstring)."""

    recipe: Recipe
    registry: Registry = field(default_factory=load_plugins)

    @property
    def family(self) -> ModelFamilySpec:
        """The `[model]` component's family (`hpref.families`): how it parallelises, what it supports."""
        section = self.recipe.model
        if section is None:
            raise UserError("the recipe has no [model] section")
        return self.registry.family_of(section.name)

    def model(
        self, *, device: Any = "cpu", meta: bool = False, adapters: bool = True, quantize: bool = True
    ) -> PreferenceModel:
        """The `[model]` component with a `NUM_LABELS`-way head; with `adapters`, the recipe's LoRA
        adapters too (applied before sharding: FSDP2 must see which weights are frozen).

        QLoRA (`lora.quantize_base = "4bit"`) quantises the pretrained weights, so its model is
        built materialised on CPU even when `meta` asks for a meta build; the 4-bit weights are
        quantised on `device` and the rest moves there when sharded. `quantize=False` builds the
        same adapters on the full-precision base (the merged export).

        What the model's family does not support is refused: `[lora]` before anything is built, a
        built model outside its declared heads, poolings, export or capabilities after."""
        section = self.recipe.model
        if section is None:
            raise UserError("the recipe has no [model] section")
        family = self.family
        lora = self.recipe.lora if adapters else None
        if lora is not None and not family.supports.lora:
            raise UserError(family.supports.lora_refusal(section.name))
        if lora is not None and lora.quantize_base != "none" and not quantize:
            lora = lora.model_copy(update={"quantize_base": "none"})
        quantized = lora is not None and lora.quantize_base != "none"
        model = self.registry.get("model", section.name).build(
            section.config,
            num_labels=NUM_LABELS,
            device="cpu" if quantized else device,
            meta=meta and not quantized,
        )
        problems = family.problems(model)
        if problems:
            raise ComponentError(f"model '{section.name}' does not fit its family: {'; '.join(problems)}")
        if lora is not None:
            from hpref.models.adapters import apply_lora

            apply_lora(model, lora, device=device)
            if quantized:
                import torch

                model.target_device = torch.device(device)
        return model

    def formatter(self, tokenizer: PreTrainedTokenizerBase, max_length: int | None = None) -> Formatter:
        """The `[formatter]` component at `train.max_length` (or `max_length`)."""
        section = self.recipe.formatter
        length = max_length or self.recipe.train.max_length
        return self.registry.get("formatter", section.name).build(section.config, tokenizer, length)

    def source(self, split: Literal["train", "eval"]) -> BattleSource | None:
        """The `[dataset.<split>]` source of battles, seeded with the run seed; None without one."""
        section = getattr(self.recipe.dataset, split)
        if section is None:
            return None
        return self.registry.get("dataset", section.name).build(section.config, self.recipe.run.seed)

    def optimizer(self, model: PreferenceModel) -> Optimizer:
        """The `[optimizer]` component over the model's trainable parameters (call after sharding)."""
        section = self.recipe.optimizer
        return self.registry.get("optimizer", section.name).build(section.config, model)

    def scheduler(self, optimizer: Optimizer, total_steps: int) -> LambdaLR:
        """The `[scheduler]` component (a multiplier of each group's base LR) as a torch LambdaLR."""
        import torch

        section = self.recipe.scheduler
        multiplier = self.registry.get("scheduler", section.name).build(section.config, total_steps)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)

    @property
    def loss(self) -> Callable[..., Any]:
        """`loss(logits [n, C], labels [n, C]) -> [n]`: per-sequence soft-label cross-entropy."""
        from hpref.models.loss import soft_cross_entropy

        return soft_cross_entropy

    @property
    def parallelize(self) -> Callable[..., PreferenceModel]:
        """`parallelize(model, *, param_dtype, activation_checkpointing)`: the family's own
        (`ModelFamilySpec.parallelize`; megatron-gpt: tensor parallel inside, data parallel by
        gradient all-reduce), else FSDP2 in hpref's order."""
        own = self.family.parallelize
        if own is not None:
            return own
        from hpref.models.parallelize import parallelize

        return parallelize


def default_formatter(
    tokenizer: PreTrainedTokenizerBase, max_length: int | None = None, registry: Registry | None = None
) -> Formatter:
    """The `pab` formatter with its defaults: for scoring an exported model without a recipe."""
    component = (registry or load_plugins()).get("formatter", "pab")
    return component.build(component.config(), tokenizer, max_length or DEFAULT_MAX_LENGTH)
