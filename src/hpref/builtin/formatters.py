"""Built-in prompt formatters: `pab` (turn by turn: user, A, B) and `papb` (A's conversation, then
B's) for a judge, `answers` (each answer with its conversation, two sequences) for a reward model.
`build(config, tokenizer, max_length)` returns a `hpref.data.formatting.JudgeFormatter` with
`encode(battle) -> list[int]` (at most max_length ids per sequence)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpref.data.formatting import AnswersConfig, AnswersFormatter, FormatterConfig, JudgeFormatter
from hpref.hookspecs import hookimpl

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def build_pab(config: FormatterConfig, tokenizer: PreTrainedTokenizerBase, max_length: int) -> JudgeFormatter:
    """Judge prompt with each turn's user message, then Assistant A's and B's answers."""
    return JudgeFormatter("pab", config, tokenizer, max_length)


def build_papb(
    config: FormatterConfig, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> JudgeFormatter:
    """Judge prompt with A's whole conversation, then B's."""
    return JudgeFormatter("papb", config, tokenizer, max_length)


def build_answers(
    config: AnswersConfig, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> AnswersFormatter:
    """Reward-model input: A's conversation and B's as two sequences of max_length each (a model
    with head = "reward" scores each one)."""
    return AnswersFormatter(config, tokenizer, max_length)


@hookimpl
def register_formatters(register):
    register(name="pab", config=FormatterConfig, build=build_pab)
    register(name="papb", config=FormatterConfig, build=build_papb)
    register(name="answers", config=AnswersConfig, build=build_answers)
