"""Packed variable-length attention, plugged into transformers' attention-function registry.

A packed micro-batch is one row of `T` tokens holding `n` sequences back to back, described by
`cu_seqlens` (int32, `[0, len_0, len_0 + len_1, ..., T]`). Attention must never cross a sequence
boundary, and a decoder stays causal inside each sequence. transformers does not know about our
packing, so we register one attention function under `ATTENTION_NAME` and load every backbone with
`attn_implementation=ATTENTION_NAME`. Because that name has no entry in transformers' *mask* registry,
the backbone builds no attention mask at all (no `T x T` tensor per layer we would throw away);
instead `PreferenceModel.forward` passes a `VarlenContext` down through the model's `**kwargs`
(`hpref_varlen=...`), which Llama-, Gemma- and BERT-style v5 models forward untouched to the
attention function.

Backends (`attention = ...` in the model config):
  sdpa_segments    one `scaled_dot_product_attention` call per packed sequence (CPU default: no mask
                   tensor, exact per-sequence maths; cost is a Python loop over sequences per layer);
                   a prompt group (`PrefixTree`) gets one call for its prompt and one per answer.
  sdpa_block_mask  one SDPA call over the whole row with a block-diagonal (and causal) boolean mask;
                   fewer kernel launches, but O(T^2) mask memory.
  flash_varlen     `flash_attn.flash_attn_varlen_func` (CUDA, fp16/bf16; supports softcap, sliding
                   window, dropout); prompt groups as one call over `GatheredKeys`. UNTESTED on
                   the development machine (no GPU there; the layout is tested against the kernels'
                   documented semantics).
  torch_varlen     `torch.nn.attention.varlen.varlen_attn` (torch >= 2.9, CUDA, fp16/bf16; no softcap,
                   no attention dropout). UNTESTED on the development machine (no GPU there).
  auto             resolved per call by `resolve_backend` from what the tensors and installed
                   packages allow.

The CPU paths fall back from SDPA to explicit maths (`_math_attention`) only when the layer asks for
logit soft-capping (Gemma 2), which SDPA cannot express.

torch.compile: the CPU paths read Python ints from the context (the segment boundaries), so a
compiled block would specialise on them and recompile per batch; compile blocks only with the GPU
backends, which read nothing but the `cu_seqlens` tensor and `max_seqlen`.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F

from hpref.errors import UserError
from hpref.models.head_logprobs import compute_dtype
from hpref.models.packed_layout import PrefixTree, VarlenContext, window_mask

ATTENTION_NAME = "hpref_varlen"
CONTEXT_KWARG = "hpref_varlen"

Backend = Literal["auto", "sdpa_segments", "sdpa_block_mask", "flash_varlen", "torch_varlen"]
BACKENDS: tuple[str, ...] = ("auto", "sdpa_segments", "sdpa_block_mask", "flash_varlen", "torch_varlen")
_GPU_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flash_varlen_func():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen_func():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


class BackendUnavailable(UserError, RuntimeError):
    """An attention backend asked for by name that cannot run on this machine or these tensors.

    A `UserError` (one line, exit 2: the fix is the recipe's `model.attention`, not hpref's code),
    and a `RuntimeError` for callers that caught what this raised before."""


def backend_problem(
    requested: str,
    *,
    device_type: str,
    dtype: torch.dtype,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> str | None:
    """Why `requested` cannot run on `device_type` in `dtype` (None when it can).

    The one list of requirements, used per call by `resolve_backend` and before any process starts
    by `hpref.train.checks` (which knows the device and precision a run will get, but not yet a
    layer's softcap or dropout)."""
    if requested not in BACKENDS:
        return f"is not a known attention backend; known: {', '.join(BACKENDS)}"
    if requested not in ("flash_varlen", "torch_varlen"):
        return None
    if device_type != "cuda":
        return f"needs a CUDA GPU, and this run computes on {device_type}"
    if requested == "flash_varlen" and _flash_varlen_func() is None:
        return "needs the flash-attn package (pip install 'hpref[gpu]'), which is not installed"
    if requested == "torch_varlen" and _torch_varlen_func() is None:
        return "needs torch.nn.attention.varlen (torch >= 2.9), which this torch lacks"
    if dtype not in _GPU_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return f"needs fp16/bf16 compute, and this run computes in {name} (set train.precision = 'bf16')"
    if requested == "torch_varlen" and (softcap is not None or dropout > 0.0):
        return (
            "supports neither logit softcap nor attention dropout, which this model uses; "
            "use 'flash_varlen' or an sdpa backend"
        )
    return None


def resolve_backend(
    requested: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> str:
    """The concrete backend for one attention call.

    `auto` prefers flash-attn, then torch's varlen kernel, on CUDA with fp16/bf16 (both are
    padding-free and O(T) memory); everything else gets `sdpa_segments`, which is exact and needs no
    mask tensor. A backend asked for by name that cannot run here raises `BackendUnavailable`
    instead of silently switching, so a recipe never measures something other than what it says.
    """
    gpu_ok = device.type == "cuda" and dtype in _GPU_DTYPES
    if requested == "auto":
        if gpu_ok and _flash_varlen_func() is not None:
            return "flash_varlen"
        if gpu_ok and _torch_varlen_func() is not None and softcap is None and dropout == 0.0:
            return "torch_varlen"
        return "sdpa_segments"
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend '{requested}'; known: {', '.join(BACKENDS)}")
    problem = backend_problem(
        requested, device_type=device.type, dtype=dtype, softcap=softcap, dropout=dropout
    )
    if problem is not None:
        raise BackendUnavailable(f"attention '{requested}' {problem}")
    return requested


def _math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    scale: float,
    softcap: float | None,
    dropout: float,
) -> torch.Tensor:
    """Explicit attention for what SDPA cannot do (logit soft-capping). Inputs are `[1, H, L, D]`."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if causal and mask is None:
        length = q.shape[-2]
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout > 0.0:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    scale: float,
    softcap: float | None,
    dropout: float,
) -> torch.Tensor:
    """SDPA on `[1, H, L, D]` (k/v already expanded to H heads), or the math path when soft-capping."""
    if softcap is not None:
        return _math_attention(q, k, v, mask, causal=causal, scale=scale, softcap=softcap, dropout=dropout)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None, scale=scale
    )


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Repeat each KV head `groups` times (GQA) so every CPU path sees matching head counts."""
    if groups == 1:
        return x
    return x.repeat_interleave(groups, dim=1)


def upcast_for_backward(
    q: torch.Tensor, softcap: float | None, k: torch.Tensor | None = None, v: torch.Tensor | None = None
) -> bool:
    """True when a CPU bf16 attention call that autograd will differentiate is cheaper in fp32.

    bf16 is what the call would compute in (`attention_dtype`): the tensors' own dtype, or under
    autocast (the RL trainer's forward) autocast's, whatever dtype RoPE's fp32 tables left q and k
    in. SDPA's fused CPU kernel is slower in bf16 than in fp32 once its backward runs: one thread,
    CPU seconds, 48 packed sequences of 40-300 tokens, forward + backward, bf16 / fp32-with-casts:
    12 heads x 32 (MiniLM) 277 / 169 ms, 4 x 32 causal (tiny-llama) 113 / 63 ms, 8 x 64 causal
    291 / 212 ms. Forward alone is faster in bf16 (37 / 56 ms), so inference keeps bf16.
    """
    given = [t for t in (q, k, v) if t is not None]
    return (
        q.device.type == "cpu"
        and attention_dtype(q, v) == torch.bfloat16
        and softcap is None
        and any(t.requires_grad for t in given)
        and torch.is_grad_enabled()
    )


def attention_dtype(q: torch.Tensor, v: torch.Tensor | None = None) -> torch.dtype:
    """The dtype SDPA computes in here: autocast's where it is on for `q`'s device (CPU autocast
    casts SDPA's inputs to it), else the inputs' promoted dtype (`head_logprobs.compute_dtype`)."""
    return compute_dtype(q, q if v is None else v)


def _sdpa_segments(q, k, v, ctx: VarlenContext, *, causal, scale, window, softcap, dropout) -> torch.Tensor:
    dtype = attention_dtype(q, v)
    fp32 = ctx.fp32_attention and dtype == torch.bfloat16 and softcap is None
    common = {"causal": causal, "scale": scale, "window": window, "softcap": softcap, "dropout": dropout}
    if not (fp32 or upcast_for_backward(q, softcap, k, v)):
        return _each_segment(q, k, v, ctx, **common)
    # one cast per layer, not one per sequence; and autocast off while it attends: CPU autocast
    # runs SDPA in bf16, casting fp32 inputs straight back (under the RL trainer's autocast the
    # attention backward ran bf16's slower kernel: 3.2 vs 1.2 ms a call on SmolLM2). What comes
    # back is in the dtype the call would have given.
    with torch.autocast(q.device.type, enabled=False):
        return _each_segment(q.float(), k.float(), v.float(), ctx, **common).to(dtype)


def _each_segment(q, k, v, ctx: VarlenContext, *, causal, scale, window, softcap, dropout) -> torch.Tensor:
    """`sdpa_segments`' attention in `q`'s dtype: a call per packed sequence (per piece of a tree)."""
    outputs = []
    bounds = ctx.boundaries
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    # One split per tensor, not a slice per segment: a slice's backward writes into a zeroed copy of
    # the whole row, which made the backward O(segments x tokens) per layer.
    segments = zip(q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2), strict=True)
    custom = ctx.segment_masks or [None] * len(lengths)
    for length, own, (q_seg, k_seg, v_seg) in zip(lengths, custom, segments, strict=True):
        if isinstance(own, PrefixTree):
            common = {"scale": scale, "softcap": softcap, "dropout": dropout, "window": window}
            outputs.append(_attend_tree(q_seg, k_seg, v_seg, own, **common))
            continue
        mask = None
        if window is not None and length > window:
            mask = window_mask(length, causal=causal, window=window, device=q.device)
        if own is not None:
            mask = own if mask is None else own & mask
        outputs.append(
            _attend(
                q_seg,
                k_seg,
                v_seg,
                mask,
                causal=causal and own is None,
                scale=scale,
                softcap=softcap,
                dropout=dropout,
            )
        )
    return torch.cat(outputs, dim=2)


def _attend_tree(q, k, v, tree: PrefixTree, *, scale, softcap, dropout, window=None) -> torch.Tensor:
    """One `PrefixTree` sequence's attention (`[1, H, L, D]`), each piece against the keys it may
    see: the prefix causally, then each branch against the prefix and itself. A sliding window
    counts positions in the sequence (a branch's first token follows the prefix's last), not places
    in the packed row, where a later branch sits after its siblings."""
    sizes = [tree.prefix, *tree.branches]
    qs, ks, vs = q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2)
    common = {"scale": scale, "softcap": softcap, "dropout": dropout}
    prefix_mask = None
    if window is not None and tree.prefix > window:
        prefix_mask = window_mask(tree.prefix, causal=True, window=window, device=q.device)
    outputs = [_attend(qs[0], ks[0], vs[0], prefix_mask, causal=True, **common)]
    for i, mask in enumerate(tree.branch_masks, start=1):
        branch = tree.branches[i - 1]
        if not branch:  # an answer of one token: nothing of it is an input
            outputs.append(vs[i])
            continue
        if window is not None:  # the branch's keys are the prefix, then itself: positions 0..p+b-1
            queries = torch.arange(tree.prefix, tree.prefix + branch, device=q.device)
            keys = torch.arange(tree.prefix + branch, device=q.device)
            mask = mask & (queries[:, None] - keys[None, :] < window)
        keys, values = torch.cat([ks[0], ks[i]], dim=2), torch.cat([vs[0], vs[i]], dim=2)
        outputs.append(_attend(qs[i], keys, values, mask, causal=False, **common))
    return torch.cat(outputs, dim=2)


def _sdpa_block_mask(q, k, v, ctx: VarlenContext, *, causal, scale, window, softcap, dropout) -> torch.Tensor:
    mask = ctx.block_mask(causal, window)
    return _attend(q, k, v, mask, causal=False, scale=scale, softcap=softcap, dropout=dropout)


def _flash_window(window: int | None) -> tuple[int, int]:
    return (-1, -1) if window is None else (window - 1, window - 1)


def _kernel_layout(k, v, ctx: VarlenContext) -> tuple[torch.Tensor, ...]:
    """`[T, H, D]` keys and values and the (query, key) offsets and longest lengths a varlen kernel
    takes: the row as packed, or, with prefix trees in it, each piece's keys gathered (`GatheredKeys`)."""
    k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)
    if ctx.segment_masks is None:
        return k, v, ctx.cu_seqlens, ctx.cu_seqlens, ctx.max_seqlen, ctx.max_seqlen
    layout = ctx.gathered_keys()
    k, v = k.index_select(0, layout.index), v.index_select(0, layout.index)
    return k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k


def _flash_varlen(q, k, v, ctx: VarlenContext, *, causal, scale, window, softcap, dropout) -> torch.Tensor:
    """flash-attn's varlen kernel on `[T, H, D]` views. Untested here: the dev machine has no GPU."""
    func = _flash_varlen_func()
    k, v, cu_q, cu_k, max_q, max_k = _kernel_layout(k, v, ctx)
    out = func(
        q[0].transpose(0, 1),
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        dropout_p=dropout,
        softmax_scale=scale,
        causal=causal,
        window_size=_flash_window(window),
        softcap=0.0 if softcap is None else softcap,
    )
    return out.transpose(0, 1).unsqueeze(0)


def _torch_varlen(q, k, v, ctx: VarlenContext, *, causal, scale, window, softcap, dropout) -> torch.Tensor:
    """torch's own varlen flash kernel (GQA native). Untested here: the dev machine has no GPU."""
    func = _torch_varlen_func()
    if window is None:
        window_size = (-1, 0) if causal else (-1, -1)
    else:
        window_size = (window - 1, 0) if causal else (window - 1, window - 1)
    k, v, cu_q, cu_k, max_q, max_k = _kernel_layout(k, v, ctx)
    out = func(
        q[0].transpose(0, 1).contiguous(),  # kernel layout requirements are unverified here: be safe
        k.contiguous(),
        v.contiguous(),
        cu_q,
        cu_k,
        max_q,
        max_k,
        scale=scale,
        window_size=window_size,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1).unsqueeze(0)


#: the varlen kernels (GPU): causal sequences and prefix trees, not boolean masks
_KERNELS = ("flash_varlen", "torch_varlen")

_IMPLEMENTATIONS = {
    "sdpa_segments": _sdpa_segments,
    "sdpa_block_mask": _sdpa_block_mask,
    "flash_varlen": _flash_varlen,
    "torch_varlen": _torch_varlen,
}


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: `[1, H, T, D]` in, `[1, T, H, D]` out.

    Without a `VarlenContext` in kwargs the row is treated as one sequence, so the backbone still
    works when called directly (e.g. by HF utilities) on a single unpadded sequence.
    """
    ctx: VarlenContext | None = kwargs.get(CONTEXT_KWARG)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row (batch 1), got batch {query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("packed attention builds its own masks from cu_seqlens; got an attention_mask")
    if kwargs.get("position_bias") is not None:
        raise ValueError("packed attention does not support additive position biases (T5-style models)")
    total = query.shape[2]
    if ctx is None:
        cu = torch.tensor([0, total], dtype=torch.int32, device=query.device)
        ctx = VarlenContext(backend="auto", cu_seqlens=cu, max_seqlen=total)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if sliding_window is not None and sliding_window >= ctx.max_seqlen:
        sliding_window = None  # a window wider than every sequence is no window
    backend = resolve_backend(
        ctx.backend, device=query.device, dtype=query.dtype, softcap=softcap, dropout=dropout
    )
    if ctx.segment_masks is not None and not (backend in _KERNELS and causal and ctx.trees_only()):
        backend = "sdpa_segments"  # the one path that takes a boolean mask per sequence
    if backend in ("sdpa_segments", "sdpa_block_mask"):
        groups = query.shape[1] // key.shape[1]
        key, value = _expand_kv(key, groups), _expand_kv(value, groups)
    out = _IMPLEMENTATIONS[backend](
        query,
        key,
        value,
        ctx,
        causal=causal,
        scale=scale,
        window=sliding_window,
        softcap=softcap,
        dropout=dropout,
    )
    return out.transpose(1, 2).contiguous(), None


def register_varlen_attention() -> str:
    """Register `varlen_attention_forward` with transformers (idempotent); returns the name to load with."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, varlen_attention_forward)
    return ATTENTION_NAME
