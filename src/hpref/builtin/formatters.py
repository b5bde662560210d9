"""Built-in prompt formatters: `pab` (turn by turn: user, A, B) and `papb` (A's conversation, then
B's). `build(config, tokenizer, max_length)` returns a `hpref.data.formatting.JudgeFormatter` with
`encode(battle) -> list[int]` (at most max_length ids, ending where the verdict would start)."""

from __future__ import annotations

from typing import Any

from hpref.data.formatting import FormatterConfig, JudgeFormatter
from hpref.hookspecs import hookimpl


def build_pab(config: FormatterConfig, tokenizer: Any, max_length: int) -> JudgeFormatter:
    """Judge prompt with each turn's user message, then Assistant A's and B's answers."""
    return JudgeFormatter("pab", config, tokenizer, max_length)


def build_papb(config: FormatterConfig, tokenizer: Any, max_length: int) -> JudgeFormatter:
    """Judge prompt with A's whole conversation, then B's."""
    return JudgeFormatter("papb", config, tokenizer, max_length)


@hookimpl
def register_formatters(register):
    register(name="pab", config=FormatterConfig, build=build_pab)
    register(name="papb", config=FormatterConfig, build=build_papb)
