"""LoRA on `hpref rl` policies: plain transformers causal LMs, not `PreferenceModel`s.

PEFT adapts the LM itself, in place, and the trainer keeps the `PeftModel` beside it (as
`hpref.models.adapters.apply_lora` does for preference models). A policy's own engine holds no
adapters: it is sent `merged_lm_items`. Policies that share one base (`rl.share_base`) are one
adapter each, named by the policy's id, in one LM (trainer and engine alike); their tensors move
under PEFT's saved names (`adapter_items`), looked up by module, never by PEFT's state-dict helpers,
which find an adapter by substring (adapter "a" would match every key with an "a" in it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hpref.errors import UserError
from hpref.models.adapters import ADAPTER, inject_lora, plain_key, require_peft

if TYPE_CHECKING:
    from hpref.recipe import LoraSection


POLICY_BASE_FILE = "policy_base.json"  # beside an rl trainer's adapter: which base it adapts
POLICY_ADAPTER_DIR = "adapter"  # PEFT's adapter folder inside an rl trainer save


def decoder_blocks(lm: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a transformers causal LM: the ModuleList as long as the config's
    `num_hidden_layers` (Llama, Qwen, Mistral `model.layers`; GPT-2 `transformer.h`)."""
    layers = getattr(getattr(lm, "config", None), "num_hidden_layers", None)
    for module in lm.modules():
        if isinstance(module, nn.ModuleList) and len(module) == layers:
            return module
    raise RuntimeError(f"could not find the decoder blocks of {type(lm).__name__}")


def causal_lm_lora_config(lm: nn.Module, settings: LoraSection) -> Any:
    """PEFT's `LoraConfig` for a policy LM: by default every linear layer inside its decoder blocks
    (attention and MLP projections), never the embeddings or the LM head."""
    from peft import LoraConfig

    targets = settings.target_modules
    if targets is None:
        from peft.tuners.lora import LoraLayer

        # in an LM that holds an adapter already (a shared base's next one), its adapted linears,
        # not the pieces PEFT put inside them (base_layer, lora_A.<adapter>, ...)
        modules = list(decoder_blocks(lm).named_modules())
        adapted = [f"{name}." for name, module in modules if isinstance(module, LoraLayer)]
        targets = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in modules
                if isinstance(module, (nn.Linear, LoraLayer)) and not name.startswith(tuple(adapted))
            }
        )
    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.scale_alpha,
        lora_dropout=settings.dropout,
        target_modules=list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora_to_causal_lm(
    lm: nn.Module, settings: LoraSection, *, seed: int = 0, adapter: str | None = None
) -> Any:
    """Inject LoRA adapters into `lm` in place and freeze its base weights; returns the `PeftModel`.

    `lm` stays the object every forward pass calls (PEFT wraps it, it does not replace it). The
    adapters start as PEFT's init (`lora_B` zeros), so the adapted LM computes exactly what the base
    does until its first step; they are drawn under `seed` so every build of a policy starts alike.
    A user error (exit 2) when peft is missing, `quantize_base` is set, or `target_modules` names
    nothing in the LM. `adapter`: its name (PEFT's "default" when None)."""
    require_peft()
    if settings.quantize_base != "none":
        raise UserError(
            f"lora.quantize_base: '{settings.quantize_base}' (QLoRA) is not supported for hpref rl "
            'policies; set lora.quantize_base = "none"'
        )
    config = causal_lm_lora_config(lm, settings)
    return inject_lora(lm, config, what="policy", seed=seed, adapter=adapter or ADAPTER)


def add_lm_adapter(
    peft_model: Any, lm: nn.Module, settings: LoraSection, adapter: str, *, seed: int = 0
) -> None:
    """One more adapter, named `adapter`, in an adapted LM (a policy on a shared base), drawn under
    `seed` as `apply_lora_to_causal_lm` draws the first; PEFT leaves it inactive and frozen."""
    from hpref.models.adapters import quiet_peft

    config = causal_lm_lora_config(lm, settings)
    with torch.random.fork_rng(devices=[]), quiet_peft():
        torch.manual_seed(seed)
        try:
            peft_model.add_adapter(adapter, config)
        except ValueError as exc:  # a target module the LM lacks
            raise UserError(f"lora.target_modules: {str(exc).strip().splitlines()[0]}") from None


def _adapter_layers(lm: nn.Module, adapter: str) -> Iterator[tuple[str, Any]]:
    """(name in the LM, LoRA layer) of every layer that holds `adapter`, in module order."""
    from peft.tuners.lora import LoraLayer

    for name, module in lm.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            yield name, module


def adapter_items(
    lm: nn.Module, adapter: str, whole: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
) -> Iterator[tuple[str, torch.Tensor]]:
    """One adapter's tensors under PEFT's saved names (`base_model.model.<module>.lora_A.weight`,
    what `adapter_model.safetensors` holds and vLLM loads), one at a time, in module order; `whole`
    as in `merged_lm_items` (every rank of a group calls it in this order)."""
    for name, module in _adapter_layers(lm, adapter):
        prefix = f"base_model.model.{plain_key(name)}"
        yield f"{prefix}.lora_A.weight", whole(module.lora_A[adapter].weight.detach())
        yield f"{prefix}.lora_B.weight", whole(module.lora_B[adapter].weight.detach())


def adapter_parameters(lm: nn.Module, adapter: str) -> list[torch.Tensor]:
    """The parameters one adapter trains (its optimizer's), in `adapter_items` order."""
    out = []
    for _name, module in _adapter_layers(lm, adapter):
        out += [module.lora_A[adapter].weight, module.lora_B[adapter].weight]
    return out


def _check_adapter_tensors(want: dict[str, Any], state: dict[str, torch.Tensor], source: str) -> None:
    """`state` holds exactly the adapter's keys (`want`'s), each of its shape; else a `ValueError`
    naming `source` and the first difference."""
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        first = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        raise ValueError(
            f"{source}: the adapter's tensors do not fit the policy ({first}; {len(missing)} missing, "
            f"{len(extra)} unexpected)"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(want[key].shape):
            raise ValueError(
                f"{source}: {key} has shape {tuple(tensor.shape)}, the policy's adapter "
                f"{tuple(want[key].shape)} (another lora.r or target_modules?)"
            )


def load_adapter_tensors(lm: nn.Module, adapter: str, state: dict[str, torch.Tensor], *, source: str) -> None:
    """Copy `state` (PEFT's saved names, `adapter_items`'s) into one adapter: exactly its keys and
    shapes, else a `ValueError` naming `source` and the first difference. A sharded LM's adapter
    (FSDP2) takes each tensor cut like its parameter."""
    from hpref.models.parallelize import shard_like

    params = dict(
        zip((k for k, _ in adapter_items(lm, adapter)), adapter_parameters(lm, adapter), strict=True)
    )
    _check_adapter_tensors(params, state, source)
    cut = shard_like(params, state)
    with torch.no_grad():
        for key, param in params.items():
            param.copy_(cut[key].to(param.dtype))


def save_adapter_folder(peft_model: Any, adapter: str, folder: Any, state: dict[str, torch.Tensor]) -> None:
    """A PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) of one adapter of a
    shared base, laid out as a policy of its own saves it (PEFT's `save_pretrained` puts an adapter
    not named "default" in a subfolder of its name); `state`: its tensors, `adapter_items`'s."""
    from pathlib import Path

    from safetensors.torch import save_file

    from hpref.exports.layout import PEFT_WEIGHTS_FILE

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    config = peft_model.peft_config[adapter]
    was = config.inference_mode
    config.inference_mode = True  # as PEFT writes it: a saved adapter loads for inference
    try:
        config.save_pretrained(str(path))
    finally:
        config.inference_mode = was
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(path / PEFT_WEIGHTS_FILE),
        metadata={"format": "pt"},
    )


def merged_lm_items(
    lm: nn.Module, whole: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapted LM's weights with the adapters folded in, under the plain LM's keys, one tensor at
    a time: what the LM would hold after PEFT's `merge_and_unload`, computed without touching it
    (merging and unmerging in place would leave rounding error in the frozen base). Each adapted
    linear weight is `base + B @ A * alpha / r` (PEFT's `get_delta_weight`); every other tensor is
    the model's own, not a copy. `whole`: how a stored tensor becomes a whole one (the identity, or
    gathering an FSDP2 shard: `hpref.rl.trainer.sharding.full`, which every rank calls in this order)."""
    from peft.tuners.lora import LoraLayer

    adapted = {
        f"{name}.base_layer.weight": module
        for name, module in lm.named_modules()
        if isinstance(module, LoraLayer) and (ADAPTER in module.lora_A or ADAPTER in module.lora_embedding_A)
    }
    with torch.no_grad():
        for key, tensor in lm.state_dict().items():
            if ".lora_" in key:  # lora_A / lora_B (and PEFT's other per-adapter parameters)
                continue
            value = whole(tensor.detach())
            module = adapted.get(key)
            if module is not None:
                if ADAPTER in module.lora_A:
                    a, b = whole(module.lora_A[ADAPTER].weight), whole(module.lora_B[ADAPTER].weight)
                    delta = b @ a
                    delta = delta.T if module.fan_in_fan_out else delta
                    delta = delta * module.scaling[ADAPTER]
                else:  # an embedding's adapter (never sharded: rl shards decoder blocks' linears)
                    delta = module.get_delta_weight(ADAPTER)
                value = value + delta.to(value.dtype)
            yield plain_key(key), value


def merged_lm_state(lm: nn.Module) -> dict[str, torch.Tensor]:
    """`merged_lm_items` as a state dict of copies (tests and one-process callers)."""
    return {key: value.clone() for key, value in merged_lm_items(lm)}


def lm_adapter_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (`get_peft_model_state_dict`)."""
    from peft.utils import get_peft_model_state_dict

    # the base embeddings never train here: "auto" would look the base up (on the Hub) to decide
    return get_peft_model_state_dict(peft_model, save_embedding_layers=False)


def load_lm_adapter_state(peft_model: Any, state: dict[str, torch.Tensor], *, source: str) -> None:
    """Put saved adapter tensors (PEFT's names, e.g. read from `adapter_model.safetensors`) into
    `peft_model`: exactly the adapter's keys and shapes, else a `ValueError` naming `source` and the
    first difference."""
    from peft.utils import set_peft_model_state_dict

    want = lm_adapter_state(peft_model)
    _check_adapter_tensors(want, state, source)
    from hpref.models.parallelize import shard_like

    # a policy sharded over ranks (`hpref.rl.trainer.sharding`) holds its adapters as FSDP2 shards
    set_peft_model_state_dict(peft_model, shard_like(want, state))
