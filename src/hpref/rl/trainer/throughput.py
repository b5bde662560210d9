"""The RL trainer's model FLOPs and MFU (`train_mfu` in a rollout's metrics, beside
`train_tokens_per_s`), counted the way `hpref train` counts them (`6 N + 12 L H d s` per token,
`hpref.models.pair_logprobs.lm_flops_per_token`) with two differences an RL step needs:

- what is computed, not what is trained: a packed prompt group runs its prompt once and each answer
  on it (`pack_prefix_groups`), so the dense term counts the packed tokens (prompt once) and the
  attention term the (query, key) pairs the packed mask allows (an answer token sees the prompt and
  its own answer), not `prompt + answer` per row; the padded layout (megatron) counts each row's
  real tokens, never its padding;
- a frozen weight costs no weight gradient: with LoRA the base's matmuls count forward and the
  gradient of their input (4 FLOPs per weight per token), the adapters' all three (6), where full
  fine-tuning counts 6 for every weight.

N counts the attention and MLP projections and the LM head (a matmul whether or not it is tied to
the embeddings), from the model's config: the same figure on every backend and rank, sharded or not.
The KL reference's forward is not counted (as verl's MFU does not): it is the algorithm's cost, not
the policy's update. The peak is `hpref.runtime.peak`'s, for the trainer's compute dtype, per device;
a group's MFU divides by all its ranks' devices.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlopShape:
    """What a token's FLOPs depend on: the projections' weights, split into trained and frozen (the
    LM head included), and the attention's layers x heads x head dim."""

    trained: int  # weights whose gradient is computed (all, or LoRA's adapters)
    frozen: int  # weights that only pass gradients through (LoRA's base)
    attention: int  # layers x heads x head_dim

    @classmethod
    def of(cls, config: Any, adapters: list[Any] | None = None) -> FlopShape:
        """From a transformers causal LM's config; `adapters`: the LoRA adapters' weights that train
        (a sharded one counts whole), None for full fine-tuning."""
        d, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or d // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        per_layer = d * head_dim * (2 * heads + 2 * kv) + 3 * d * config.intermediate_size
        dense = config.num_hidden_layers * per_layer + config.vocab_size * d
        attention = config.num_hidden_layers * heads * head_dim
        if adapters is None:
            return cls(trained=dense, frozen=0, attention=attention)
        return cls(trained=sum(w.numel() for w in adapters), frozen=dense, attention=attention)

    def flops(self, tokens: int, context_pairs: int) -> float:
        """A forward and backward over `tokens` tokens whose attention spans `context_pairs`
        (query, key) pairs in all, counted without causal halving (a sequence of n: n x n), the
        torchtitan / PaLM convention `hpref train`'s MFU uses."""
        return (6.0 * self.trained + 4.0 * self.frozen) * tokens + 12.0 * self.attention * context_pairs


def batch_flops(shape: FlopShape, batch: dict[str, Any]) -> float:
    """A micro-batch's forward and backward FLOPs: packed prompt groups (`prefix_lengths`,
    `branch_lengths`), padded rows (`attention_mask`), or prompt groups on a KV cache (`group_batch`,
    the layout before packing, which `benchmarks.rl_trainer_speed` still runs: its real tokens, as
    packed groups)."""
    if "prefix_lengths" in batch:
        return shape.flops(
            *_prefix_groups(zip(batch["prefix_lengths"], batch["branch_lengths"], strict=True))
        )
    if "prompt_attention" in batch:
        prompts = batch["prompt_attention"].sum(dim=1).tolist()
        # an answer's real length: up to its last answer token (the padding after it is not work)
        cols = batch["mask"].shape[1]
        ends = (cols - batch["mask"].flip(1).argmax(dim=1)).tolist()
        size = batch["group_size"]
        return shape.flops(
            *_prefix_groups((p, ends[g * size : (g + 1) * size]) for g, p in enumerate(prompts))
        )
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return shape.flops(int(sum(lengths)), int(sum(n * n for n in lengths)))


def _prefix_groups(groups: Iterable[tuple[int, list[int]]]) -> tuple[int, int]:
    """(tokens, attention pairs) of prompts each run once with their answers on them."""
    tokens = pairs = 0
    for prefix, branches in groups:
        tokens += prefix + sum(branches)
        # the causal pairs doubled, as a plain sequence's n x n: the prompt's p x p and each
        # answer's b x (2p + b) (its tokens see the prompt and their answer so far); a group of
        # one answer counts (p + b)^2, the sequence it is
        pairs += prefix * prefix + sum(b * (2 * prefix + b) for b in branches)
    return int(tokens), int(pairs)


def mfu(flops: float, seconds: float, devices: int, peak_flops: float) -> float:
    """The share of `devices` devices' peak that `flops` in `seconds` used."""
    return flops / max(seconds, 1e-9) / (devices * peak_flops)
