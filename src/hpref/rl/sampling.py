"""How the transformers engine draws answers: each request's rows from its own seeded stream.

    sampler = RowSampler([Block(0, 32, temperature=1.0, top_k=0, greedy=False, seed=s_a),
                          Block(32, 64, temperature=0.7, top_k=0, greedy=False, seed=s_b)])
    out = model.generate(..., do_sample=False, logits_processor=[sampler])
    sampler.tokens_logprobs()   # [rows, steps]: each chosen token's log-prob at its temperature

transformers' own sampling draws every row from torch's one global generator, so what a row gets
depends on which other rows share its batch. A shared-base engine (`rl.share_base`) batches several
policies' requests together, and a policy's rollouts must not depend on that: here each request
(a block of rows) draws Gumbel noise from a generator of its own seed, and the token is
`argmax(logits / T + Gumbel)` over the top-k, an exact sample of the softmax (the Gumbel-max
trick). A request's answers are then the same alone or batched with any others, step for step.
`generate` runs greedy over the scores this processor returns (the chosen token 0, the rest -inf),
so it emits exactly the sampled token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Block:
    """One request's rows `[start, stop)` of a batch and how they are drawn."""

    start: int
    stop: int
    temperature: float
    top_k: int
    greedy: bool
    seed: int


class RowSampler:
    """A transformers `LogitsProcessor` that draws each block's next tokens from its own generator
    (see the module docstring) and records each chosen token's log-prob: at the block's temperature
    under the full distribution (what the trainer computes), unscaled for greedy rows."""

    def __init__(self, blocks: list[Block]) -> None:
        self.blocks = blocks
        self.generators = [torch.Generator().manual_seed(b.seed) for b in blocks]
        self.steps: list[torch.Tensor] = []  # per step: [rows] log-probs of the chosen tokens

    def __call__(self, input_ids: Any, scores: torch.Tensor) -> torch.Tensor:
        choices = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
        logprobs = torch.empty(scores.shape[0], dtype=torch.float32, device=scores.device)
        for block, generator in zip(self.blocks, self.generators, strict=True):
            logits = scores[block.start : block.stop].float()
            if block.greedy:
                logp = torch.log_softmax(logits, dim=-1)
                choice = logits.argmax(dim=-1)
            else:
                scaled = logits / block.temperature
                logp = torch.log_softmax(scaled, dim=-1)
                if block.top_k:
                    kth = torch.topk(scaled, min(block.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                # drawn on the CPU whatever the device: the same stream anywhere
                uniform = torch.rand(scaled.shape, generator=generator).to(scaled.device)
                gumbel = -torch.log(-torch.log(uniform.clamp(min=torch.finfo(torch.float32).tiny)))
                choice = (scaled + gumbel).argmax(dim=-1)
            choices[block.start : block.stop] = choice
            logprobs[block.start : block.stop] = logp.gather(-1, choice[:, None]).squeeze(-1)
        self.steps.append(logprobs)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(-1, choices[:, None], 0.0)
        return out

    def token_logprobs(self) -> torch.Tensor:
        """`[rows, steps]`: the log-prob of every token chosen so far."""
        if not self.steps:
            return torch.zeros((self.blocks[-1].stop if self.blocks else 0, 0))
        return torch.stack(self.steps, dim=1)
