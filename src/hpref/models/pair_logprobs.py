"""Answer log-probabilities of packed sequences under a causal LM: what offline DPO trains on.

A packed micro-batch (`hpref.data.packing.PackedBatch`) is one row of sequences back to back, each a
prompt then an answer. The LM (loaded with `attn_implementation = "hpref_varlen"`, `hpref.models.
attention`) runs its decoder over the row with a `VarlenContext`, so no sequence attends across its
boundary and nothing is padded; its LM head runs only where an answer token is predicted (with a
49k-token vocabulary the logits of every prompt position would be most of a step's memory, for
values the loss never reads), and each answer's token log-probabilities are summed per sequence.

`PackedLogProbs` is the FSDP2 root around the LM (`shard_causal_lm`): FSDP2 gathers a unit's weights
in its forward hooks, and this computation calls the decoder and the head separately, never the LM's
own `forward`, so the root must be a module whose forward is the whole computation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hpref.models.attention import CONTEXT_KWARG, VarlenContext


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
        logits = self.lm.get_output_embeddings()(hidden[at]).float()
        targets = input_ids[(at + 1).clamp(max=input_ids.numel() - 1)]
        token_logps = -nn.functional.cross_entropy(logits, targets, reduction="none")
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
