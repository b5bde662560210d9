"""Built-in prompt sources of `hpref rl` (`[rl.prompts]`): `synthetic`, `pairwise`, `arena`, `file`.

A prompt source's `build(config)` returns an object satisfying `hpref.rl.protocols.PromptSource`:
`train_prompts(seed, first, count)` (prompt i of the stream depends only on (seed, i), so every
policy answers the same prompts at the same rollout and a resume replays nothing),
`eval_prompts(seed, count)` (held out from training), `source` and `ground_truth`.

The file sources read the conversation before the final answer through the dataset readers (row-exact
errors, `on_error`, `limit`) and split, deduplicate and cap it with `hpref.data.prompts.PromptSet`.
`synthetic` generates the arena's questions, the one source whose answers have a ground truth.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hpref.data.base import BattleSource
from hpref.data.prompts import (
    Prompt,
    PromptFileConfig,
    PromptFileReader,
    PromptSet,
    prompt_of_battle,
    stream_rng,
)
from hpref.data.readers import ArenaConfig, ArenaReader, PairwiseConfig, PairwiseReader
from hpref.data.tables import Format, is_missing
from hpref.hookspecs import hookimpl


class SyntheticPromptsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    families: list[str] | None = Field(None, description="synthetic arena task families (default: all)")


class _FilePromptsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="data file (CSV, Parquet or JSONL; .gz allowed)")
    format: Format = Field("auto", description="file format; auto = from the file name")
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
    return {"path": config.path, "format": config.format, "on_error": config.on_error, "limit": config.limit}


def build_synthetic(config: SyntheticPromptsConfig) -> SyntheticPrompts:
    """The synthetic arena's generated questions (the only source with a ground-truth utility)."""
    return SyntheticPrompts(config)


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
    register(name="pairwise", config=PairwisePromptsConfig, build=build_pairwise)
    register(name="arena", config=ArenaPromptsConfig, build=build_arena)
    register(name="file", config=FilePromptsConfig, build=build_file)
