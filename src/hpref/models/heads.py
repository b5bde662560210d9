"""The two heads a `PreferenceModel` puts on its pooled state (see `hpref.models.preference`).

judge   `ClassificationHead`: dropout -> linear -> GELU -> linear(num_labels), 3 logits (A / B / tie).
reward  `RewardHead`: one linear scoring each answer alone; consecutive scores (s_A, s_B) become the
        3 logits `davidson_logits` = [s_A, s_B, log nu + (s_A + s_B) / 2] (Davidson's tie model).

Each head is initialised from its own seed (`seeded_head_state`, `seeded_reward_head_state`), so a
meta-built model gets the same head on every rank; `hf_reward_layout` says where transformers'
sequence-classification model keeps the reward head's weights, for the export.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ClassificationHead(nn.Module):
    """dropout → linear → GELU → linear(num_labels), initialised from its own seed.

    A seeded generator (not the global RNG) makes the head identical on every rank and between a
    meta-device build and a direct build, so `pretrained_state_dict()` can recreate it anywhere.
    """

    def __init__(self, in_features: int, hidden_size: int, num_labels: int, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(in_features, hidden_size)
        self.act = nn.GELU()
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.act(self.dense(self.dropout(pooled))))


def seeded_head_state(
    in_features: int, hidden_size: int, num_labels: int, *, seed: int, std: float
) -> dict[str, torch.Tensor]:
    """The head's initial weights (CPU, fp32): N(0, std) matrices, zero biases, from `seed` alone."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "dense.weight": torch.randn(hidden_size, in_features, generator=gen) * std,
        "dense.bias": torch.zeros(hidden_size),
        "out_proj.weight": torch.randn(num_labels, hidden_size, generator=gen) * std,
        "out_proj.bias": torch.zeros(num_labels),
    }


class RewardHead(nn.Module):
    """One scalar per sequence (`score`: transformers' own sequence-classification linear with one
    label) and the learned tie parameter `log_tie` = log nu of Davidson's model."""

    def __init__(self, in_features: int, bias: bool) -> None:
        super().__init__()
        self.score = nn.Linear(in_features, 1, bias=bias)
        self.log_tie = nn.Parameter(torch.zeros(1))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return davidson_logits(self.score(pooled).squeeze(-1).float(), self.log_tie.float())


def davidson_logits(scores: torch.Tensor, log_tie: torch.Tensor) -> torch.Tensor:
    """`[2n]` scores of consecutive (A, B) sequences -> `[n, 3]` logits whose softmax is Davidson's
    model: P(A) : P(B) : P(tie) = pi_A : pi_B : nu sqrt(pi_A pi_B), pi = exp(s)."""
    if scores.numel() % 2:
        raise ValueError(f"a reward model scores sequences in (A, B) pairs, got {scores.numel()} sequences")
    pairs = scores.reshape(-1, 2)
    tie = log_tie.reshape(()) + pairs.mean(dim=1)
    return torch.cat([pairs, tie[:, None]], dim=1)


def seeded_reward_head_state(
    in_features: int, bias: bool, *, seed: int, std: float
) -> dict[str, torch.Tensor]:
    """The reward head's initial weights from `seed` alone; log nu = 0 until the trainer sets it to
    the labels' prior (`set_output_bias`)."""
    gen = torch.Generator().manual_seed(seed)
    state = {"score.weight": torch.randn(1, in_features, generator=gen) * std, "log_tie": torch.zeros(1)}
    if bias:
        state["score.bias"] = torch.zeros(1)
    return state


def hf_reward_layout(config: Any) -> dict[str, Any]:
    """Where transformers' `AutoModelForSequenceClassification` (one label) keeps what hpref's reward
    model has: the base model's key prefix, the name of the scoring linear, its bias, the class.

    Built on the meta device (no memory). A family whose head is not one linear on the pooled state
    (RoBERTa's two-layer head, DeBERTa's context pooler, ...) is refused: its export would not be the
    model hpref trained.
    """
    import copy

    from transformers import AutoModelForSequenceClassification

    from hpref.errors import UserError

    cfg = copy.deepcopy(config)
    cfg.num_labels = 1
    try:
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(cfg)
    except (ValueError, KeyError) as exc:
        raise UserError(
            "head = 'reward' needs a transformers sequence-classification model for "
            f"{type(config).__name__}: {exc}"
        ) from None
    prefix = model.base_model_prefix
    extra = sorted(k for k in model.state_dict() if not k.startswith(prefix + "."))
    for name in ("score", "classifier"):
        if extra in ([f"{name}.weight"], [f"{name}.bias", f"{name}.weight"]):
            return {"prefix": prefix, "name": name, "bias": len(extra) == 2, "class": type(model).__name__}
    raise UserError(
        f"head = 'reward': {type(model).__name__}'s head is {extra}, not one linear on the pooled state "
        "(hpref's reward head follows Llama-family decoders' score and BERT-family encoders' classifier)"
    )
