"""`[rl.warmup]`: the supervised fine-tune a policy starts RL from (`hpref.rl.warmup.supervised`).

Two sources of answers, told apart by `path`:

    [rl.warmup]                      # the synthetic arena's answers: tiny random-init policies only
    steps = 300
    battles = 4000

    [rl.warmup]                      # your own answers: every policy, pretrained ones included
    path = "hh-rlhf.jsonl.gz"        # a pair file (the chosen side) or a chat file (`messages`)
    steps = 200
    lr = 2e-4
    max_length = 512

A key of the other source is refused in one line (`SYNTHETIC_KEYS` with `path`, `DATA_KEYS` without
it), unless it has its default: the resolved recipe a run folder holds lists every key.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: keys only the synthetic arena's warm-up reads
SYNTHETIC_KEYS = ("battles", "answers", "families", "max_answer_tokens")
#: keys only the warm-up on a data file reads
DATA_KEYS = (
    "path",
    "format",
    "on_error",
    "limit",
    "prompt_column",
    "chosen_column",
    "rejected_column",
    "messages_column",
    "eval_fraction",
    "eval_rows",
    "split_seed",
    "max_length",
    "micro_batch_tokens",
)


class WarmupConfig(BaseModel):
    """`[rl.warmup]`: the supervised warm-up that makes the policies' starting checkpoint."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    steps: int = Field(300, ge=1, description="optimizer steps of the supervised fine-tune")
    batch_size: int = Field(32, ge=1, description="answers per step")
    lr: float = Field(3e-3, gt=0, description="AdamW peak learning rate (cosine decay to 10%)")
    warmup_steps: int = Field(20, ge=0, description="linear learning-rate warm-up steps")
    seed: int = Field(
        0, description="seed of the arena data, of batch sampling and of a warm-up's LoRA adapters"
    )
    threads: int = Field(
        1, ge=0, description="torch threads (0 = torch's default; more than the free cores thrashes)"
    )
    # the synthetic arena's answers (no `path`)
    battles: int = Field(4000, ge=1, description="synthetic arena battles the answers come from")
    answers: Literal["all", "preferred"] = Field(
        "all",
        description="all = both answers of every battle (the arena's mix of right and wrong); "
        "preferred = only the answer the ground-truth judge prefers",
    )
    families: list[str] | None = Field(None, description="synthetic arena task families (default: all)")
    max_answer_tokens: int = Field(48, ge=4, description="answers are cut to this many tokens (plus eos)")
    # the user's own answers (`path`)
    path: str | None = Field(
        None,
        description="your answers: a pair file (the chosen side; HH-RLHF chosen/rejected transcripts, TRL "
        "prompt/chosen/rejected) or a chat file (a messages column; its final assistant message is the "
        "answer), CSV, Parquet or JSONL (.gz allowed); every policy is fine-tuned on it, pretrained ones "
        "too, with its LoRA adapters when it has them (merged into the checkpoint). Without it: the "
        "synthetic arena's answers, for tiny policies",
    )
    format: Literal["auto", "csv", "parquet", "jsonl"] = Field(
        "auto", description="path's file format; auto = from the file name"
    )
    on_error: Literal["raise", "skip"] = Field(
        "raise", description="a malformed row stops the warm-up (raise) or is skipped and counted (skip)"
    )
    limit: int | None = Field(None, ge=1, description="read at most this many rows of path")
    prompt_column: str = Field("prompt", description="pair file: prompt column (TRL); optional")
    chosen_column: str = Field("chosen", description="pair file: the preferred side, the answer learnt")
    rejected_column: str = Field("rejected", description="pair file: the other side (never learnt)")
    messages_column: str = Field(
        "messages", description="chat file (no chosen column): the conversation, the last message the answer"
    )
    eval_fraction: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="share of rows held out for the before/after loss, by a hash of the prompt as "
        "[rl.prompts] splits its eval prompts (same file, fraction and split_seed: the warm-up never "
        "trains on the rl evals' prompts)",
    )
    eval_rows: int = Field(256, ge=1, description="most held-out rows the loss is measured on")
    split_seed: int = Field(0, description="salt of the held-out split's hash, as [rl.prompts]'")
    max_length: int = Field(
        1024,
        ge=16,
        description="prompt + answer tokens: a longer answer keeps its start; a row whose prompt alone "
        "fills it is left out (counted in the log)",
    )
    micro_batch_tokens: int = Field(
        4096,
        ge=16,
        description="tokens per packed forward/backward pass (no padding); a step's micro-batches "
        "accumulate into one update, so this bounds memory, not the update",
    )

    @model_validator(mode="after")
    def _one_source(self) -> WarmupConfig:
        # keys of the other source would be silently ignored; a default is what a resolved recipe holds
        defaults = {name: info.default for name, info in type(self).model_fields.items()}
        changed = lambda keys: [k for k in keys if getattr(self, k) != defaults[k]]  # noqa: E731
        if self.path is not None and changed(SYNTHETIC_KEYS):
            keys = ", ".join(changed(SYNTHETIC_KEYS))
            raise ValueError(
                f"{keys}: synthetic-arena settings, but path = {self.path!r} gives the answers; remove "
                f"{keys} (or path, to warm up on the synthetic arena)"
            )
        if self.path is None and changed(DATA_KEYS):
            keys = ", ".join(changed(DATA_KEYS))
            raise ValueError(f"{keys}: settings of a warm-up on your data, which needs path = your file")
        return self
