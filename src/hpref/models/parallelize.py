"""Parallelism, applied in one fixed order to a model built on the meta device:

    activation checkpointing (per block)  ->  fully_shard per block  ->  fully_shard(root)

then the trainer materialises and loads the weights (`hpref.train.sharding.load_initial_weights`).

FSDP2 keeps fp32 master weights of what trains; with bf16 precision its `MixedPrecisionPolicy`
all-gathers bf16 copies for compute and reduce-scatters gradients in fp32. The classification head
is the exception: it is its own FSDP unit computing in fp32 (on the bf16 pooled state cast up),
because bf16 keeps only ~3 significant digits and logits rounded that coarsely put many predictions
on the same few values (ties in a ranking, a calibration floor in log loss) for a cost of two tiny
matmuls.

With LoRA (`hpref.models.adapters`) the frozen base weights are stored in the compute dtype: they
never step, so an fp32 master copy would only double their memory, and FSDP2 casts them to that
dtype for every forward anyway (the same numbers). The adapters, the head and anything else that
trains keep fp32 master weights.

With QLoRA (`hpref.models.quantize`) the targeted block linears hold bitsandbytes' packed 4-bit
weights, which are not DTensors: they go to `fully_shard(..., ignored_params=...)`, so each rank
keeps the whole 4-bit base (as QLoRA under DDP does), and their matmuls run in the compute dtype.

FSDP2 works on CPU with gloo (a "cpu" DeviceMesh) in torch >= 2.6, so there is no second code path
for CPU or for a single process: the same sharded model runs everywhere (world size 1 simply holds
every shard). The model side of the contract is `blocks()`, `head` and
`set_activation_checkpointing` (`hpref.protocols.PreferenceModel`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from hpref.protocols import KeysCheckpoint, ViewsCheckpoint


def parallelize(
    model: torch.nn.Module,
    *,
    param_dtype: torch.dtype,
    activation_checkpointing: bool,
) -> torch.nn.Module:
    """Activation checkpointing, then FSDP2 per block and on the root (see the module docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("parallelize needs a process group (the worker creates one, even for 1 rank)")
    if activation_checkpointing:
        model.set_activation_checkpointing(True)
    policy = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype, reduce_dtype=torch.float32
    )
    frozen = 0
    if param_dtype != torch.float32:  # LoRA: the frozen base needs no fp32 master weights
        from hpref.models.adapters import freeze_dtype

        frozen = freeze_dtype(model, param_dtype)
    # QLoRA: bitsandbytes' packed 4-bit weights stay whole on every rank (see the module docstring)
    from hpref.models.quantize import quantized_params, set_compute_dtype

    replicated = quantized_params(model)
    extra: dict[str, Any] = {"ignored_params": replicated} if replicated else {}
    set_compute_dtype(model, param_dtype)
    blocks = model.blocks()
    for block in blocks:
        fully_shard(block, mp_policy=policy, **extra)
    head = model.head
    fp32_head = isinstance(head, torch.nn.Module) and param_dtype != torch.float32
    if fp32_head:  # see the module docstring; the policy casts the pooled bf16 input up
        fp32 = torch.float32
        fully_shard(head, mp_policy=MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32))
    fully_shard(model, mp_policy=policy, **extra)
    logger.info(
        f"FSDP2: {len(blocks)} blocks + root over {dist.get_world_size()} rank(s), "
        f"compute {_name(param_dtype)}{' (head fp32)' if fp32_head else ''}, reduce fp32, "
        f"activation checkpointing {'on' if activation_checkpointing else 'off'}"
        + (f"; {frozen:,} frozen parameters stored in {_name(param_dtype)}" if frozen else "")
        + (f"; {len(replicated)} 4-bit base weights replicated on every rank" if replicated else "")
    )
    return model


def checkpoint_blocks(blocks: Iterable[torch.nn.Module]) -> int:
    """Recompute each block's activations in backward instead of storing them (non-reentrant
    `torch.utils.checkpoint`, in training mode with gradients on), for blocks that read and write a
    KV cache too; returns how many blocks it wrapped.

    The hpref rl trainer's causal LM runs a prompt group's answers on the prompt's KV cache
    (`hpref.rl.policy.group_batch`), which transformers' own per-block checkpointing cannot do: it
    drops the cache in training (`use_cache=False`), so the answers would no longer see their
    prompt. Here each block's recomputation first puts the cache back as the block found it in
    the forward (its layers' tensors are replaced, never written in place, so keeping the references
    is enough): the replay appends the same keys and values to the same cache and saves tensors
    of the same shapes. The block's `forward` is wrapped, not `__call__`, so FSDP2's per-block hooks
    stay outside the recomputation (as with `PreferenceModel.set_activation_checkpointing`)."""
    count = 0
    for block in blocks:
        block.forward = _checkpointed_forward(block, block.forward)
        count += 1
    return count


#: the keywords a transformers decoder layer takes its KV cache under (renamed across versions)
_CACHE_KEYWORDS = ("past_key_values", "past_key_value", "cache", "layer_past")


def _checkpointed_forward(block: torch.nn.Module, forward: Any) -> Any:
    import functools

    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not (block.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        cache = next((kwargs[k] for k in _CACHE_KEYWORDS if kwargs.get(k) is not None), None)
        found = _cache_state(cache)
        if cache is not None and found is None:  # a replay would write it twice: refuse, never corrupt
            raise RuntimeError(f"activation checkpointing: cannot restore a {type(cache).__name__} KV cache")

        def replay(*inputs: Any) -> Any:
            _restore_cache(cache, found)  # a no-op in the forward itself
            return forward(*inputs, **kwargs)

        return checkpoint(replay, *args, use_reentrant=False)

    return run


def _cache_state(cache: Any) -> list[tuple[Any, dict[str, Any]]] | None:
    layers = getattr(cache, "layers", None)
    return None if layers is None else [(layer, dict(vars(layer))) for layer in layers]


def _restore_cache(cache: Any, state: list[tuple[Any, dict[str, Any]]] | None) -> None:
    if state is None:
        return
    cache.layers[:] = [layer for layer, _ in state]  # layers a forward appended go
    for layer, attributes in state:
        layer.__dict__.clear()
        layer.__dict__.update(attributes)


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def checkpoint_layout(
    model: torch.nn.Module, model_state: dict[str, Any], optim_state: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`{"model": ..., "optim": ...}` as DCP stores them. A model with a `checkpoint_view(key,
    tensor)` (megatron-gpt: its tensor-parallel shards as DTensor shards of the full tensors) gives
    each tensor as a view of it, so that a load into the result fills `model_state` and
    `optim_state` in place; other models' state is stored as it is. A model with a
    `checkpoint_key(key)` (a megatron-gpt pipeline stage: its local layer numbers made global)
    stores each tensor under that key."""
    state: dict[str, Any] = {"model": model_state}
    if optim_state is not None:
        state["optim"] = optim_state
    if not isinstance(model, ViewsCheckpoint):
        return state
    view = model.checkpoint_view
    stored_key = model.checkpoint_key if isinstance(model, KeysCheckpoint) else (lambda key: key)
    # megatron's `_extra_state` entries are None (its local layers keep no FP8 metadata)
    state["model"] = {stored_key(k): view(k, v) for k, v in model_state.items() if v is not None}
    if optim_state is not None:
        state["optim"] = {
            **optim_state,
            "state": {
                stored_key(key): {name: view(key, value) for name, value in per_param.items()}
                for key, per_param in optim_state["state"].items()
            },
        }
    return state


def shard_like(reference: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (whole tensors, e.g. read from a save) with each tensor cut the way `reference`'s
    tensor of the same key is sharded (a DTensor of FSDP2), so `load_state_dict` can copy shard into
    shard; tensors whose reference is a plain tensor (or missing) are left as they are. Every rank
    calls it with the same whole tensors."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {}
    for key, tensor in state.items():
        ref = reference.get(key)
        if isinstance(ref, DTensor) and not isinstance(tensor, DTensor):
            tensor = distribute_tensor(tensor.to(ref.dtype), ref.device_mesh, ref.placements)
        out[key] = tensor
    return out
