"""How the transformers engine draws answers: each request's rows from its own seeded stream.

    sampler = RowSampler([Block(0, 32, temperature=1.0, top_k=0, greedy=False, seed=s_a),
                          Block(32, 64, temperature=0.7, top_k=0, greedy=False, seed=s_b, top_p=0.9)],
                         prompt_starts)
    out = model.generate(..., do_sample=False, logits_processor=[sampler],
                         stopping_criteria=StoppingCriteriaList([StopAtStrings(tokenizer, blocks, width)]))
    sampler.token_logprobs()   # [rows, steps]: each chosen token's log-prob at its temperature

transformers' own sampling draws every row from torch's one global generator, so what a row gets
depends on which other rows share its batch. A shared-base engine (`rl.share_base`) batches several
policies' requests together, and a policy's rollouts must not depend on that: here each request
(a block of rows) draws Gumbel noise from a generator of its own seed, and the token is
`argmax(logits / T + Gumbel)` over the tokens its knobs leave, an exact sample of that softmax (the
Gumbel-max trick). A request's answers are then the same alone or batched with any others, step for
step, whatever knobs the others have. `generate` runs greedy over the scores this processor returns
(the chosen token 0, the rest -inf), so it emits exactly the sampled token.

The knobs (`hpref.recipe.rl_sampling`) apply in vLLM's order, so that both engines mean the same:
repetition penalty, temperature, min-p, top-k, top-p (transformers' own warpers apply min-p after
top-p; the two orders differ only when min_p and top_p are both set). A greedy row takes the
penalty and nothing else. The recorded log-prob is not the truncated distribution's: it is what the
trainer computes, the chosen token's log-prob under the model's full softmax at the temperature, so
penalties and truncation make the engine sample from a distribution other than the one the loss's
ratio starts from (as in TRL and verl), and the run's `engine_trainer_logprob_diff` shows by how much.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hpref.recipe.rl_sampling import KNOBS_OFF

if TYPE_CHECKING:
    from hpref.rl.rollout_types import GenerationRequest


@dataclass(frozen=True)
class Block:
    """One request's rows `[start, stop)` of a batch and how they are drawn (`stop_strings`: where
    an answer ends, `StopAtStrings`)."""

    start: int
    stop: int
    temperature: float
    top_k: int
    greedy: bool
    seed: int
    top_p: float = KNOBS_OFF["top_p"]
    min_p: float = KNOBS_OFF["min_p"]
    repetition_penalty: float = KNOBS_OFF["repetition_penalty"]
    stop_strings: tuple[str, ...] = ()

    @classmethod
    def of_request(cls, request: GenerationRequest, start: int, stop: int) -> Block:
        """The block of a `generate_batch` request."""
        return cls(
            start,
            stop,
            request.temperature,
            request.top_k,
            request.greedy,
            request.seed,
            top_p=request.top_p,
            min_p=request.min_p,
            repetition_penalty=request.repetition_penalty,
            stop_strings=request.stop,
        )


def penalised(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (transformers' and vLLM's): the logit of every token that `seen`
    (`[rows, positions]` token ids; ids >= the vocabulary are no token) holds, divided by `penalty`
    when positive and multiplied by it when not."""
    rows, vocab = logits.shape
    mask = torch.zeros((rows, vocab + 1), dtype=torch.bool, device=logits.device)
    mask.scatter_(1, seen.clamp(max=vocab), True)
    penalty_applied = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(mask[:, :vocab], penalty_applied, logits)


def truncated(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """`scaled` (logits at the temperature) with the tokens min-p, top-k and top-p drop at -inf, in
    vLLM's order (the module docstring); the likeliest token always stays."""
    if min_p > 0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if top_k:
        kth = torch.topk(scaled, min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1:
        ascending, order = scaled.sort(dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False
        scaled = scaled.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scaled


class RowSampler:
    """A transformers `LogitsProcessor` that draws each block's next tokens from its own generator
    (see the module docstring) and records each chosen token's log-prob: at the block's temperature
    under the full distribution (what the trainer computes), unscaled for greedy rows.

    `prompt_starts`: each row's first prompt column (rows are left-padded), so that the repetition
    penalty sees the row's prompt and answer tokens and never its padding; none: no padding."""

    def __init__(self, blocks: list[Block], prompt_starts: Sequence[int] | None = None) -> None:
        self.blocks = blocks
        self.generators = [torch.Generator().manual_seed(b.seed) for b in blocks]
        rows = blocks[-1].stop if blocks else 0
        self.prompt_starts = torch.tensor(list(prompt_starts) if prompt_starts is not None else [0] * rows)
        self.steps: list[torch.Tensor] = []  # per step: [rows] log-probs of the chosen tokens

    def __call__(self, input_ids: Any, scores: torch.Tensor) -> torch.Tensor:
        choices = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
        logprobs = torch.empty(scores.shape[0], dtype=torch.float32, device=scores.device)
        for block, generator in zip(self.blocks, self.generators, strict=True):
            raw = scores[block.start : block.stop].float()
            logits = raw  # what the knobs draw from; the log-prob is read from `raw`
            if block.repetition_penalty != 1.0:
                logits = penalised(raw, self._seen(input_ids, block), block.repetition_penalty)
            if block.greedy:
                logp = torch.log_softmax(raw, dim=-1)
                choice = logits.argmax(dim=-1)
            else:
                logp = torch.log_softmax(raw / block.temperature, dim=-1)
                scaled = truncated(logits / block.temperature, block.top_k, block.top_p, block.min_p)
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

    def _seen(self, input_ids: torch.Tensor, block: Block) -> torch.Tensor:
        """The block's rows' prompt and answer tokens so far, with the left padding as no token."""
        ids = input_ids[block.start : block.stop]
        columns = torch.arange(ids.shape[1], device=ids.device)
        padding = columns[None, :] < self.prompt_starts[block.start : block.stop, None].to(ids.device)
        return ids.masked_fill(padding, torch.iinfo(ids.dtype).max)

    def token_logprobs(self) -> torch.Tensor:
        """`[rows, steps]`: the log-prob of every token chosen so far."""
        if not self.steps:
            return torch.zeros((self.blocks[-1].stop if self.blocks else 0, 0))
        return torch.stack(self.steps, dim=1)


class StopAtStrings:
    """A transformers stopping criterion: a row is done once its answer's text (its tokens after the
    prompt's `width` columns, decoded as every engine decodes answers) holds one of its block's stop
    strings. It only ends a row early; the answer is then cut at the stop string by
    `hpref.rl.policy.stop_string_cut`, the same for every engine. transformers' own
    `StopStringCriteria` takes one list for the whole batch and matches across the prompt's end;
    here each request has its own list, and only the answer counts, as in the cut."""

    def __init__(self, tokenizer: Any, blocks: list[Block], width: int) -> None:
        self.tokenizer, self.width = tokenizer, width
        self.rows = [(i, b.stop_strings) for b in blocks if b.stop_strings for i in range(b.start, b.stop)]
        self.done: set[int] = set()

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        pending = [(i, strings) for i, strings in self.rows if i not in self.done]
        if pending:
            answers = input_ids[[i for i, _ in pending], self.width :].tolist()
            texts = self.tokenizer.batch_decode(answers, skip_special_tokens=True)
            for (i, strings), text in zip(pending, texts, strict=True):
                if any(s in text for s in strings):
                    self.done.add(i)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.done:
            done[sorted(self.done)] = True
        return done
