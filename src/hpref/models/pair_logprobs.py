"""Answer log-probabilities of packed sequences under a causal LM: what offline DPO trains on.

A packed micro-batch (`hpref.data.packing.PackedBatch`) is one row of sequences back to back, each a
prompt then an answer. The LM (loaded with `attn_implementation = "hpref_varlen"`, `hpref.models.
attention`) runs its decoder over the row with a `VarlenContext`, so no sequence attends across its
boundary and nothing is padded; its LM head runs only where an answer token is predicted (with a
49k-token vocabulary the logits of every prompt position would be most of a step's memory, for
values the loss never reads), in chunks of tokens whose logits are recomputed in the backward
(`hpref.models.head_logprobs`), and each answer's token log-probabilities are summed per sequence.

`PackedLogProbs` is the FSDP2 root around the LM (`shard_causal_lm`): FSDP2 gathers a unit's weights
in its forward hooks, and this computation calls the decoder and the head separately, never the LM's
own `forward`, so the root must be a module whose forward is the whole computation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hpref.models.attention import CONTEXT_KWARG
from hpref.models.head_logprobs import fusable_head, head_logprobs
from hpref.models.packed_layout import PrefixTree, VarlenContext


def answer_positions(
    lengths: Sequence[int], prompt_lengths: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For sequences of `lengths` packed back to back, each an answer after its first
    `prompt_lengths[s]` tokens: (`predict_at` [M], the packed positions whose hidden state predicts an
    answer token, i.e. the token at `predict_at + 1`; `sequence_of` [M], which sequence it belongs to)."""
    at: list[int] = []
    of: list[int] = []
    start = 0
    for s, (n, p) in enumerate(zip(lengths, prompt_lengths, strict=True)):
        first = start + max(p, 1) - 1  # the prompt's last token predicts the answer's first
        at.extend(range(first, start + n - 1))
        of.extend([s] * (start + n - 1 - first))
        start += n
    return torch.tensor(at, dtype=torch.long), torch.tensor(of, dtype=torch.long)


def pack_prefix_groups(
    prefixes: Sequence[list[int]], branches: Sequence[Sequence[list[int]]]
) -> dict[str, Any]:
    """Groups of sequences sharing a prefix, packed back to back without padding (the RL trainer's
    rows: a prompt and its group's answers). Group s is one packed segment, its prefix then every
    branch but the branch's last token (which predicts nothing); each branch attends to the prefix
    and, causally, to itself only (`prefix_tree_mask`), at the positions it would have after its own
    copy of the prefix, so each branch computes what `prefix + branch` alone would, while the prefix
    runs once. A group of one branch is a plain causal sequence.

    Returns `input_ids`, `position_ids` `[T]`, `cu_seqlens` (int32 `[S + 1]`), `max_seqlen`,
    `prefix_lengths` and `branch_lengths` (each segment's prefix and its branches' input tokens),
    and `predict_at [M]`: for every branch token, in (group, branch, token) order, the packed
    position whose hidden state predicts it (the prefix's last one for a branch's first token)."""
    ids: list[int] = []
    positions: list[int] = []
    cu = [0]
    at: list[int] = []
    branch_lengths: list[list[int]] = []
    for prefix, group in zip(prefixes, branches, strict=True):
        start, p = len(ids), len(prefix)
        ids.extend(prefix)
        positions.extend(range(p))
        lengths = []
        for branch in group:
            first = len(ids)
            inputs = branch[:-1]
            ids.extend(inputs)
            positions.extend(range(p, p + len(inputs)))
            lengths.append(len(inputs))
            at.extend([start + p - 1, *range(first, first + len(inputs))][: len(branch)])
        branch_lengths.append(lengths)
        cu.append(len(ids))
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "position_ids": torch.tensor(positions, dtype=torch.long),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "max_seqlen": max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True)),
        "prefix_lengths": [len(p) for p in prefixes],
        "branch_lengths": branch_lengths,
        "predict_at": torch.tensor(at, dtype=torch.long),
    }


def prefix_tree_mask(
    prefix: int, branches: Sequence[int], device: torch.device | None = None
) -> torch.Tensor:
    """Boolean `[L, L]` attention mask of one `pack_prefix_groups` segment (True: the query row may
    attend to the key column): causal, and a branch's token sees the prefix and its own branch only.
    (The attention itself attends such a segment piece by piece: `hpref.models.packed_layout.PrefixTree`.)"""
    return PrefixTree.of(prefix, branches, device).full_mask()


def use_varlen_attention(lm: nn.Module, on: bool) -> None:
    """Switch a transformers LM to the varlen attention function (`hpref.models.attention`), or
    (`on` False) back to the attention it was built with: a padded batch's mask reaches only the
    latter, packed rows' `cu_seqlens` only the former. A no-op when it already runs the one asked."""
    from hpref.models.attention import ATTENTION_NAME, register_varlen_attention

    current = lm.config._attn_implementation
    if on and current != ATTENTION_NAME:
        lm._hpref_built_attention = current  # type: ignore[assignment]
        lm.set_attn_implementation(register_varlen_attention())
    elif not on and current == ATTENTION_NAME and hasattr(lm, "_hpref_built_attention"):
        lm.set_attn_implementation(lm._hpref_built_attention)


def prefix_packed_hidden(lm: nn.Module, packed: dict[str, Any], backend: str = "auto") -> torch.Tensor:
    """The decoder's last hidden states `[T, H]` over a `pack_prefix_groups` layout. The LM is
    switched to the varlen attention function (`use_varlen_attention`) and stays on it until a
    padded batch switches it back: an activation-checkpointed block recomputes its forward in the
    backward, which must run the same attention. On the CPU path attention runs in fp32 in every
    forward (as `PackedLogProbs`), so a reference's forward without gradient computes what the
    policy's does; on a GPU both run the varlen kernel, each prompt group in one call
    (`hpref.models.packed_layout.GatheredKeys`)."""
    use_varlen_attention(lm, True)
    cu = packed["cu_seqlens"]
    masks: list[PrefixTree | None] = [
        PrefixTree.of(p, b, cu.device) if len(b) > 1 else None
        for p, b in zip(packed["prefix_lengths"], packed["branch_lengths"], strict=True)
    ]
    ctx = VarlenContext(
        backend=backend,
        cu_seqlens=cu.to(torch.int32),
        max_seqlen=int(packed["max_seqlen"]),
        fp32_attention=True,
        segment_masks=masks if any(m is not None for m in masks) else None,
    )
    return lm.get_decoder()(
        input_ids=packed["input_ids"][None],
        position_ids=packed["position_ids"][None],
        use_cache=False,
        **{CONTEXT_KWARG: ctx},
    ).last_hidden_state[0]


def answer_token_logprobs(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """`[N]` float32 log-probs of `targets` under `head` over `hidden [N, H]`: a plain linear head
    chunked over tokens with its logits recomputed in the backward (`hpref.models.head_logprobs`:
    the `[N, V]` logits never held), another head (a LoRA'd one) through its own logits."""
    if fusable_head(head):
        return head_logprobs(hidden, head, targets, entropy=False)[0]
    return -nn.functional.cross_entropy(head(hidden).float(), targets, reduction="none")


class PackedLogProbs(nn.Module):
    """`forward(...) -> [S]`: each packed sequence's answer log-probability (float32 sums; see the
    module docstring). `backend`: the varlen attention backend (`hpref.models.attention.BACKENDS`)."""

    def __init__(self, lm: nn.Module, backend: str = "auto") -> None:
        super().__init__()
        self.lm = lm
        self.backend = backend

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        predict_at: torch.Tensor,
        sequence_of: torch.Tensor,
    ) -> torch.Tensor:
        # fp32 attention in every forward: the reference's (no gradient) must compute exactly what the
        # policy's (with gradient) does, or the implicit rewards start off zero under bf16
        ctx = VarlenContext(
            backend=self.backend,
            cu_seqlens=cu_seqlens.to(torch.int32),
            max_seqlen=max_seqlen,
            fp32_attention=True,
        )
        hidden = self.lm.get_decoder()(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            use_cache=False,
            **{CONTEXT_KWARG: ctx},
        ).last_hidden_state[0]
        # Always run the head on at least one position: a micro-batch of fillers has no answer token,
        # and a unit whose parameters get no gradient on one rank would leave FSDP2's gradient
        # reduction uneven across ranks. The extra row counts for nothing (weight 0).
        at = torch.cat([predict_at, predict_at.new_zeros(1)])
        targets = input_ids[(at + 1).clamp(max=input_ids.numel() - 1)]
        token_logps = answer_token_logprobs(hidden[at], self.lm.get_output_embeddings(), targets)
        token_logps = token_logps * torch.cat(
            [token_logps.new_ones(predict_at.numel()), token_logps.new_zeros(1)]
        )
        num_sequences = cu_seqlens.numel() - 1
        of = torch.cat([sequence_of, sequence_of.new_zeros(1)])
        return token_logps.new_zeros(num_sequences).index_add(0, of, token_logps)


def disable_dropout(module: nn.Module) -> None:
    """Every dropout off (TRL's `disable_dropout=True`): the policy's and the reference's log-probs
    must be the same function of the weights, or the implicit rewards are noise at the start."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "attention_dropout"):
        config.attention_dropout = 0.0
        for m in module.modules():
            if hasattr(m, "attention_dropout") and isinstance(m.attention_dropout, float):
                m.attention_dropout = 0.0


def shard_causal_lm(root: PackedLogProbs, param_dtype: torch.dtype) -> PackedLogProbs:
    """FSDP2 over every rank: each decoder block its own unit, the rest (embeddings, final norm, head)
    in the root, as `hpref.models.parallelize` does for preference models: fp32 master weights of what
    trains, compute in `param_dtype`, gradients reduced in fp32; with LoRA the frozen base is stored in
    the compute dtype (it never steps, so an fp32 copy would only double its memory)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from hpref.models.adapters import freeze_dtype
    from hpref.models.lm_adapters import decoder_blocks

    if not dist.is_initialized():
        raise RuntimeError("shard_causal_lm needs a process group (the worker creates one, even for 1 rank)")
    policy = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype, reduce_dtype=torch.float32
    )
    if param_dtype != torch.float32:
        freeze_dtype(root, param_dtype)
    for block in decoder_blocks(root.lm):
        fully_shard(block, mp_policy=policy)
    fully_shard(root, mp_policy=policy)
    return root


def lm_flops_per_token(config: object, params: int, seq_len: float) -> float:
    """Training FLOPs per token of a causal LM (forward + backward), `6 N + 12 L H d s`, as
    `PreferenceModel.flops_per_token` counts them (N: the parameters outside the embeddings)."""
    heads = config.num_attention_heads  # type: ignore[attr-defined]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # type: ignore[attr-defined]
    layers = config.num_hidden_layers  # type: ignore[attr-defined]
    return 6.0 * params + 12.0 * layers * heads * head_dim * seq_len
