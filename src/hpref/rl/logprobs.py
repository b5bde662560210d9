"""A policy's token numbers every room uses: the log-probability of each sampled token and the entropy
of the sampling distribution, as small pure torch functions (the trainer's step, the transformers
engine's log-probs, the warm-up's loss and the trainer's entropy metrics all take them from here).

Shapes: `logits [B, T, V]` predict `tokens [B, T]` (already shifted); `mask [B, T]` is 1 on completion
tokens the policy produced and 0 on padding and prompt tokens.
"""

from __future__ import annotations

import torch

#: a token whose sampling distribution has less entropy than this (nats) counts as low-entropy in
#: `low_entropy_share`. 0.672 is the boundary Wang et al. 2025 ("Beyond the 80/20 Rule: High-Entropy
#: Minority Tokens Drive Effective RL for LLM Reasoning") draw between the "following" tokens and the
#: "forking" ones that carry RL's gains (the 80th percentile of Qwen3-8B's chain-of-thought tokens):
#: a share that climbs towards 1 means the forks are closing, the collapse people plot entropy for.
LOW_ENTROPY_NATS = 0.672


def token_entropy(
    logits: torch.Tensor, temperature: float = 1.0, chunk_elements: int = 1 << 24
) -> torch.Tensor:
    """The entropy (nats) of `softmax(logits / temperature)` for each row of `logits [N, V]`, as `[N]`
    float32, without gradient. Taken `chunk_elements` logits at a time (64 MiB of float32 each): the
    softmax of every row at once would add a few float32 copies of the head's logits to a step's peak
    memory at a 49k-token vocabulary."""
    rows = max(1, chunk_elements // max(logits.shape[-1], 1))
    out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for start in range(0, logits.shape[0], rows):
            logp = torch.log_softmax(logits[start : start + rows].float() / temperature, dim=-1)
            out[start : start + rows] = -(logp.exp() * logp).sum(-1)
    return out


def entropy_sums(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    rows: list[int] | None = None,
    sampled: list[bool] | None = None,
) -> dict[str, float]:
    """A micro-batch's entropy statistics as sums that add up over micro-batches and ranks: the
    entropy of the masked tokens, how many are below `LOW_ENTROPY_NATS`, and how many there are.
    `sampled[rows[i]]` False leaves row i out (`TrainingRows.sampled`: not the policy's own answer)."""
    keep = mask.bool()
    if sampled is not None and rows is not None:
        keep = keep & torch.tensor([sampled[r] for r in rows], device=keep.device)[:, None]
    values = entropy[keep]
    return {
        "entropy_sum": float(values.sum()),
        "entropy_low_tokens": float((values < LOW_ENTROPY_NATS).sum()),
        "entropy_tokens": float(values.numel()),
    }


def entropy_metrics(sums: dict[str, float]) -> dict[str, float]:
    """`entropy` (the token mean) and `low_entropy_share` from the summed `entropy_sums`."""
    tokens = max(sums.get("entropy_tokens", 0.0), 1.0)
    return {
        "entropy": sums.get("entropy_sum", 0.0) / tokens,
        "low_entropy_share": sums.get("entropy_low_tokens", 0.0) / tokens,
    }


def sequence_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token: `logits [B, T, V]` predicting `tokens [B, T]` (already
    shifted: `logits[:, t]` is the distribution the model gave `tokens[:, t]`). Computed in float32
    with log_softmax + gather, never materialising probabilities."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
