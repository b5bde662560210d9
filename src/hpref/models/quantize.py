"""QLoRA's 4-bit base (`lora.quantize_base = "4bit"`): bitsandbytes NF4 weights under PEFT's adapters.

`apply_lora` calls `quantize_block_linears` on a materialised model before it injects the adapters:
every linear layer inside the transformer blocks that LoRA targets becomes a bitsandbytes
`Linear4bit` (NF4, double quantisation: the per-block scales are themselves quantised to 8 bits),
quantised from the full-precision pretrained weights on the run's device. PEFT then wraps each with
its own 4-bit LoRA layer (`peft.tuners.lora.bnb.Linear4bit`, chosen because the backbone says
`is_loaded_in_4bit`). Everything else (embeddings, norms, the head, a reward model's pooler) keeps
its dtype, as with LoRA on a full-precision base.

    ...q_proj.base_layer.weight            uint8, NF4 codes packed two per byte (frozen)
    ...q_proj.base_layer.weight.absmax ... bitsandbytes' quantisation state (buffers of no module)
    ...q_proj.lora_A.default.weight        trains, as with LoRA

Sharding. The packed weights and their quantisation state are not DTensors FSDP2 can shard:
`hpref.models.parallelize` passes them to `fully_shard(..., ignored_params=...)`, so every rank holds
the whole 4-bit base (as QLoRA under DDP does) while adapters, head and other parameters are sharded
as before. Checkpoints leave the 4-bit weights out with the rest of the frozen base
(`quantized_state_keys`): the recipe's `[model]` and this quantisation rebuild them bit for bit.

On CPU bitsandbytes dequantises each 4-bit weight for every matmul: the base takes a quarter of bf16's
memory, but no time is saved (a one-line note says so).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import torch
from loguru import logger
from torch import nn

from hpref import lazy_imports
from hpref.errors import UserError

#: bitsandbytes' quantisation type: NormalFloat4, the QLoRA paper's data type
QUANT_TYPE = "nf4"
#: weights per absmax scale. bitsandbytes 0.50's CPU dequantiser misplaces the scales of a layer whose
#: rows are not a whole number of blocks (errors up to 87% of a block's largest weight where NF4
#: rounds by 15% at most, measured on 32- and 96-wide inputs): such layers are not quantised.
BLOCKSIZE = 64


def bitsandbytes_problem(quantize_base: str) -> str | None:
    """Why `quantize_base` cannot run here (None: it can): bitsandbytes is not installed."""
    if quantize_base == "none" or importlib.util.find_spec("bitsandbytes") is not None:
        return None
    return f"'{quantize_base}' (QLoRA) needs bitsandbytes: pip install 'hpref[qlora]'"


def import_bitsandbytes() -> Any:
    """`bitsandbytes`, imported as `load_bitsandbytes` does; a one-line `UserError` (exit 2) when it
    is missing."""
    problem = bitsandbytes_problem("4bit")
    if problem is not None:
        raise UserError(f"lora.quantize_base: {problem}")
    return load_bitsandbytes()


def load_bitsandbytes() -> Any | None:
    """Import bitsandbytes when it is installed (None when not), never fetching code from the Hub;
    idempotent. Its import-time notes go to hpref's log files (`hpref.logs.route_stdlib_logs`), and
    `hpref.lazy_imports` hides the `kernels` package from its import (whoever imports it: its CPU
    backend would otherwise download compiled code from the Hugging Face Hub and run it)."""
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    from hpref.logs import route_stdlib_logs

    route_stdlib_logs("bitsandbytes")
    lazy_imports.install()  # already, where hpref was imported first; idempotent
    import bitsandbytes

    return bitsandbytes


def _targeted(name: str, targets: list[str]) -> bool:
    """PEFT's suffix match of `target_modules` against a module's full name."""
    return any(name == t or name.endswith("." + t) for t in targets)


def quantize_block_linears(model: Any, targets: list[str], *, device: torch.device | str) -> int:
    """Replace the `nn.Linear` layers inside `model.blocks()` whose names match `targets` with
    bitsandbytes NF4 `Linear4bit` layers quantised on `device` from their current (full-precision)
    weights; returns how many. A layer whose input width is not a multiple of `BLOCKSIZE` stays in
    full precision (logged). The model must be materialised (not on meta). Compute dtype: fp32
    until `set_compute_dtype` (the trainer's `parallelize`) sets the run's."""
    bnb = import_bitsandbytes()
    device = torch.device(device)
    count = 0
    narrow: set[str] = set()
    for block in model.blocks():
        for parent_name, parent in list(block.named_modules()):
            for child_name, child in list(parent.named_children()):
                full = f"{parent_name}.{child_name}" if parent_name else child_name
                if type(child) is not nn.Linear or not _targeted(full, targets):
                    continue
                if child.in_features % BLOCKSIZE:
                    narrow.add(child_name)
                    continue
                if child.weight.is_meta:
                    raise RuntimeError("quantize_block_linears needs materialised weights, not meta ones")
                parent._modules[child_name] = _linear_4bit(bnb, child, device)
                count += 1
    # PEFT picks its 4-bit LoRA layer (merge and unmerge through dequantisation) by this attribute
    model.backbone.is_loaded_in_4bit = True
    if narrow:
        logger.info(
            f"lora.quantize_base: {', '.join(sorted(narrow))} stay in full precision: their inputs are not "
            f"a multiple of bitsandbytes' {BLOCKSIZE}-weight blocks"
        )
    if count and device.type == "cpu":
        logger.info(
            "lora.quantize_base = '4bit' on CPU: bitsandbytes dequantises each 4-bit weight for every "
            "matmul here, so the base takes less memory but no less time"
        )
    return count


def _linear_4bit(bnb: Any, linear: nn.Linear, device: torch.device) -> nn.Module:
    quantized = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=torch.float32,
        compress_statistics=True,  # double quantisation
        quant_type=QUANT_TYPE,
        device="meta",
    )
    weight = linear.weight.detach().to("cpu", torch.float32)
    quantized.weight = bnb.nn.Params4bit(
        weight, requires_grad=False, blocksize=BLOCKSIZE, compress_statistics=True, quant_type=QUANT_TYPE
    )
    if linear.bias is not None:
        quantized.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    # On an AVX512-BF16 CPU bitsandbytes repacks the weight in place for its first inference
    # forward, with bf16 scales: evaluation would then score with another base than training did
    # (and the repacking fails for layers narrower than its 64-wide blocks). hpref keeps one format.
    quantized.support_avx512bf16_for_cpu = False
    return quantized.to(device)  # Params4bit quantises on its first move to a device


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of every bitsandbytes 4-bit layer in `model` (empty without QLoRA)."""
    if "bitsandbytes" not in sys.modules:  # never imported: no 4-bit layer can exist
        return {}
    import bitsandbytes as bnb

    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def is_quantized(model: nn.Module) -> bool:
    return bool(quantized_modules(model))


def quantized_params(model: nn.Module) -> set[nn.Parameter]:
    """The packed 4-bit weights: what FSDP2 must leave whole on every rank (`ignored_params`)."""
    return {m.weight for m in quantized_modules(model).values()}


def quantized_state_keys(model: nn.Module, keys: Any = None) -> set[str]:
    """Those of the state-dict `keys` (default: the model's own) that belong to a 4-bit weight: the
    packed weight and bitsandbytes' quantisation state (`weight.absmax`, `weight.quant_map`, ...)."""
    weights = {f"{name}.weight" for name in quantized_modules(model)}
    if not weights:
        return set()
    if keys is None:
        keys = model.state_dict().keys()
    dotted = tuple(w + "." for w in weights)
    return {k for k in keys if k in weights or k.startswith(dotted)}


def set_compute_dtype(model: nn.Module, dtype: torch.dtype) -> int:
    """Run the 4-bit layers' matmuls in `dtype` (the run's compute dtype); returns how many."""
    modules = quantized_modules(model)
    for module in modules.values():
        module.compute_dtype = dtype
    return len(modules)


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the 4-bit weights with their quantisation state."""
    total = 0
    for module in quantized_modules(model).values():
        total += module.weight.numel() * module.weight.element_size()
        state = module.weight.quant_state
        if state is not None:
            for value in state.as_dict(packed=True).values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
    return total
