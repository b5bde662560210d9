"""Prompts for `hpref rl`: the conversation before the final answer, read from the files hpref reads.

A prompt is a tuple of turns alternating user, assistant, user, ... and ending with the user turn the
policy answers: `("What is 2+2?",)`, or `("hi", "Hello! How can I help?", "Tell me a joke")`. The
readers give `Battle` records; `prompt_of_battle` keeps every turn before the final answers (earlier
assistant turns from side A: in HH-RLHF both sides share them, in an arena battle they are model A's).

`PromptFileReader` reads a plain file of prompts (a `prompt` column, a string or a message list, or
a `messages` column in chat format whose trailing assistant message, if any, is the answer and is
dropped) as battles whose final answers are still empty, so it shares the readers' row-exact errors
and `on_error` policy.

`PromptSet` turns a stream of prompts into what the rollout executor draws from:

- duplicates (same text up to case and whitespace) kept once, prompts longer than `max_prompt_chars`
  (characters, not tokens: policies with different tokenizers must answer the same prompts) and
  prompts with an empty final turn left out, each counted and logged, never dropped silently;
- a held-out eval split by a hash of the prompt (`eval_fraction`), so the same prompt is never in
  both and the split does not move with the run seed or the file's order;
- training prompt i of the stream depends only on (seed, i): the training prompts in a seeded order,
  a new order each pass. Rollout r takes prompts [r * n, (r + 1) * n), so a resumed run continues
  exactly where the saved position says and replays nothing.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from loguru import logger
from pydantic import Field

from hpref.data.base import RowError
from hpref.data.readers import FileConfig, TableReader, _text_or_none
from hpref.data.records import Battle
from hpref.data.splits import prompt_key
from hpref.data.tables import clean_text, is_missing
from hpref.data.transcripts import parse_messages, to_turns
from hpref.errors import DataError

Prompt = tuple[str, ...]


def prompt_of_battle(battle: Battle) -> Prompt:
    """The conversation before the battle's final answers: user turns interleaved with side A's
    earlier answers, ending with the last user turn."""
    turns: list[str] = []
    last = len(battle.prompt) - 1
    for i, user in enumerate(battle.prompt):
        turns.append(user)
        if i < last:
            turns.append(battle.response_a[i] if i < len(battle.response_a) else "")
    return tuple(turns)


def conversation_messages(prompt: Prompt) -> list[dict[str, str]]:
    """A prompt as chat messages (`{"role", "content"}`), for a tokenizer's chat template."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(prompt)]


def prompt_of_messages(messages: list[tuple[str, str]]) -> Prompt:
    """(role, text) messages ending with the user turn to answer -> a prompt (system text joins the
    first user turn, `hpref.data.transcripts.to_turns`); () when there is no user text to answer."""
    users, answers = to_turns(messages)
    if not users or not users[-1].strip():
        return ()
    turns: list[str] = []
    for i, user in enumerate(users):
        turns.append(user)
        if i < len(users) - 1:
            turns.append(answers[i])
    return tuple(turns)


def battle_with_answers(prompt: Prompt, answer_a: str, answer_b: str, battle_id: str = "rl") -> Battle:
    """The battle a judge reads: the prompt's conversation, then two final answers."""
    users = prompt[0::2]
    earlier = prompt[1::2]
    return Battle(battle_id, tuple(users), (*earlier, answer_a), (*earlier, answer_b))


# --------------------------------------------------------------------------------------------------
# a plain file of prompts


class PromptFileConfig(FileConfig):
    prompt_column: str = Field(
        "prompt", description="column holding a prompt: a string, or a message list (JSON or native)"
    )
    messages_column: str = Field(
        "messages",
        description="chat-format column, used when the file has no prompt column; a trailing assistant "
        "message is the answer and is dropped",
    )


class PromptFileReader(TableReader):
    """Prompts from a CSV, Parquet or JSONL file, as battles whose final answers are empty."""

    def __init__(self, config: PromptFileConfig, seed: int = 0) -> None:
        super().__init__(config, seed)
        columns = set(self.file.columns)
        if config.prompt_column in columns:
            self.column = config.prompt_column
        elif config.messages_column in columns:
            self.column = config.messages_column
        else:
            raise DataError(
                f"{self.source}: no '{config.prompt_column}' or '{config.messages_column}' column "
                f"(found: {', '.join(self.file.columns) or 'none'})"
            )

    def _parse(self, row: dict[str, Any]) -> Battle:
        column = self.column
        if column not in row or is_missing(row[column]):
            raise RowError(column, "missing value")
        value = row[column]
        if isinstance(value, str) and not value.lstrip().startswith("["):
            if not value.strip():
                raise RowError(column, "empty prompt")
            messages = [("user", clean_text(value))]
        else:
            messages = parse_messages(value, column)
        while messages and messages[-1][0] == "assistant":  # the final answer is the policy's to write
            messages.pop()
        users, answers = to_turns(messages)
        if not users or not users[-1].strip():
            raise RowError(column, "no user message to answer")
        row_id = _text_or_none(row.get("id")) or prompt_key(tuple(users)).hex()
        return Battle(row_id, tuple(users), tuple(answers), tuple(answers))


# --------------------------------------------------------------------------------------------------
# the set the rollout executor draws from


def stream_rng(*parts: object) -> random.Random:
    """A `random.Random` fixed by `parts`: element i of a seeded stream depends only on (seed, i)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def unit_hash(prompt: Prompt, salt: int) -> float:
    """A number in [0, 1) fixed by the prompt's text (case and whitespace ignored) and `salt`: the
    eval split's (below `eval_fraction`: held out), here and in the rl warm-up on a user's data."""
    digest = hashlib.blake2b(prompt_key(prompt) + str(salt).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


@dataclass
class PromptSet:
    """Training and eval prompts of one source (see the module docstring). Satisfies
    `hpref.rl.protocols.PromptSource`; no ground truth (that is the synthetic arena's alone)."""

    ground_truth = False  # a class attribute, not a field

    source: str
    train: list[Prompt]
    eval: list[Prompt]
    counts: Counter[str] = field(default_factory=Counter)
    #: the file's other columns (beside the conversation's), every row carrying them
    columns: tuple[str, ...] = ()
    #: each kept prompt's row (its `columns`; the first row of a duplicated prompt), by `prompt_key`
    rows: dict[bytes, dict[str, Any]] = field(default_factory=dict, repr=False)
    _orders: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        source: str,
        prompts: Iterable[tuple[Prompt, dict[str, Any]]],
        *,
        eval_fraction: float,
        max_prompt_chars: int | None,
        split_seed: int = 0,
    ) -> PromptSet:
        """Deduplicate, cap, and split `prompts`, each with its row's other columns (`{}` for none);
        raises `DataError` when no training prompt is left."""
        counts: Counter[str] = Counter()
        seen: set[bytes] = set()
        train: list[Prompt] = []
        held_out: list[tuple[float, Prompt]] = []
        rows: dict[bytes, dict[str, Any]] = {}
        columns: set[str] | None = None
        for prompt, row in prompts:
            counts["read"] += 1
            if not prompt or not prompt[-1].strip():
                counts["empty final turn"] += 1
                continue
            if max_prompt_chars is not None and sum(len(t) for t in prompt) > max_prompt_chars:
                counts[f"longer than max_prompt_chars = {max_prompt_chars}"] += 1
                continue
            key = prompt_key(prompt)
            if key in seen:
                counts["duplicate"] += 1
                continue
            seen.add(key)
            # a column is the source's only when every row has it (JSONL rows may differ)
            columns = set(row) if columns is None else columns & set(row)
            if row:
                rows[key] = row
            position = unit_hash(prompt, split_seed)
            if position < eval_fraction:
                held_out.append((position, prompt))
            else:
                train.append(prompt)
        # eval prompts in hash order: the first n of them are the same whatever the file order
        evals = [p for _, p in sorted(held_out, key=lambda item: item[0])]
        counts["train"], counts["eval"] = len(train), len(evals)
        left_out = {k: v for k, v in counts.items() if k not in ("read", "train", "eval")}
        detail = "; ".join(f"{n} {reason}" for reason, n in sorted(left_out.items()))
        if not train:
            raise DataError(
                f"{source}: no usable training prompts ({counts['read']} read, {len(evals)} held out for "
                f"eval{'; left out: ' + detail if detail else ''})"
            )
        logger.info(
            f"prompts from {source}: {counts['read']} read, {len(train)} train, {len(evals)} eval"
            + (f" (left out: {detail})" if detail else "")
        )
        return cls(source, train, evals, counts, tuple(sorted(columns or ())), rows)

    def row(self, prompt: Prompt) -> dict[str, Any]:
        """The columns of the row `prompt` came from (a reference answer, a label, an id), as the
        file had them; `{}` for a prompt of no row."""
        return dict(self.rows.get(prompt_key(prompt), {}))

    def train_prompts(self, seed: int, first: int, count: int) -> list[Prompt]:
        """Training prompts `first .. first + count - 1` of the stream of `seed` (see the module
        docstring): pass `e` over the training prompts is a permutation seeded by (seed, e)."""
        n = len(self.train)
        out = []
        for i in range(first, first + count):
            epoch, index = divmod(i, n)
            order = self._orders.get((seed, epoch))
            if order is None:
                order = list(range(n))
                random.Random(f"prompts:{seed}:{epoch}").shuffle(order)
                self._orders.clear()  # a resumed run asks for one or two passes at a time
                self._orders[(seed, epoch)] = order
            out.append(self.train[order[index]])
        return out

    def eval_prompts(self, seed: int, count: int) -> list[Prompt]:
        """The first `count` held-out prompts (fixed by the data, not by the run: `seed` is unused)."""
        return self.eval[:count]
