"""Megatron sequence parallelism for hpref's packed rows (`model.sequence_parallel = true`, TP > 1).

With sequence parallelism megatron keeps the activations between its tensor-parallel regions (the
norms and the residual stream) split along the token dimension over the tensor-parallel ranks: the
embedding reduce-scatters its output, every column-parallel linear all-gathers its input and every
row-parallel linear reduce-scatters its output. Activation memory outside attention and the MLP falls
by the tensor-parallel size. What hpref adds around megatron's own implementation:

- Rows padded to a multiple of the tensor-parallel size (`pad_packed_row`): the split needs equal
  parts and hpref's packed rows have any length. The padding is one extra sequence at the end of the
  row (its own `cu_seqlens` entry), so no real sequence attends to it; it is cut off the output.
- The output gathered back (`gather_tokens`): pooling reads each sequence's last token, which may
  sit on any rank. The gather's backward hands each rank its own part of the gradient (every rank
  computes the same head and loss on the gathered row).
- Norms whose gradients are summed over the tensor-parallel group: a norm sees only this rank's
  tokens, so its weight gradient is a partial sum. megatron's own torch norm refuses sequence
  parallelism for that reason (its fused Apex / Transformer Engine norms mark the weights
  `sequence_parallel`, and megatron's `finalize_model_grads` sums them); `SequenceParallelRMSNorm`
  marks torch's `RMSNorm` the same way, and `sum_partial_gradients` does the sum (called by
  `MegatronPreferenceModel.reduce_and_clip_gradients` after the last micro-batch).
- Two CUDA seams, both only what the CPU needs:
  * megatron's collectives allocate their buffers on `torch.cuda.current_device()`
    (`tensor_parallel.mappings`, `tensor_parallel.layers`, `core.utils`' global buffer); on a host
    without CUDA, `place_collective_buffers_on_cpu` gives those three modules a `torch` whose
    `cuda.current_device()` is the CPU (nothing else changes, and only in those modules);
  * the embedding's dropout runs under megatron's CUDA RNG tracker when sequence parallel is on,
    which refuses to fork unless CUDA seeds were registered. Dropout inside hpref's megatron
    backbone is off (0.0, refused otherwise), so `no_op_rng_tracker` installs megatron's own
    no-op tracker (its inference tracker): no random numbers are drawn either way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: megatron modules that allocate collective buffers on `torch.cuda.current_device()`
_BUFFER_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
)


class SequenceParallelRMSNorm:
    """megatron's norm slot (`input_layernorm`, `pre_mlp_layernorm`) as torch's `RMSNorm`, its
    weight marked `sequence_parallel` when the config is (see the module docstring)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> nn.Module:
        norm = nn.RMSNorm(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


class _CudaOnCpu:
    """`torch.cuda` whose `current_device()` is the CPU."""

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """`torch` as megatron's collective helpers see it on a host without CUDA."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def place_collective_buffers_on_cpu() -> None:
    """On a host without CUDA, megatron's sequence-parallel collectives allocate on the CPU (see
    the module docstring); idempotent; nothing happens where CUDA is available."""
    if torch.cuda.is_available():
        return
    import importlib

    for name in _BUFFER_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _TorchOnCpu):
            module.torch = _TorchOnCpu()


def no_op_rng_tracker() -> None:
    """megatron's RNG tracker forks nothing (the backbone draws no random numbers; see the module
    docstring). Must run before megatron first asks for its tracker; a tracker already made is
    replaced only if it is the CUDA one no seed was registered in."""
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = getattr(megatron_random, "_CUDA_RNG_STATE_TRACKER", None)
    if tracker is not None and getattr(tracker, "states_", None):
        return  # a caller seeded it (model_parallel_cuda_manual_seed): theirs to keep
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    megatron_random.initialize_rng_tracker(inference_rng_tracker=True)


def pad_packed_row(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`input_ids` `[1, T]` padded to a multiple of `multiple` tokens by one extra sequence of token
    0 at the end (its own `cu_seqlens` bound); returns the row, the bounds and the longest length."""
    total = input_ids.shape[1]
    pad = -total % multiple
    if pad == 0:
        return input_ids, cu_seqlens, max_seqlen
    input_ids = torch.cat([input_ids, input_ids.new_zeros(1, pad)], dim=1)
    end = torch.tensor([total + pad], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return input_ids, torch.cat([cu_seqlens, end]), max(max_seqlen, pad)


def gather_tokens(hidden: torch.Tensor) -> torch.Tensor:
    """`[T / tp, 1, h]` on each tensor-parallel rank -> the whole `[T, 1, h]` on every rank; the
    backward keeps this rank's part of the (identical) gradient."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)


def sum_partial_gradients(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum the gradients of `params` marked `sequence_parallel` over the tensor-parallel group (one
    flat all-reduce): each rank's is the part from its own tokens. Returns the parameters summed."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    partial = [p for p in params if p.grad is not None and getattr(p, "sequence_parallel", False)]
    if not partial or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return []
    flat = torch.cat([p.grad.reshape(-1) for p in partial])
    dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    offset = 0
    for p in partial:
        p.grad.copy_(flat[offset : offset + p.grad.numel()].view_as(p.grad))
        offset += p.grad.numel()
    return partial
