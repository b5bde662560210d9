"""Judge-prompt formatters and token-budget truncation.

A formatter turns one `Battle` into the token ids of one sequence that ends where a judge would give
its verdict, so the hidden state of the last token is the natural place to classify.

pab      one judge prompt with the whole conversation, turn by turn: the user message, then Assistant
         A's answer, then Assistant B's.
papb     A's whole conversation, then B's (the user turns appear in both).
answers  for a reward model: no judge prompt, TWO sequences per battle, A's conversation (user and
         assistant turns, the answer to score last) and B's, each within max_length on its own
         (`AnswersFormatter`; `Encoded.split` says where B's sequence starts).

When the tokenizer has a chat template, the judge prompt is the user message of a one-message chat
rendered with `add_generation_prompt=True` (the sequence ends at the start of the assistant's reply);
otherwise the tokenizer's own special tokens (BOS, CLS/SEP, ...) wrap the plain text, which ends in
"Verdict:".

Truncation never cuts inside a special token, because fields are tokenised apart from the fixed
text: the template is rendered once per turn count with sentinels in place of the fields, split at
the sentinels, and each fixed piece is tokenised whole (special tokens included) while each field is
tokenised with `split_special_tokens=True` (a user typing "<|im_end|>" gets text tokens, not the
control token). Cuts happen only at field token boundaries. Fields are budgeted as:

right         keep the beginning: fields in sequence order, the first field that does not fit is cut
              on its right, later ones are emptied.
left          keep the end: the same from the last field backwards, cutting on the left.
proportional  keep the last turn and share fairly: the budget goes to the last turn first, split
              between its prompt / A / B fields by water-filling (every field gets the same cap; a
              short field's unused share goes to the longer ones), the rest flows to earlier turns,
              newest first. An earlier turn left with fewer than `min_turn_tokens` is dropped, with
              its fixed text, and older turns with it. Each field is cut on `field_side`.

If even one turn's fixed text does not fit max_length, `build` fails: no budget can help.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hpref.data.records import Battle
from hpref.errors import DataError
from hpref.protocols import Formatter, PreferenceModel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_INSTRUCTION = (
    "You are a fair judge. Read the conversation and decide which assistant answered the user better."
)
_SENTINEL = "\ue000{}\ue001"  # private-use characters: no template or tokenizer gives them meaning


class FormatterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    truncation: Literal["proportional", "right", "left"] = Field(
        "proportional", description="how fields share the token budget (see hpref.data.formatting)"
    )
    field_side: Literal["right", "left"] = Field(
        "right", description="proportional truncation cuts each field on this side (right = keep its start)"
    )
    chat_template: Literal["auto", "on", "off"] = Field(
        "auto", description="wrap the judge prompt in the tokenizer's chat template (auto = when it has one)"
    )
    instruction: str = Field(
        DEFAULT_INSTRUCTION, description="the judge instruction at the top of the prompt"
    )
    min_turn_tokens: int = Field(
        8, ge=0, description="proportional: an earlier turn left with fewer field tokens is dropped"
    )


@dataclass(frozen=True)
class Slot:
    """Where a field's tokens go: kind is 'prompt', 'a' or 'b', turn its 0-based turn index."""

    kind: str
    turn: int


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    truncated: bool  # some field was cut or some turn dropped
    full_length: int  # the length without truncation
    #: where the second sequence starts when one battle is two sequences (`AnswersFormatter`: A's
    #: conversation is ids[:split], B's ids[split:]); 0 = one sequence
    split: int = 0


def check_pairing(formatter: Formatter, model: PreferenceModel) -> None:
    """A reward model (`model.paired`) needs two sequences per battle (`formatter.paired`, optional
    for a plugin's formatter: absent, one sequence), a judge one: a mismatch would pair unrelated
    sequences or split one battle into two verdicts."""
    two_sequences = bool(getattr(formatter, "paired", False))
    if two_sequences != model.paired:
        kind = "a reward model" if model.paired else "a judge"
        makes = "two sequences" if two_sequences else "one sequence"
        raise DataError(
            f"the formatter makes {makes} "
            f"per battle, and the model is {kind}: use formatter 'answers' with head = 'reward', "
            "a judge formatter (pab, papb) with head = 'judge'"
        )


def encode_battles(formatter: Formatter, battles: Sequence[Battle]) -> list[Encoded]:
    """Every caller's way to run a formatter plugin: `encode_many` when it has one (batched
    tokenization, truncation statistics, paired sequences), else the required `encode` alone."""
    if hasattr(formatter, "encode_many"):
        return list(formatter.encode_many(battles))
    out = []
    for battle in battles:
        ids = list(formatter.encode(battle))
        out.append(Encoded(ids, False, len(ids)))
    return out


def _layout_pab(n: int, instruction: str) -> list[str | Slot]:
    parts: list[str | Slot] = [f"{instruction}\n"]
    for t in range(n):
        parts += [
            f"\n### Turn {t + 1}\nUser:\n",
            Slot("prompt", t),
            "\n\nAssistant A:\n",
            Slot("a", t),
            "\n\nAssistant B:\n",
            Slot("b", t),
            "\n",
        ]
    parts.append("\nWhich assistant answered better? Answer A, B or tie.")
    return parts


def _layout_papb(n: int, instruction: str) -> list[str | Slot]:
    parts: list[str | Slot] = [f"{instruction}\n"]
    for side, kind in (("A", "a"), ("B", "b")):
        parts.append(f"\n### Conversation {side}\n")
        for t in range(n):
            parts += ["User:\n", Slot("prompt", t), "\n\nAssistant:\n", Slot(kind, t), "\n\n"]
    parts.append("Which conversation has the better assistant? Answer A, B or tie.")
    return parts


LAYOUTS = {"pab": _layout_pab, "papb": _layout_papb}


class JudgeFormatter:
    """`encode(battle) -> list[int]` within `max_length` tokens (see the module docstring).

    Encodes one view; callers encode `battle.swapped()` for the swap view.
    """

    #: one sequence per battle (a judge reads both answers); `AnswersFormatter` makes two
    paired = False
    layouts: dict[str, Any] = LAYOUTS

    def __init__(self, name: str, config: Any, tokenizer: PreTrainedTokenizerBase, max_length: int) -> None:
        if name not in self.layouts:
            raise ValueError(f"unknown layout {name!r}")
        self.name = name
        self.config = config
        self.tokenizer = tokenizer
        self.max_length = max_length
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if config.chat_template == "on" and not has_template:
            raise DataError(f"formatter {name}: chat_template = 'on' but the tokenizer has no chat template")
        self.use_chat_template = has_template and config.chat_template != "off"
        self._skeletons: dict[int, tuple[list[list[int]], list[Slot]]] = {}
        fixed = sum(len(piece) for piece in self.skeleton(1)[0])
        if fixed + 3 > max_length:
            raise DataError(
                f"formatter {name}: max_length {max_length} leaves no room for the battle: the fixed text of "
                f"a one-turn prompt alone is {fixed} tokens"
            )

    # -- the fixed text ---------------------------------------------------------------------------
    def _wrap(self, text: str) -> str:
        if self.use_chat_template:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return text + "\n\nVerdict:"

    def _render(self, n_turns: int) -> tuple[str, list[Slot]]:
        """The whole fixed text for `n_turns` turns, with sentinel `i` where slot `i`'s field goes."""
        layout = self.layouts[self.name](n_turns, self.config.instruction)
        slots = [p for p in layout if isinstance(p, Slot)]
        marked = "".join(p if isinstance(p, str) else _SENTINEL.format(i) for i, p in slots_iter(layout))
        return self._wrap(marked), slots

    def _special_wrap(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer adds around a text by itself (BOS, or CLS ... SEP), for plain mode."""
        if self.use_chat_template:
            return [], []
        probe = self.tokenizer("x", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("x", add_special_tokens=True)["input_ids"]
        for i in range(len(full) - len(probe) + 1):
            if full[i : i + len(probe)] == probe:
                return list(full[:i]), list(full[i + len(probe) :])
        return [], []

    def skeleton(self, n_turns: int) -> tuple[list[list[int]], list[Slot]]:
        """Token ids of the fixed pieces (one more than slots: piece, slot, piece, ..., piece)."""
        cached = self._skeletons.get(n_turns)
        if cached is not None:
            return cached
        rendered, slots = self._render(n_turns)
        texts = []
        rest = rendered
        for i in range(len(slots)):
            head, sep, rest = rest.partition(_SENTINEL.format(i))
            if not sep:
                raise DataError(
                    f"formatter {self.name}: the chat template dropped or reordered the message text"
                )
            texts.append(head)
        texts.append(rest)
        pieces = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) if t else [] for t in texts]
        before, after = self._special_wrap()
        pieces[0] = before + pieces[0]
        pieces[-1] = pieces[-1] + after
        self._skeletons[n_turns] = (pieces, slots)
        return pieces, slots

    # -- encoding ---------------------------------------------------------------------------------
    def _field_ids(self, battles: Sequence[Battle]) -> list[dict[tuple[str, int], list[int]]]:
        keys, texts = [], []
        for i, b in enumerate(battles):
            for kind, turns in (("prompt", b.prompt), ("a", b.response_a), ("b", b.response_b)):
                for t, text in enumerate(turns):
                    keys.append((i, kind, t))
                    texts.append(text)
        # verbose=False: a field longer than the model's limit is expected here (truncation to the
        # budget comes next), so transformers' "longer than the maximum sequence length" is noise
        ids = (
            self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)[
                "input_ids"
            ]
            if texts
            else []
        )
        out: list[dict[tuple[str, int], list[int]]] = [{} for _ in battles]
        for (i, kind, t), field_ids in zip(keys, ids, strict=True):
            out[i][(kind, t)] = list(field_ids)
        return out

    def encode(self, battle: Battle) -> list[int]:
        return self.encode_many([battle])[0].ids

    def encode_with_info(self, battle: Battle) -> Encoded:
        return self.encode_many([battle])[0]

    def encode_many(self, battles: Sequence[Battle]) -> list[Encoded]:
        """Encode a batch of battles (one tokenizer call for all their fields)."""
        return [self._assemble(b, f) for b, f in zip(battles, self._field_ids(battles), strict=True)]

    def _assemble(self, battle: Battle, fields: dict[tuple[str, int], list[int]]) -> Encoded:
        n = len(battle.prompt)
        if n == 0:
            raise DataError(f"battle {battle.id}: no turns to format")
        pieces, slots = self.skeleton(n)
        full_length = sum(map(len, pieces)) + sum(len(fields[(s.kind, s.turn)]) for s in slots)
        if full_length <= self.max_length:
            return Encoded(self._join(pieces, slots, fields), False, full_length)
        first = 0  # the oldest turn kept
        while True:
            pieces, slots = self.skeleton(n - first)
            budget = self.max_length - sum(map(len, pieces))
            kept = {(k, t): ids for (k, t), ids in fields.items() if t >= first}
            shifted = [Slot(s.kind, s.turn + first) for s in slots]
            if budget < 0 and first < n - 1:
                first += 1
                continue
            limits = self._allocate(shifted, kept, max(budget, 0))
            oldest_kept = sum(g for (_, t), g in limits.items() if t == first)
            oldest_needs = sum(len(ids) for (_, t), ids in kept.items() if t == first)
            if (
                self.config.truncation == "proportional"
                and first < n - 1
                and oldest_kept < min(self.config.min_turn_tokens, oldest_needs)
            ):
                first += 1
                continue
            cut = {key: self._cut(ids, limits[key]) for key, ids in kept.items()}
            return Encoded(self._join(pieces, shifted, cut), True, full_length)

    def _cut(self, ids: list[int], keep: int) -> list[int]:
        if keep >= len(ids):
            return ids
        side = self.config.truncation if self.config.truncation != "proportional" else self.config.field_side
        if keep <= 0:
            return []
        return ids[:keep] if side == "right" else ids[len(ids) - keep :]

    def _allocate(self, slots: list[Slot], fields: dict[tuple[str, int], list[int]], budget: int) -> dict:
        """Tokens kept per field. A field shown twice (papb prompts) costs twice per kept token."""
        order: list[tuple[str, int]] = []
        cost: dict[tuple[str, int], int] = {}
        for s in slots:
            key = (s.kind, s.turn)
            if key not in cost:
                order.append(key)
            cost[key] = cost.get(key, 0) + 1
        limits = dict.fromkeys(order, 0)
        mode = self.config.truncation
        if mode in ("right", "left"):
            for key in order if mode == "right" else reversed(order):
                take = min(len(fields[key]), budget // cost[key])
                limits[key] = take
                budget -= take * cost[key]
            return limits
        for turn in sorted({t for _, t in order}, reverse=True):
            keys = [k for k in order if k[1] == turn]
            given = water_fill([len(fields[k]) for k in keys], [cost[k] for k in keys], budget)
            for k, g in zip(keys, given, strict=True):
                limits[k] = g
                budget -= g * cost[k]
        return limits

    @staticmethod
    def _join(pieces, slots, fields) -> list[int]:
        ids = list(pieces[0])
        for slot, piece in zip(slots, pieces[1:], strict=True):
            ids += fields[(slot.kind, slot.turn)]
            ids += piece
        return ids

    def fingerprint(self) -> str:
        """Identity of the formatter's output for a given tokenizer (the cache adds the tokenizer)."""
        settings = {
            "layout": self.name,
            "config": self.config.model_dump(mode="json"),
            "max_length": self.max_length,
            "chat_template": self.use_chat_template,
            "version": 1,
        }
        return hashlib.blake2b(json.dumps(settings, sort_keys=True).encode(), digest_size=16).hexdigest()


# --------------------------------------------------------------------------------------------------
# reward-model input: each answer with its conversation, as its own sequence


class AnswersConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chat_template: Literal["auto", "on", "off"] = Field(
        "auto",
        description="render each side as the tokenizer's chat (user/assistant turns) when it has a "
        "template (auto), always (on) or never (off: plain 'User:' / 'Assistant:' text)",
    )
    answer_share: float = Field(
        0.75,
        gt=0.0,
        le=1.0,
        description="the most of a sequence's field budget the scored answer takes when the side does "
        "not fit; the rest goes to the last user message first, then to earlier turns",
    )
    min_turn_tokens: int = Field(
        8, ge=0, description="an earlier turn left with fewer field tokens is dropped, with its fixed text"
    )


def _layout_answers(n: int, _instruction: str | None = None) -> list[str | Slot]:
    """Plain-text rendering of one side's conversation (no chat template)."""
    parts: list[str | Slot] = []
    for t in range(n):
        parts += ["User:\n", Slot("prompt", t), "\n\nAssistant:\n", Slot("answer", t)]
        if t < n - 1:
            parts.append("\n\n")
    return parts


class AnswersFormatter(JudgeFormatter):
    """A battle as TWO sequences for a reward model: [conversation + A's answer], [conversation + B's].

    Each side is the user turns with that side's own assistant turns (in a multi-turn arena battle
    each model answered its own conversation), rendered as a chat (`apply_chat_template` over
    user/assistant messages, no generation prompt: the scored answer is the last turn) or as plain
    text wrapped in the tokenizer's special tokens. No judge instruction: the model scores one
    answer, it does not compare. Each side gets `max_length` tokens of its own. When a side does not
    fit, the scored (last) answer keeps its beginning, up to `answer_share` of the budget if the
    last user message needs the rest; the conversation before it keeps its end (the turns nearest
    the answer, newest first) and older turns are dropped whole once they would keep fewer than
    `min_turn_tokens`. `encode_many` returns `Encoded(ids = A + B, split = len(A))`.
    """

    paired = True
    layouts = {"answers": _layout_answers}

    def __init__(self, config: AnswersConfig, tokenizer: PreTrainedTokenizerBase, max_length: int) -> None:
        super().__init__("answers", config, tokenizer, max_length)

    def _render(self, n_turns: int) -> tuple[str, list[Slot]]:
        if not self.use_chat_template:
            layout = _layout_answers(n_turns)
            slots = [p for p in layout if isinstance(p, Slot)]
            marked = "".join(p if isinstance(p, str) else _SENTINEL.format(i) for i, p in slots_iter(layout))
            return marked, slots
        slots, messages = [], []
        for t in range(n_turns):
            for role, kind in (("user", "prompt"), ("assistant", "answer")):
                messages.append({"role": role, "content": _SENTINEL.format(len(slots))})
                slots.append(Slot(kind, t))
        return self.tokenizer.apply_chat_template(messages, tokenize=False), slots

    def _assemble(self, battle: Battle, fields: dict[tuple[str, int], list[int]]) -> Encoded:
        n = len(battle.prompt)
        if n == 0:
            raise DataError(f"battle {battle.id}: no turns to format")
        sides = []
        for kind in ("a", "b"):
            side = {(k, t): ids for (k, t), ids in fields.items() if k == "prompt"}
            side.update({("answer", t): ids for (k, t), ids in fields.items() if k == kind})
            sides.append(self._assemble_side(n, side))
        (a, cut_a, full_a), (b, cut_b, full_b) = sides
        return Encoded(a + b, cut_a or cut_b, full_a + full_b, split=len(a))

    def _assemble_side(self, n: int, fields: dict[tuple[str, int], list[int]]) -> tuple[list[int], bool, int]:
        pieces, slots = self.skeleton(n)
        full_length = sum(map(len, pieces)) + sum(len(fields[(s.kind, s.turn)]) for s in slots)
        if full_length <= self.max_length:
            return self._join(pieces, slots, fields), False, full_length
        first = 0  # the oldest turn kept
        while True:
            pieces, slots = self.skeleton(n - first)
            shifted = [Slot(s.kind, s.turn + first) for s in slots]
            budget = self.max_length - sum(map(len, pieces))
            if budget < 1 and first < n - 1:
                first += 1
                continue
            limits = self._budget(shifted, fields, max(budget, 0))
            oldest = [(k, t) for (k, t) in limits if t == first]
            kept = sum(limits[key] for key in oldest)
            needs = sum(len(fields[key]) for key in oldest)
            if first < n - 1 and kept < min(self.config.min_turn_tokens, needs):
                first += 1
                continue
            scored = ("answer", n - 1)
            cut = {
                key: fields[key][: limits[key]]  # the scored answer keeps its beginning
                if key == scored
                else fields[key][len(fields[key]) - limits[key] :]  # context keeps its end
                for key in limits
            }
            return self._join(pieces, shifted, cut), True, full_length

    def _budget(self, slots: list[Slot], fields: dict[tuple[str, int], list[int]], budget: int) -> dict:
        """Tokens kept per field: the scored answer first (leaving the last user message up to
        1 - answer_share of the budget), then the context from the newest field backwards."""
        keys = [(s.kind, s.turn) for s in slots]
        scored, question = keys[-1], keys[-2]
        reserve = min(len(fields[question]), int(budget * (1.0 - self.config.answer_share)))
        limits = {scored: min(len(fields[scored]), max(budget - reserve, 0))}
        rest = budget - limits[scored]
        for key in reversed(keys[:-1]):
            limits[key] = min(len(fields[key]), rest)
            rest -= limits[key]
        return limits


def slots_iter(layout: list[str | Slot]):
    """Layout items with slots numbered in order (the sentinel index of each slot)."""
    i = 0
    for item in layout:
        if isinstance(item, Slot):
            yield i, item
            i += 1
        else:
            yield -1, item


def water_fill(lengths: Sequence[int], costs: Sequence[int], budget: int) -> list[int]:
    """Max-min fair shares: the largest cap c with sum(cost * min(len, c)) <= budget, then leftover
    tokens one at a time to the longest still-cut fields (so no budget is wasted to rounding)."""
    if sum(c * n for c, n in zip(costs, lengths, strict=True)) <= budget:
        return list(lengths)
    lo, hi = 0, max(lengths)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(c * min(n, mid) for c, n in zip(costs, lengths, strict=True)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    given = [min(n, lo) for n in lengths]
    left = budget - sum(c * g for c, g in zip(costs, given, strict=True))
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if given[i] < lengths[i] and costs[i] <= left:
            given[i] += 1
            left -= costs[i]
    return given
