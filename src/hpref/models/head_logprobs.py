"""Taken tokens' log-probabilities (and the sampling distribution's entropy) straight from a causal
LM's final hidden states and its LM head, without ever holding the `[N, V]` logits.

At SmolLM2's 49k-token vocabulary the logits of a rollout's answer tokens, their float32 copy, the
log-softmax and its gradient were most of an RL or DPO step's peak memory, for one number per
token. `head_logprobs` walks the tokens in chunks: each chunk's logits live only while its
log-probs and entropies are read in the forward, and are recomputed in the backward (an
`autograd.Function`, as Liger's fused linear cross-entropy does), so at most one chunk's logits
(`chunk_elements` of them) exist at a time, forward or backward.

The numbers are the full path's: the gradient of `log_softmax((hidden @ W.T + b) / T)[target]`
with respect to the logits is `(onehot - softmax) / T` per row, so the backward needs only the
saved log-sum-exp per row; the weight's and bias's gradients are summed over chunks in float32
(float64 for float64 inputs). With a frozen head (LoRA) nothing is recomputed: the hidden states'
gradient per row is taken in the forward (`_HeadLogProbs`). The entropy is returned without
gradient (every caller logs it; none trains on it).
"""

from __future__ import annotations

import torch
from torch import nn

#: logits per chunk (64 MiB of float32): the chunk's matmul stays large enough to run at speed,
#: while a chunk's logits, softmax and gradient stay a small fraction of a step's memory
CHUNK_ELEMENTS = 1 << 24


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the LM head's matmul would run in here: autocast's where it is on for `hidden`'s
    device (the trainers' bf16), else the inputs' promoted dtype."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    temperature: float,
) -> torch.Tensor:
    """One chunk's logits / T in float32 (float64 for float64 inputs), `weight` and `bias` already
    in `dtype`."""
    # the head's own kernel (the bias added inside the matmul, one rounding), as the full path runs it
    logits = nn.functional.linear(hidden.to(dtype), weight, bias)
    logits = logits.to(torch.promote_types(dtype, torch.float32))
    return logits if temperature == 1.0 else logits.div_(temperature)


def _softmax_gradient(
    logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """`scale * (onehot(targets) - softmax)` per row, in place of `logits` (the gradient of the
    row's log-prob of its target with respect to its logits, times `scale` = upstream / T)."""
    grad = logits.sub_(lse[:, None]).exp_().mul_(-scale[:, None])
    return grad.scatter_add_(-1, targets[:, None], scale[:, None])


class _HeadLogProbs(torch.autograd.Function):
    """Chunked log-probs of `targets` (and entropies, without gradient) from `hidden` and the head.

    When the head's weights take no gradient (a LoRA policy's frozen head) the hidden states'
    gradient per row, `(onehot - softmax) @ W / T`, does not depend on the upstream gradient: it is
    taken in the forward from the chunk's logits there, and the backward only scales it (no logits
    recomputed). Otherwise the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        dtype: torch.dtype,
        rows: int,
        want_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, wide = hidden.shape[0], torch.promote_types(dtype, torch.float32)
        logps = torch.empty(n, dtype=wide, device=hidden.device)
        entropies = torch.empty(n if want_entropy else 0, dtype=wide, device=hidden.device)
        lse = torch.empty_like(logps)
        # the hidden states' gradient taken now: the only input that wants one is `hidden`
        jacobian_now = (
            hidden.requires_grad and not weight.requires_grad and (bias is None or not bias.requires_grad)
        )
        jacobian = torch.empty(hidden.shape, dtype=wide, device=hidden.device) if jacobian_now else None
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for s in range(0, n, rows):
                logits = _chunk_logits(hidden[s : s + rows], w, b, dtype, temperature)
                chunk_lse = torch.logsumexp(logits, dim=-1)
                lse[s : s + rows] = chunk_lse
                logps[s : s + rows] = logits.gather(-1, targets[s : s + rows, None]).squeeze(-1) - chunk_lse
                if want_entropy:
                    probs = torch.exp(logits - chunk_lse[:, None])
                    entropies[s : s + rows] = chunk_lse - (probs * logits).sum(-1)
                if jacobian is not None:
                    scale = torch.full_like(chunk_lse, 1.0 / temperature)
                    grad = _softmax_gradient(logits, chunk_lse, targets[s : s + rows], scale)
                    jacobian[s : s + rows] = grad.to(dtype) @ w
        if jacobian is not None:
            ctx.save_for_backward(jacobian)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.jacobian_now, ctx.hidden_dtype = jacobian is not None, hidden.dtype
        ctx.temperature, ctx.dtype, ctx.rows = temperature, dtype, rows
        ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_logps: torch.Tensor, _grad_entropies: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        none = (None,) * 5
        if ctx.jacobian_now:  # type: ignore[attr-defined]
            (jacobian,) = ctx.saved_tensors  # type: ignore[attr-defined]
            grad_hidden = (jacobian * grad_logps.to(jacobian.dtype)[:, None]).to(ctx.hidden_dtype)  # type: ignore[attr-defined]
            return (grad_hidden, None, None, *none)
        hidden, weight, bias, targets, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature, dtype, rows = ctx.temperature, ctx.dtype, ctx.rows  # type: ignore[attr-defined]
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]  # type: ignore[attr-defined]
        wide = lse.dtype  # float32, or float64 for float64 inputs
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=wide, device=bias.device) if need_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for s in range(0, hidden.shape[0], rows):
                chunk = hidden[s : s + rows]
                logits = _chunk_logits(chunk, w, b, dtype, temperature)
                scale = grad_logps[s : s + rows].to(wide) / temperature
                grad = _softmax_gradient(logits, lse[s : s + rows], targets[s : s + rows], scale)
                if grad_bias is not None:
                    grad_bias += grad.sum(0)
                grad = grad.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[s : s + rows] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += (grad.t() @ chunk.to(dtype)).to(wide)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            *none,
        )


def head_logprobs(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = True,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs `[N]`, entropies `[N]`, both float32, float64 for float64 inputs) of `targets [N]` under
    `softmax(head(hidden) / temperature)` for `hidden [N, H]`, chunked over the N tokens (module
    docstring); the log-probs carry gradients to `hidden`, `head.weight` and `head.bias`. Without
    `entropy` the second tensor is empty (its softmax pass skipped)."""
    weight, bias = head.weight, head.bias
    rows = max(1, chunk_elements // max(weight.shape[0], 1))
    dtype = compute_dtype(hidden, weight)
    return _HeadLogProbs.apply(hidden, weight, bias, targets.long(), float(temperature), dtype, rows, entropy)


def fusable_head(head: nn.Module | None) -> bool:
    """Whether `head` is a plain linear layer `head_logprobs` can read the weights of (an adapter
    wrapped around it, or any other module, runs as itself and gets the full logits)."""
    return type(head) is nn.Linear
