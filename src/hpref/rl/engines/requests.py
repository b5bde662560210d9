"""What an engine answers, the same for every engine: the `Generation` of a request
(`hpref.rl.rollout_types`, beside the `GenerationRequest` it answers), built by `generation_result`,
decoded and cut at stop strings by the policy's own tokenizer so every engine gives the reward the
same text for the same tokens."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hpref.rl.policy import stop_string_cut
from hpref.rl.rollout_types import Generation

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
) -> Generation:
    """What every engine's `generate` returns (`hpref.rl.protocols.Engine`); texts are decoded by the
    policy's own tokenizer, so every engine gives the reward the same text for the same tokens, and
    each answer is cut at its first `stop` string here (`stop_string_cut`: tokens, log-probs and text
    alike), so every engine ends answers at the same place."""
    if stop:
        keep = [stop_string_cut(tokenizer, c, stop) for c in completions]
        completions = [c[:k] for c, k in zip(completions, keep, strict=True)]
        logprobs = [lp[:k] for lp, k in zip(logprobs, keep, strict=True)]
    return Generation(
        prompt_ids=rows,
        completions=completions,
        logprobs=logprobs,
        texts=[tokenizer.decode(c, skip_special_tokens=True) for c in completions],
        version=version,
        tokens=sum(len(c) for c in completions),
        seconds=time.perf_counter() - started,
    )
