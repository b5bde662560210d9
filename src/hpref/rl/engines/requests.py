"""What an engine is asked and what it answers, the same for every engine: a `generate_batch` request
(`generate_request`) and a generation (`generation_result`, decoded and cut at stop strings by the
policy's own tokenizer so every engine gives the reward the same text for the same tokens)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hpref.rl.policy import stop_string_cut

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def generation_result(
    tokenizer: PreTrainedTokenizerBase,
    rows: list[list[int]],
    completions: list[list[int]],
    logprobs: list[list[float]],
    version: int,
    started: float,
    stop: Sequence[str] = (),
) -> dict[str, Any]:
    """What every engine's `generate` returns (`hpref.rl.protocols.Engine`); texts are decoded by the
    policy's own tokenizer, so every engine gives the reward the same text for the same tokens, and
    each answer is cut at its first `stop` string here (`stop_string_cut`: tokens, log-probs and text
    alike), so every engine ends answers at the same place."""
    if stop:
        keep = [stop_string_cut(tokenizer, c, stop) for c in completions]
        completions = [c[:k] for c, k in zip(completions, keep, strict=True)]
        logprobs = [lp[:k] for lp, k in zip(logprobs, keep, strict=True)]
    return {
        "prompt_ids": rows,
        "completions": completions,
        "logprobs": logprobs,
        "texts": [tokenizer.decode(c, skip_special_tokens=True) for c in completions],
        "version": version,
        "tokens": sum(len(c) for c in completions),
        "seconds": time.perf_counter() - started,
    }


def generate_request(
    prompts: list[tuple[str, ...]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int = 0,
    seed: int = 0,
    greedy: bool = False,
    adapter: str | None = None,
    **knobs: Any,
) -> dict[str, Any]:
    """`generate`'s arguments as one request of `generate_batch` (every engine's `generate` is the
    batch of its one request, so a request is served alike alone or batched); `knobs`: the sampling
    knobs that are on (`hpref.recipe.rl_sampling`), absent ones off."""
    return dict(
        prompts=prompts,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        greedy=greedy,
        adapter=adapter,
        **knobs,
    )
