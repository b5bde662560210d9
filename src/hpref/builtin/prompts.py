"""Built-in prompt sources of `hpref rl` (`[rl.prompts]`): `synthetic`, `arithmetic`, `pairwise`, `arena`,
`file`.

A prompt source's `build(config)` returns an object satisfying `hpref.rl.protocols.PromptSource`:
`train_prompts(seed, first, count)` (prompt i of the stream depends only on (seed, i), so every
policy answers the same prompts at the same rollout and a resume replays nothing),
`eval_prompts(seed, count)` (held out from training), `source` and `ground_truth`.

The file sources read the conversation before the final answer through the dataset readers (row-exact
errors, `on_error`, `limit`) and split, deduplicate and cap it with `hpref.data.prompts.PromptSet`.
`synthetic` generates the arena's questions, the one source whose answers have a ground truth.
`arithmetic` generates multi-digit sums, differences, products and exact quotients, the calculator's
use spelt out in the prompt and a `reference` per row, for the `tool` environment and the
`matches_reference` rule.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hpref.data.base import BattleSource
from hpref.data.prompts import (
    Prompt,
    PromptFileConfig,
    PromptFileReader,
    PromptSet,
    prompt_of_battle,
    stream_rng,
    unit_hash,
)
from hpref.data.readers import ArenaConfig, ArenaReader, PairwiseConfig, PairwiseReader
from hpref.data.tables import Format, is_missing
from hpref.errors import DataError
from hpref.hookspecs import hookimpl


class SyntheticPromptsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    families: list[str] | None = Field(None, description="synthetic arena task families (default: all)")


class _FilePromptsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        description="data file (CSV, Parquet or JSONL; .gz allowed), a `datasets` save_to_disk folder, "
        "or a Hugging Face dataset name (owner/name) in the local datasets cache (read offline)"
    )
    format: Format = Field("auto", description="file format; auto = from the file name")
    subset: str | None = Field(None, description="a Hugging Face dataset name's configuration")
    hf_split: str = Field("train", description="the split of a dataset name or a saved DatasetDict folder")
    on_error: Literal["raise", "skip"] = Field(
        "raise", description="a malformed row stops the run (raise) or is skipped and counted (skip)"
    )
    limit: int | None = Field(None, ge=1, description="read at most this many rows")
    eval_fraction: float = Field(
        0.05, ge=0, lt=1, description="share of distinct prompts held out for evals (by a hash of the prompt)"
    )
    max_prompt_chars: int | None = Field(
        4000,
        ge=1,
        description="leave out (and count) prompts longer than this many characters (none = no cap)",
    )
    split_seed: int = Field(0, description="salt of the eval split's hash; not the run seed")


class PairwisePromptsConfig(_FilePromptsConfig):
    prompt_column: str = Field("prompt", description="prompt column (TRL prompt/chosen/rejected); optional")
    chosen_column: str = Field("chosen", description="the preferred side")
    rejected_column: str = Field("rejected", description="the other side")


class ArenaPromptsConfig(_FilePromptsConfig):
    pass


class FilePromptsConfig(_FilePromptsConfig):
    prompt_column: str = Field("prompt", description="a prompt: a string, or a message list (JSON or native)")
    messages_column: str = Field(
        "messages", description="chat-format column, used when there is no prompt column"
    )


class SyntheticPrompts:
    """The synthetic arena's single-turn questions; its answers have a ground truth."""

    ground_truth = True
    source = "synthetic arena"
    columns: tuple[str, ...] = ()  # generated questions come from no file row

    def __init__(self, config: SyntheticPromptsConfig) -> None:
        self.families = config.families

    def _prompt(self, salt: str, seed: int, i: int) -> Prompt:
        from hpref.arena import generate_prompt

        return generate_prompt(stream_rng(salt, seed, i), turns=1, families=self.families)

    def train_prompts(self, seed: int, first: int, count: int) -> list[Prompt]:
        return [self._prompt("rl", seed, i) for i in range(first, first + count)]

    def eval_prompts(self, seed: int, count: int) -> list[Prompt]:
        return [self._prompt("eval", seed, i) for i in range(count)]

    def row(self, prompt: Prompt) -> dict[str, Any]:
        return {}


class ArithmeticPromptsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    operations: list[Literal["+", "-", "*", "/"]] = Field(
        default_factory=lambda: ["+", "-", "*", "/"],
        min_length=1,
        description="operations drawn from, evenly; `/` is exact (dividend = divisor x a drawn quotient)",
    )
    min_digits: int = Field(3, ge=1, le=12, description="fewest digits of an operand (of the quotient for /)")
    max_digits: int = Field(5, ge=1, le=12, description="most digits of an operand (of the quotient for /)")
    eval_fraction: float = Field(
        0.05, gt=0, lt=1, description="share of all problems held out for evals (by a hash of the prompt)"
    )
    split_seed: int = Field(
        0, description="salt of the eval split's hash and of the eval stream; not the run seed"
    )

    @model_validator(mode="after")
    def _digits_in_order(self) -> ArithmeticPromptsConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits = {self.min_digits} is more than max_digits = {self.max_digits}")
        return self


# What the policy reads: the question, then how to call the calculator (the `tool` environment's
# short form; a stop string at `</calculator>` ends the call) and how to answer. `row` reads the
# problem back from the question line, so a prompt's reference needs no memory of the draw.
ARITHMETIC_PROMPT = (
    "What is {a} {op} {b}?\n"
    "You have a calculator. To use it, write an expression between <calculator> and </calculator>, "
    "for example <calculator>12 * 34</calculator>, and its result comes back to you. "
    "When you know the result, reply with the final answer as a number."
)
_QUESTION = re.compile(r"^What is (\d+) ([-+*/]) (\d+)\?$", re.MULTILINE)
#: draws per prompt before a source whose held-out split leaves too few problems is refused
_MAX_DRAWS = 10_000


class ArithmeticPrompts:
    """Generated `a op b` problems with an exact `reference` (see `ArithmeticPromptsConfig`).

    Training prompt i depends only on (seed, i); the eval prompts only on `split_seed`. A problem is
    held out when the hash of its prompt falls below `eval_fraction` (`hpref.data.prompts.unit_hash`,
    the file sources' split): training draws skip those and eval draws keep only those, so no eval
    problem is ever trained on, whatever the seeds."""

    ground_truth = False  # the reference is a column for a `rule` function, not the arena's judge
    columns: tuple[str, ...] = ("reference",)

    def __init__(self, config: ArithmeticPromptsConfig) -> None:
        self.config = config
        operations = "".join(config.operations)
        self.source = f"arithmetic({operations}, {config.min_digits}-{config.max_digits} digits)"
        self._eval: list[Prompt] = []

    def _draw(self, rng: Any) -> Prompt:
        c = self.config
        op = rng.choice(c.operations)
        a, b = (
            rng.randint(10 ** (d - 1), 10**d - 1)
            for d in [rng.randint(c.min_digits, c.max_digits) for _ in "ab"]
        )
        if op == "/":  # exact: the dividend is the divisor times the quotient drawn as `a`
            a *= b
        return (ARITHMETIC_PROMPT.format(a=a, op=op, b=b),)

    def held_out(self, prompt: Prompt) -> bool:
        return unit_hash(prompt, self.config.split_seed) < self.config.eval_fraction

    def train_prompts(self, seed: int, first: int, count: int) -> list[Prompt]:
        out = []
        for i in range(first, first + count):
            rng = stream_rng("arithmetic", seed, i)
            prompt = next(
                (p for p in (self._draw(rng) for _ in range(_MAX_DRAWS)) if not self.held_out(p)), None
            )
            if prompt is None:
                raise DataError(
                    f"{self.source}: no training problem in {_MAX_DRAWS} draws (lower eval_fraction)"
                )
            out.append(prompt)
        return out

    def eval_prompts(self, seed: int, count: int) -> list[Prompt]:
        """The first `count` distinct held-out problems of the eval stream (`seed` unused: every run
        of these settings is evaluated on the same problems)."""
        if len(self._eval) < count:
            rng = stream_rng("arithmetic-eval", self.config.split_seed)
            found: dict[Prompt, None] = {}
            # a hundred times the draws `count` held-out problems take on average
            limit, draws = max(_MAX_DRAWS, int(100 * count / self.config.eval_fraction)), 0
            while len(found) < count:
                if draws == limit:
                    raise DataError(
                        f"{self.source}: {len(found)} distinct held-out problems in {draws} draws, {count} "
                        "asked (raise max_digits or eval_fraction)"
                    )
                draws += 1
                prompt = self._draw(rng)
                if self.held_out(prompt):
                    found.setdefault(prompt)
            self._eval = list(found)
        return self._eval[:count]

    def row(self, prompt: Prompt) -> dict[str, Any]:
        """`{"reference": <the exact answer>}` of a generated problem; `{}` for any other prompt."""
        found = _QUESTION.search(prompt[-1]) if prompt else None
        if found is None:
            return {}
        a, op, b = int(found[1]), found[2], int(found[3])
        return {"reference": {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]}


def _other_columns(raw: Any, conversation: set[str]) -> dict[str, Any]:
    """A row's columns beside the conversation's (a reference answer, a label, an id), as plain
    Python values (Parquet's numpy scalars unwrapped; a missing value is None)."""
    if not isinstance(raw, dict):
        return {}
    out = {}
    for column, value in raw.items():
        if column in conversation or str(column).startswith("\0"):  # a reader's own (the row number)
            continue
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # a numpy scalar
            value = value.item()
        out[str(column)] = None if is_missing(value) else value
    return out


def _from_reader(reader: BattleSource, config: _FilePromptsConfig, conversation: set[str]) -> PromptSet:
    """The prompts of `reader`'s rows, each with its other columns (all but `conversation`'s, the
    columns its text comes from), for rewards that read them (`rule`'s `function(prompt, answer, row)`)."""

    def prompts() -> Iterator[tuple[Prompt, dict[str, Any]]]:
        for battle, raw in reader.battles_with_rows():
            yield prompt_of_battle(battle), _other_columns(raw, conversation)

    return PromptSet.build(
        reader.source,
        prompts(),
        eval_fraction=config.eval_fraction,
        max_prompt_chars=config.max_prompt_chars,
        split_seed=config.split_seed,
    )


def _reader_fields(config: _FilePromptsConfig) -> dict[str, object]:
    fields = ("path", "format", "subset", "hf_split", "on_error", "limit")
    return {name: getattr(config, name) for name in fields}


def build_synthetic(config: SyntheticPromptsConfig) -> SyntheticPrompts:
    """The synthetic arena's generated questions (the only source with a ground-truth utility)."""
    return SyntheticPrompts(config)


def build_arithmetic(config: ArithmeticPromptsConfig) -> ArithmeticPrompts:
    """Generated multi-digit arithmetic (+ - * and exact /) with a `reference` per row, held-out evals."""
    return ArithmeticPrompts(config)


def build_pairwise(config: PairwisePromptsConfig) -> PromptSet:
    """The conversation before the final answer of chosen/rejected pairs (HH-RLHF, TRL formats)."""
    columns = {k: getattr(config, k) for k in ("prompt_column", "chosen_column", "rejected_column")}
    reader = PairwiseReader(PairwiseConfig(**_reader_fields(config), **columns), seed=0)
    return _from_reader(reader, config, set(columns.values()))


def build_arena(config: ArenaPromptsConfig) -> PromptSet:
    """The conversation before the final answers of arena-schema battles (CSV, Parquet, JSONL)."""
    conversation = {"prompt", "response_a", "response_b"}
    return _from_reader(ArenaReader(ArenaConfig(**_reader_fields(config)), seed=0), config, conversation)


def build_file(config: FilePromptsConfig) -> PromptSet:
    """A plain file of prompts: a `prompt` column, or `messages` in chat format."""
    columns = {"prompt_column": config.prompt_column, "messages_column": config.messages_column}
    reader = PromptFileReader(PromptFileConfig(**_reader_fields(config), **columns))
    return _from_reader(reader, config, set(columns.values()))


@hookimpl
def register_prompts(register):
    register(name="synthetic", config=SyntheticPromptsConfig, build=build_synthetic)
    register(name="arithmetic", config=ArithmeticPromptsConfig, build=build_arithmetic)
    register(name="pairwise", config=PairwisePromptsConfig, build=build_pairwise)
    register(name="arena", config=ArenaPromptsConfig, build=build_arena)
    register(name="file", config=FilePromptsConfig, build=build_file)
