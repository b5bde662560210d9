"""Battles -> DPO pairs for `hpref train` with `[dpo]`: each battle's conversation before its final
answer (the prompt) and its two final answers, tokenized as the policy's chat template lays them out.

A pair is one `TokenizedExample` of two sequences, prompt + answer A then prompt + answer B
(`split` = the first one's length), so the packer (`hpref.data.packing`) always puts a pair's two
sequences in the same micro-batch; `PairData.prompt_lengths[i]` says where example i's answers start.

Tokenization is TRL's `DPOTrainer`'s, so the two train on the same tokens: with a chat template the
prompt (with the generation prompt) and each whole conversation are tokenized by the template, and
the answer is what follows the longest common prefix of the three (a template that renders the end of
a prompt differently inside a conversation moves that end into the answers, as TRL does); without
one (hpref's tiny tokenizers) the prompt is `hpref.models.causal_lm.encode_prompt` and an answer its
tokens plus eos. A sequence longer than `train.max_length` keeps its start (TRL's `keep_start`); a
pair whose prompt alone fills `max_length` has nothing to learn from and is left out, counted in the log.

Every rank tokenizes the same pairs in the same order, so the packing plan agrees without
communication (as `hpref.train.data`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from hpref.data.packing import TokenizedExample
from hpref.data.records import Battle
from hpref.errors import DataError

TIE_THRESHOLD = (
    0.5  # a label whose P(tie) is at least this is a tie (as `hpref.models.dpo_loss.pair_metrics`)
)


@dataclass
class PairData:
    """Tokenized pairs; `examples[i].row` indexes `battles`, `prompt_lengths[i]` is where both of
    example i's answers start."""

    examples: list[TokenizedExample]
    prompt_lengths: list[int]
    battles: list[Battle]
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def lengths(self) -> list[int]:
        return [len(e) for e in self.examples]

    @property
    def num_battles(self) -> int:
        return len(self.examples)


def prompt_turns(battle: Battle) -> tuple[str, ...] | None:
    """The conversation a pair's two final answers continue (user, assistant, ..., user), or None
    when the two sides' earlier answers differ (a multi-turn arena battle: two conversations)."""
    if battle.response_a[:-1] != battle.response_b[:-1]:
        return None
    turns: list[str] = []
    for i, user in enumerate(battle.prompt):
        turns.append(user)
        if i < len(battle.prompt) - 1:
            turns.append(battle.response_a[i])
    return tuple(turns)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def encode_pair(
    tokenizer: Any, turns: tuple[str, ...], answer_a: str, answer_b: str
) -> tuple[list[int], list[int], int]:
    """(prompt + answer A ids, prompt + answer B ids, prompt length): see the module docstring."""
    if getattr(tokenizer, "chat_template", None):
        from hpref.data.prompts import conversation_messages

        messages = conversation_messages(turns)

        def template(msgs: list[dict[str, str]], generation: bool) -> list[int]:
            ids = tokenizer.apply_chat_template(
                msgs, add_generation_prompt=generation, tokenize=True, return_dict=False
            )
            return list(ids)

        prompt = template(messages, True)
        full_a = template([*messages, {"role": "assistant", "content": answer_a}], False)
        full_b = template([*messages, {"role": "assistant", "content": answer_b}], False)
        start = min(_common_prefix(prompt, full_a), _common_prefix(prompt, full_b))
        return full_a, full_b, start
    from hpref.models.causal_lm import encode_prompt

    prompt = encode_prompt(tokenizer, turns)
    eos = [tokenizer.eos_token_id]
    a = tokenizer.encode(answer_a, add_special_tokens=False) + eos
    b = tokenizer.encode(answer_b, add_special_tokens=False) + eos
    return prompt + a, prompt + b, len(prompt)


def tokenize_pairs(
    battles: Iterable[Battle],
    tokenizer: Any,
    *,
    max_length: int,
    ties: str = "train",
    differing_history: str = "error",
    name: str,
) -> PairData:
    """Encode every labelled battle as a DPO pair (`encode_pair`), in order. A `DataError` of one line
    naming `name` and the row for a pair whose two conversations differ before the final answer
    (unless `differing_history = "skip"`) or an unlabelled row; ties kept or dropped as `ties` says;
    every pair left out is counted in the log line."""
    import numpy as np

    examples: list[TokenizedExample] = []
    prompt_lengths: list[int] = []
    kept: list[Battle] = []
    counts = {
        "pairs": 0,
        "ties": 0,
        "ties_dropped": 0,
        "differing_history": 0,
        "prompt_too_long": 0,
        "truncated": 0,
    }
    for battle in battles:
        if battle.label is None:
            raise DataError(
                f"{name}: row {battle.id}: no label; DPO pairs must say which answer is preferred"
            )
        turns = prompt_turns(battle)
        if turns is None:
            if differing_history == "skip":
                counts["differing_history"] += 1
                continue
            turn = next(
                i
                for i, (x, y) in enumerate(zip(battle.response_a, battle.response_b, strict=False))
                if x != y
            )
            raise DataError(
                f"{name}: row {battle.id}: the two answers continue different conversations (the "
                f"assistant's turn {turn} differs, before the final answer); a DPO pair needs one prompt "
                '(set dpo.differing_history = "skip" to leave such rows out)'
            )
        tie = battle.label[2] >= TIE_THRESHOLD
        if tie and ties == "drop":
            counts["ties_dropped"] += 1
            continue
        seq_a, seq_b, start = encode_pair(tokenizer, turns, battle.response_a[-1], battle.response_b[-1])
        if start >= max_length:
            counts["prompt_too_long"] += 1
            continue
        if max(len(seq_a), len(seq_b)) > max_length:
            counts["truncated"] += 1
            seq_a, seq_b = seq_a[:max_length], seq_b[:max_length]
        # an answer of no tokens (a template that puts nothing after the prompt) still needs a target:
        # keep at least one token of each answer, taken from the prompt's end
        start = min(start, len(seq_a) - 1, len(seq_b) - 1)
        counts["ties"] += int(tie)
        examples.append(
            TokenizedExample(
                ids=np.asarray(seq_a + seq_b, dtype=np.int32),
                label=battle.label,
                row=len(kept),
                split=len(seq_a),
            )
        )
        prompt_lengths.append(start)
        kept.append(battle)
    counts["pairs"] = len(kept)
    if not kept:
        raise DataError(f"{name}: no DPO pairs left ({_describe(counts)})")
    logger.info(f"{name}: {_describe(counts)}")
    return PairData(examples, prompt_lengths, kept, counts)


def _describe(counts: dict[str, int]) -> str:
    parts = [f"{counts['pairs']} pairs ({counts['ties']} ties)"]
    left_out = {
        "ties_dropped": "ties dropped (dpo.ties = 'drop')",
        "differing_history": "with differing conversations skipped",
        "prompt_too_long": "whose prompt alone fills train.max_length left out",
        "truncated": "cut to train.max_length",
    }
    parts += [f"{counts[k]} {what}" for k, what in left_out.items() if counts[k]]
    return ", ".join(parts)
