"""LoRA adapters through PEFT: the one place where a `PreferenceModel` gets, saves, merges or loads them.

Every path that builds a model calls `apply_lora` when the recipe has a `[lora]` section: the train
worker (on the meta device, before FSDP2), `hpref eval` and `hpref save` (on CPU, before the
checkpoint's tensors are loaded). PEFT injects its LoRA layers into `model.backbone` in place
(`peft.get_peft_model`; the `PeftModel` it returns is kept beside the model, not inside it, so the
module tree and every other code path see the same backbone object as without LoRA):

    encoder.layer.0.attention.self.query.weight
      -> ...query.base_layer.weight          frozen: the pretrained weight
      -> ...query.lora_A.default.weight      trains (r x in), PEFT's init: kaiming-uniform
      -> ...query.lora_B.default.weight      trains (out x r), zeros: the model starts as the base

What trains: the adapters, the head (outside the backbone, untouched by PEFT) and, for a reward model
on an encoder, BERT's pooler, which transformers' sequence classifier applies before its score and
which starts from pretrained weights (PEFT `modules_to_save`: a trainable copy beside the frozen
original). PEFT freezes everything else.

Initial weights. A meta-device build has no values; `load_pretrained_weights` fills it from
`pretrained_state_dict()`, so `apply_lora` wraps the backbone's state factory: the plain pretrained
keys are mapped into PEFT's layout, and the adapters' initial values come from PEFT's own
`reset_lora_parameters` run under a seeded RNG (the model's `seed`), so every rank, a meta build and
a direct build start from the same adapters.

Exports. `merge_lora` folds the adapters into the base weights (`merge_and_unload`): the model is a
plain `PreferenceModel` again, and `save_pretrained` writes today's format. `save_adapter` writes
PEFT's own adapter folder (`adapter_config.json`, `adapter_model.safetensors`: loadable by
`peft.PeftModel.from_pretrained(AutoModel.from_pretrained(base), folder)`) plus hpref's head and
`hpref_adapter.json`, which names the base model (the recipe's `[model]` section) so that
`hpref.evaluate.adapter_export.load_adapter_export` rebuilds base + adapter + head (the files:
`hpref.exports`).

QLoRA. With `quantize_base = "4bit"` the targeted block linears are quantised to bitsandbytes NF4
before PEFT wraps them (`hpref.models.quantize`), on a materialised model; merged exports fold the
adapters into the full-precision base instead (`Components.model(quantize=False)`).

RL policies. An `hpref rl` policy is a plain transformers causal LM: `apply_lora_to_causal_lm`
adapts it in place (default targets: every linear layer in its decoder blocks), `merged_lm_state`
gives the merged weights its engine loads, and `lm_adapter_state` / `load_lm_adapter_state` are the
adapter's tensors in PEFT's saved names, for the rl trainer's save and resume (`hpref.rl.trainer.actor`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from loguru import logger
from torch import nn

from hpref.errors import UserError, did_you_mean
from hpref.exports.layout import QUANTIZE_KEY
from hpref.models.preference import PreferenceModel

if TYPE_CHECKING:
    from hpref.recipe import LoraSection

ADAPTER = "default"  # PEFT's adapter name; hpref trains one adapter per model
_STATE_ATTR = "_hpref_lora"  # in the model's __dict__: a plain attribute, not a registered submodule

# PEFT's wrappers add these segments to a wrapped module's keys; without them a key is the base's
_PEFT_SEGMENT = re.compile(r"\.(base_layer|original_module|modules_to_save\." + ADAPTER + r")(?=\.)")


@dataclass
class LoraState:
    """What `apply_lora` leaves on a model: PEFT's handle and the plain backbone's state factory."""

    peft: Any  # peft.PeftModel around model.backbone
    plain_backbone_state: Callable[[], dict[str, torch.Tensor]]
    settings: dict[str, Any]
    #: the adapters' initial values and the backbone's keys, taken before FSDP2 shards the model
    initial: dict[str, torch.Tensor]
    backbone_keys: list[str]


# --------------------------------------------------------------------------------------------------
# requirements


def require_peft() -> None:
    """A one-line `UserError` when peft is missing; call it before importing peft. (peft's own
    imports of bitsandbytes wait until a model is quantized, and then fetch no code from the Hub:
    `hpref.lazy_imports`.)"""
    if importlib.util.find_spec("peft") is None:
        raise UserError("lora: LoRA adapters need the peft package: pip install 'hpref[lora]'")


def quantize_problem(settings: LoraSection) -> str | None:
    """Why `quantize_base` cannot run here (None: nothing to say): QLoRA's 4-bit base needs
    bitsandbytes, which runs NF4 on CUDA and on CPU (`hpref.models.quantize`)."""
    from hpref.models.quantize import bitsandbytes_problem

    return bitsandbytes_problem(settings.quantize_base)


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """PEFT asks transformers v5 models `is_gradient_checkpointing`, which warns that it is renamed:
    a FutureWarning on every build that says nothing to an hpref user (nor does the one below)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # a shared base's adapters are named by policy ids ("a" is in "lora_"): PEFT warns for its own
        # name-matching loaders, which hpref never uses for them (`hpref.models.lm_adapters`)
        warnings.filterwarnings(
            "ignore", message=".*should not be contained in the prefix.*", category=UserWarning
        )
        yield


# --------------------------------------------------------------------------------------------------
# configuration


def _block_linear_names(model: PreferenceModel) -> tuple[list[str], list[str]]:
    """(leaf names of the linear layers inside the transformer blocks, full names of the backbone's
    linear layers outside them)."""
    inside: set[str] = set()
    in_blocks: set[int] = set()
    for block in model.blocks():
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
                inside.add(name.rsplit(".", 1)[-1])
                in_blocks.add(id(module))
    outside = [
        name
        for name, module in model.backbone.named_modules()
        if isinstance(module, nn.Linear) and id(module) not in in_blocks
    ]
    return sorted(inside), outside


def default_target_modules(model: PreferenceModel) -> list[str]:
    """Every linear layer inside the transformer blocks, by leaf name (PEFT's suffix match): attention
    and MLP projections of any family (BERT query/key/value/dense, Llama q/k/v/o/gate/up/down_proj).
    PEFT's own per-architecture defaults adapt only query and value."""
    return _block_linear_names(model)[0]


def full_modules(model: PreferenceModel) -> list[str]:
    """Backbone modules trained in full: BERT's pooler when a reward model applies it (see
    `PreferenceModel.forward`); it has pretrained weights, so a new head alone would not replace it."""
    applies_pooler = model.paired and model.pooling == "first"
    if applies_pooler and getattr(model.backbone, "pooler", None) is not None:
        return ["pooler"]  # a mean-pooled reward model never calls it: no trainable copy for it
    return []


def lora_config(model: PreferenceModel, settings: LoraSection) -> Any:
    """PEFT's `LoraConfig` for this model and the recipe's `[lora]` section."""
    from peft import LoraConfig

    targets, outside = _block_linear_names(model)
    if settings.target_modules is not None:
        targets = list(settings.target_modules)
    keep = full_modules(model)
    # a leaf name such as BERT's `dense` also names the pooler's linear: that one trains in full
    exclude = [name for name in outside if any(name.startswith(m + ".") for m in keep)]
    kwargs: dict[str, Any] = dict(
        r=settings.r,
        lora_alpha=settings.scale_alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        modules_to_save=keep or None,
        bias="none",
    )
    if exclude:
        kwargs["exclude_modules"] = exclude
    return LoraConfig(**kwargs)


# --------------------------------------------------------------------------------------------------
# applying


def lora_state(model: nn.Module) -> LoraState | None:
    """The model's LoRA state, or None for a model without adapters."""
    return model.__dict__.get(_STATE_ATTR)


def has_lora(model: nn.Module) -> bool:
    return lora_state(model) is not None


def inject_lora(
    module: nn.Module, config: Any, *, what: str, seed: int | None = None, adapter: str = ADAPTER
) -> Any:
    """PEFT's `get_peft_model` on `module`, in place (PEFT wraps it; every forward still calls it),
    under a forked RNG (PEFT draws its init from the global one; `seed` makes it reproducible); a
    `target_modules` entry that matches nothing is one `UserError` listing `what`'s linear layers."""
    from peft import get_peft_model

    meta = any(p.is_meta for p in module.parameters())
    try:
        with torch.random.fork_rng(devices=[]), quiet_peft():
            if seed is not None:
                torch.manual_seed(seed)
            peft_model = get_peft_model(module, config, adapter_name=adapter, low_cpu_mem_usage=meta)
    except ValueError as exc:  # PEFT's "Target modules {...} not found in the base model"
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in module.named_modules() if isinstance(m, nn.Linear)})
        first = str(exc).strip().splitlines()[0]
        wrong = next((t for t in config.target_modules if t not in linear), "")
        hint = did_you_mean(wrong, linear) if wrong else ""
        raise UserError(
            f"lora.target_modules: {first}{hint}; the {what}'s linear layers are: {', '.join(linear)}"
        ) from None
    if peft_model.base_model.model is not module:
        raise RuntimeError(f"peft did not adapt the {what} in place")
    return peft_model


def apply_lora(model: PreferenceModel, settings: LoraSection, *, device: Any = None) -> LoraState:
    """Inject LoRA adapters into `model.backbone` in place (meta or materialised) and freeze the base.

    With `quantize_base = "4bit"` (QLoRA) the model must be materialised: the targeted block linears
    are first quantised to NF4 on `device` (default: the model's target device), see
    `hpref.models.quantize`. A user error (exit 2) when peft or bitsandbytes is missing, or
    `target_modules` names nothing in the backbone."""
    require_peft()
    problem = quantize_problem(settings)
    if problem is not None:
        raise UserError(f"lora.quantize_base: {problem}")
    if has_lora(model):
        raise RuntimeError("the model already has LoRA adapters")
    backbone = model.backbone
    config = lora_config(model, settings)
    if settings.quantize_base == "4bit":
        from hpref.models.quantize import quantize_block_linears

        where = device if device is not None else model.target_device
        quantize_block_linears(model, sorted(config.target_modules), device=where)
    peft_model = inject_lora(backbone, config, what="backbone")
    state = LoraState(
        peft=peft_model,
        plain_backbone_state=model._backbone_state,
        settings=settings.model_dump(mode="json"),
        initial=initial_adapter_state(model),
        backbone_keys=list(backbone.state_dict()),
    )
    model.__dict__[_STATE_ATTR] = state
    # `pretrained_state_dict()` (and so `load_pretrained_weights`) now gives PEFT's layout
    model._backbone_state = lambda: lora_layout(model, state.plain_backbone_state())
    trainable, total = count_parameters(model)
    logger.info(
        f"LoRA r={settings.r} alpha={settings.scale_alpha} on {', '.join(sorted(config.target_modules))}"
        + (f", {', '.join(config.modules_to_save)} in full" if config.modules_to_save else "")
        + f": {trainable:,} of {total:,} parameters train ({trainable / total:.2%}, head included)"
    )
    return state


def initial_adapter_state(model: PreferenceModel) -> dict[str, torch.Tensor]:
    """The adapters' initial values (CPU, fp32, backbone-relative keys): PEFT's own
    `reset_lora_parameters`, under an RNG seeded with the model's `seed`, module by module in order.
    Meta layers are materialised on CPU for it (adapters are small) and put back on meta; layers with
    values keep the values drawn. Call it before the model is sharded."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model.seed)
        for name, module in model.backbone.named_modules():
            if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
                continue
            parts = {"lora_A": module.lora_A[ADAPTER], "lora_B": module.lora_B[ADAPTER]}
            devices = {part: p.weight.device for part, p in parts.items()}
            for linear in parts.values():  # drawn on CPU whatever the device: the same values anywhere
                if linear.weight.is_meta:
                    linear.to_empty(device="cpu")
                else:
                    linear.to("cpu")
            with torch.no_grad():
                module.reset_lora_parameters(ADAPTER, True)
            for part, linear in parts.items():
                for pname, tensor in linear.named_parameters():
                    out[f"{name}.{part}.{ADAPTER}.{pname}"] = tensor.detach().to(torch.float32, copy=True)
                linear.to(devices[part])
    return out


def plain_key(key: str) -> str:
    """A backbone key in PEFT's layout -> the key of the same tensor in the plain backbone."""
    return _PEFT_SEGMENT.sub("", key)


def lora_layout(model: PreferenceModel, plain: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A plain backbone state dict (HF keys) in the LoRA model's layout: base weights under PEFT's
    names (a `modules_to_save` module twice: the frozen original and the trainable copy), adapters at
    their initial values."""
    state = lora_state(model)
    assert state is not None
    adapters = state.initial
    out: dict[str, torch.Tensor] = {}
    for key in state.backbone_keys:
        if key in adapters:
            out[key] = adapters[key]
        elif plain_key(key) in plain:
            out[key] = plain[plain_key(key)]
        else:
            raise RuntimeError(f"no initial value for {key} (neither a base weight nor a LoRA adapter)")
    return out


def to_model_layout(model: PreferenceModel, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full plain state dict (`backbone.*` with HF keys, `head.*`; e.g. an `hpref init` folder) in
    the model's layout: unchanged without LoRA."""
    if not has_lora(model):
        return full
    backbone = {k.removeprefix("backbone."): v for k, v in full.items() if k.startswith("backbone.")}
    out = {f"backbone.{k}": v for k, v in lora_layout(model, backbone).items()}
    out.update({k: v for k, v in full.items() if not k.startswith("backbone.")})
    return out


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameters; a `modules_to_save` module's frozen original counts in `all`, a
    4-bit weight (QLoRA) as the weights it stands for, not its packed bytes."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(_logical_numel(p) for p in params)


def _logical_numel(param: torch.Tensor) -> int:
    quant_state = getattr(param, "quant_state", None)  # bitsandbytes' Params4bit
    shape = getattr(quant_state, "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else param.numel()


def frozen_state_keys(model: nn.Module) -> set[str]:
    """State-dict keys of frozen parameters: what a checkpoint leaves to the base weights (with
    QLoRA also bitsandbytes' quantisation state of the 4-bit weights, which no parameter names)."""
    from hpref.models.quantize import quantized_state_keys

    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    return frozen | quantized_state_keys(model)


def freeze_dtype(model: nn.Module, dtype: torch.dtype) -> int:
    """Store frozen parameters in `dtype` (the compute dtype): a weight that never steps needs no fp32
    master copy. FSDP2 requires one dtype across the trainable parameters of a unit only. Returns
    how many parameters it changed."""
    changed = 0
    for param in model.parameters():
        if not param.requires_grad and param.dtype != dtype and param.is_floating_point():
            param.data = param.data.to(dtype)
            changed += param.numel()
    return changed


# --------------------------------------------------------------------------------------------------
# exports


def merge_lora(model: nn.Module) -> None:
    """Fold the adapters into the base weights (PEFT's `merge_and_unload`): the model becomes a plain
    `PreferenceModel`, whose `save_pretrained` writes the usual transformers folder."""
    state = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return
    merged = state.peft.merge_and_unload()
    if merged is not model.backbone:
        model.backbone = merged
    model._backbone_state = state.plain_backbone_state


def base_pointer(recipe: Any) -> dict[str, Any]:
    """What names the frozen base weights a LoRA checkpoint or adapter export leaves out: the
    recipe's resolved `[model]` section (component and parameters), plus `quantize_base` for a
    QLoRA base (the same `[model]` quantised is another set of base weights)."""
    pointer = dict(recipe.to_dict()["model"])
    lora = getattr(recipe, "lora", None)
    if lora is not None and lora.quantize_base != "none":
        pointer[QUANTIZE_KEY] = lora.quantize_base
    return pointer


def save_adapter(model: PreferenceModel, folder: Path, *, base: dict[str, Any], dtype: torch.dtype) -> None:
    """PEFT's adapter folder for the backbone, plus hpref's head, tokenizer and `hpref_adapter.json`
    (`hpref.exports.files.write_adapter_export`)."""
    from hpref.exports.files import write_adapter_export

    state = lora_state(model)
    if state is None:
        raise UserError("--adapter: the model has no LoRA adapters (the recipe has no [lora] section)")
    write_adapter_export(
        Path(folder),
        state.peft,
        model.head.state_dict(),
        tokenizer=model.tokenizer,
        dtype=dtype,
        base=base,
        num_labels=model.num_labels,
        pooling=model.pooling,
        head_kind=model.head_kind,
        lora=state.settings,
    )


def attach_adapter(model: PreferenceModel, peft_model: Any, settings: dict[str, Any]) -> LoraState:
    """Record a loaded (not trained) PEFT adapter on `model`, as `apply_lora` records a new one:
    merging, saving and the state-dict layout then treat it alike."""
    state = LoraState(
        peft=peft_model,
        plain_backbone_state=model._backbone_state,
        settings=dict(settings),
        initial={},  # loaded, not trained: nothing to initialise
        backbone_keys=list(model.backbone.state_dict()),
    )
    model.__dict__[_STATE_ATTR] = state
    return state
