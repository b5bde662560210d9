"""The training loss of a preference model: soft-label cross-entropy per sequence."""

from __future__ import annotations

import torch


def soft_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sequence cross-entropy against label distributions `[n, C]` (one-hot for hard labels),
    computed in float32 whatever the logits' dtype."""
    return -(labels * torch.log_softmax(logits.float(), dim=-1)).sum(dim=-1)
