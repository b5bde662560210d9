"""Hook implementations of the example plugin.

Third-party components use the same contract as hpref's built-ins: a pydantic config class and a
build function handed to `register`. The dataset reuses `hpref.data.base.BattleSource`, so it gets
fold selection, `on_error` handling and the read summary for free. The RL algorithm and the
environment are written against `hpref.rl.protocols` (`Algorithm`, `Environment`, `Episode`) only.
"""

from __future__ import annotations

import csv
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from pydantic import BaseModel, ConfigDict, Field, model_validator

from hpref.data.base import BattleSource, DatasetConfig, RowError, file_digest
from hpref.data.records import Battle
from hpref.errors import DataError
from hpref.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch


class TsvPairsConfig(DatasetConfig):
    path: Path = Field(description="tab-separated file with a header row: prompt, chosen, rejected")


class TsvPairs(BattleSource):
    """Chosen/rejected pairs; the chosen answer goes to A or B by a seeded coin per row."""

    COLUMNS = ("prompt", "chosen", "rejected")

    def __init__(self, config: TsvPairsConfig, seed: int) -> None:
        super().__init__(config, seed, source=str(config.path))
        if not config.path.is_file():
            raise DataError(f"{config.path}: file not found")

    def _rows(self):
        with open(self.config.path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter="\t")
            missing = [c for c in self.COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise DataError(f"{self.config.path}: missing column(s) {', '.join(missing)} in the header")
            # Row 1 is the header, so data rows are numbered from 2, as a spreadsheet shows them.
            yield from enumerate(reader, start=2)

    def _data_identity(self) -> str:
        return f"{file_digest(self.config.path)}:{self.seed}"

    def _parse(self, row: dict[str, str]) -> Battle:
        for column in self.COLUMNS:
            if not (row.get(column) or "").strip():
                raise RowError(column, "empty")
        key = hashlib.blake2b(f"{self.seed}:{row['prompt']}".encode(), digest_size=8).digest()
        chosen_is_a = random.Random(key).random() < 0.5
        a, b = (row["chosen"], row["rejected"]) if chosen_is_a else (row["rejected"], row["chosen"])
        return Battle(
            id=hashlib.blake2b(row["prompt"].encode(), digest_size=8).hexdigest(),
            prompt=(row["prompt"],),
            response_a=(a,),
            response_b=(b,),
            label=(1.0, 0.0, 0.0) if chosen_is_a else (0.0, 1.0, 0.0),
        )


def build_tsv_pairs(config: TsvPairsConfig, seed: int) -> TsvPairs:
    """Chosen/rejected pairs from a TSV file (prompt, chosen, rejected)."""
    return TsvPairs(config, seed)


class StepDecayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gamma: float = Field(0.5, gt=0.0, le=1.0, description="factor applied at each decay point")
    every_fraction: float = Field(0.25, gt=0.0, le=1.0, description="share of the run between decays")


def build_step_decay(config: StepDecayConfig, total_steps: int):
    """Multiply the LR by gamma every every_fraction of the run."""
    every = max(1, round(config.every_fraction * total_steps))

    def multiplier(step: int) -> float:
        return config.gamma ** (step // every)

    return multiplier


@hookimpl
def register_datasets(register):
    register(name="tsv-pairs", config=TsvPairsConfig, build=build_tsv_pairs)


@hookimpl
def register_schedulers(register):
    register(name="step-decay", config=StepDecayConfig, build=build_step_decay)


@hookimpl
def register_commands(app: typer.Typer):
    @app.command("lr-curve")
    def lr_curve(
        scheduler: str = typer.Argument(..., help="a registered scheduler name"),
        steps: int = typer.Option(20, min=1, help="total optimizer steps"),
        every: int = typer.Option(1, min=1, help="print every N-th step"),
    ) -> None:
        """Print a scheduler's LR multiplier at each step (from the hpref-example plugin)."""
        from hpref.plugins import load_plugins

        component = load_plugins().get("scheduler", scheduler)
        multiplier = component.build(component.config(), steps)
        for step in range(0, steps, every):
            typer.echo(f"{step}\t{multiplier(step):.6f}")


# -- an RL algorithm: rejection-sampling fine-tuning ----------------------------------------------


class BestOfNConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    top: int = Field(1, ge=1, description="answers per prompt trained on: the group's best by reward")
    min_reward: float | None = Field(None, description="train only on answers scoring at least this")


@dataclass(frozen=True)
class BestOfNRows:
    """`TrainingRows.values` of a best-of-n step: each kept row's weight (1, or 0 under
    `min_reward`) and the own tokens of the step's rows of weight 1 (the loss's denominator)."""

    keep: torch.Tensor  # one weight per row
    tokens: float


class BestOfN:
    """Rejection-sampling fine-tuning (RAFT, Dong et al. 2023; ReST's improve step): each prompt's
    best-rewarded answers are trained on with the supervised loss, the rest are dropped. Written
    against `hpref.rl.protocols.Algorithm` only: hpref's trainer runs the micro-batches, the
    optimizer, the group's reductions, saves and resumes."""

    name = "best-of-n"
    needs_preferences = False
    cross_policy = False

    def __init__(self, config: BestOfNConfig, policy) -> None:
        self.config = config

    def check(self, policy, config, policies, where) -> None:
        from hpref.errors import RecipeError

        if self.config.top >= config.rollout.group_size:
            raise RecipeError(
                f"{where}: rl.policies.{policy}.algorithm.top: {self.config.top} of a group of "
                f"{config.rollout.group_size} keeps every answer; make it smaller than rl.rollout.group_size"
            )

    def wants_reference(self) -> bool:
        return False

    def prepare(self, rollout, tokenizer):
        import torch

        from hpref.rl.rollout_types import TrainingRows

        # each group's `top` answers (episodes) by reward, best first; one below `min_reward` weighs 0
        g, floor = rollout.group_size, self.config.min_reward
        rows = [
            i
            for start in range(0, len(rollout.rewards), g)
            for i in sorted(range(start, start + g), key=lambda i: -rollout.rewards[i])[: self.config.top]
        ]
        keep = [1.0 if floor is None or rollout.rewards[i] >= floor else 0.0 for i in rows]
        # an episode's row holds the environment's observations between the policy's turns: `masks`
        # keeps them out of the loss (the trainer's `batch["mask"]` is 1 on the policy's tokens only)
        masks = None if rollout.masks is None else [rollout.masks[i] for i in rows]
        prepared = TrainingRows(
            prompts=[rollout.prompt_ids[i] for i in rows],
            completions=[rollout.completions[i] for i in rows],
            group=self.config.top,
            behaviour=None,
            temperature=1.0,
            masks=masks,
        )
        # the token-mean's denominator: the policy's own tokens of the answers kept (weight 1), counted
        # once for the whole step so that every micro-batch's loss is its share of the step's
        own = [sum(m) for m in masks] if masks is not None else [len(c) for c in prepared.completions]
        prepared.values = BestOfNRows(torch.tensor(keep), sum(n * k for n, k in zip(own, keep, strict=True)))
        return prepared

    def loss(self, logprobs, batch, rows, prepared):
        # token-mean negative log-likelihood over the policy's own tokens of the kept answers
        keep = prepared.values.keep[rows].to(logprobs.device)
        mask = batch["mask"] * keep[:, None]
        nll = -(logprobs * mask).sum() / max(prepared.values.tokens, 1.0)
        return nll, {"loss": float(nll.detach()), "kept_answers": float(keep.sum())}

    def summarise(self, sums):
        return {"loss": sums.get("loss", 0.0), "kept_answers": sums.get("kept_answers", 0.0)}


def build_best_of_n(config: BestOfNConfig, policy) -> BestOfN:
    """Rejection-sampling fine-tuning: the supervised loss on each prompt's best-rewarded answers."""
    return BestOfN(config, policy)


@hookimpl
def register_algorithms(register):
    register(name="best-of-n", config=BestOfNConfig, build=build_best_of_n)


# -- an RL environment: guess the number ----------------------------------------------------------


class GuessNumberConfig(BaseModel):
    """`[rl.environment] name = "guess-number"`: the range the secret is drawn from and the guesses
    an episode allows (`[rl.environment] max_turns` still bounds it; set it at least as high)."""

    model_config = ConfigDict(extra="forbid")

    low: int = Field(1, description="the smallest secret")
    high: int = Field(16, description="the largest secret")
    max_guesses: int = Field(4, ge=1, description="guesses before the episode ends unsolved")

    @model_validator(mode="after")
    def _a_range(self) -> GuessNumberConfig:
        if self.high <= self.low:
            raise ValueError(f"high ({self.high}) must be above low ({self.low})")
        return self


def whole_number(text: str) -> int | None:
    """The whole number an answer ends on (as hpref's tool reward reads it), or None."""
    from hpref.rl.environments.tool import last_number

    number = last_number(text)
    return int(number) if number is not None and number.denominator == 1 else None


class GuessNumberEpisode:
    """One secret, the policy's guesses, the environment's "higher" / "lower" after each wrong one."""

    def __init__(self, config: GuessNumberConfig, secret: int) -> None:
        self.config = config
        self.secret = secret
        self.guesses: list[int | None] = []  # each turn's guess (None: the turn wrote no whole number)

    def actor(self) -> str:
        return "policy"

    def step(self, turn):
        from hpref.rl.rollout_types import Step

        guess = whole_number(turn.text)
        self.guesses.append(guess)
        if guess == self.secret or len(self.guesses) >= self.config.max_guesses:
            return Step(done=True)
        if guess is None:
            hint = f"Guess a whole number from {self.config.low} to {self.config.high}."
        else:
            hint = "higher" if guess < self.secret else "lower"
        return Step(observation=hint, role="user")

    def score(self) -> float:
        """1 for the secret; otherwise up to 0.5 for how close the last whole number guessed came
        (0 without one): a tiny policy that never finds it still gets a signal to learn from."""
        if self.success():
            return 1.0
        last = next((g for g in reversed(self.guesses) if g is not None), None)
        if last is None:
            return 0.0
        span = self.config.high - self.config.low
        return 0.5 * max(0.0, 1.0 - abs(last - self.secret) / span)

    def rewards(self) -> dict[str, float]:
        return {"policy": self.score()}

    def success(self) -> bool:
        return self.secret in self.guesses


class GuessNumber:
    name = "guess-number"
    roles = ("policy",)

    def __init__(self, config: GuessNumberConfig) -> None:
        self.config = config

    def start(self, prompt, row, seed: int) -> GuessNumberEpisode:
        """The secret is drawn from the episode's seed alone: a regenerated rollout replays it."""
        return GuessNumberEpisode(self.config, random.Random(seed).randint(self.config.low, self.config.high))


def build_guess_number(config: GuessNumberConfig) -> GuessNumber:
    """Guess a secret number: "higher" / "lower" as a user message after each wrong guess; the reward
    is the environment's (1 for the secret, else how close the last guess came)."""
    return GuessNumber(config)


# -- a two-role RL environment: one policy hides the number, another guesses it -------------------

GUESSER, KEEPER = "guesser", "keeper"


class GuessNumberDuelConfig(GuessNumberConfig):
    """`[rl.environment] name = "guess-number-duel", roles = { guesser = "a", keeper = "b" }`:
    guess-number's parameters, and what the keeper reads."""

    keeper_prompt: str = Field(
        "Pick a secret whole number from {low} to {high}; your partner will try to guess it. "
        "Answer with the number only.",
        description="what the keeper reads ({low}, {high})",
    )

    @model_validator(mode="after")
    def _keeper_prompt_fills(self) -> GuessNumberDuelConfig:
        try:  # refused when the recipe loads, not in the middle of a rollout
            self.keeper_prompt.format(low=self.low, high=self.high)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"keeper_prompt: only {{low}} and {{high}} can be filled in ({exc!r})") from None
        return self


class GuessNumberDuelEpisode:
    """The keeper's one turn picks the secret; then the guesser plays guess-number against it.

    Zero-sum: the keeper's reward is minus the guesser's, so it learns to pick the numbers the
    guesser finds hardest. A keeper that writes no whole number from `low` to `high` forfeits (-1,
    the worst it can get) and the secret is drawn from the episode's seed, so the guesser plays on.
    """

    def __init__(self, config: GuessNumberDuelConfig, prompt, drawn: int) -> None:
        self.config, self.prompt, self.drawn = config, prompt, drawn
        self.game: GuessNumberEpisode | None = None  # the guessing, once the keeper has picked
        self.forfeit = False

    def actor(self) -> str:
        return KEEPER if self.game is None else GUESSER

    def opening(self, role: str):
        """Each role's own first conversation (`hpref.rl.protocols.OpensPerRole`): the keeper's
        instruction; the guesser reads the prompt row, as in guess-number."""
        if role == KEEPER:
            return (self.config.keeper_prompt.format(low=self.config.low, high=self.config.high),)
        return tuple(self.prompt)

    def step(self, turn):
        from hpref.rl.rollout_types import Step

        if self.game is not None:
            return self.game.step(turn)
        pick = whole_number(turn.text)
        self.forfeit = pick is None or not self.config.low <= pick <= self.config.high
        self.game = GuessNumberEpisode(self.config, self.drawn if self.forfeit else pick)
        # addressed to the role that acts next (the guesser): the keeper's text itself stays hidden
        told = f"Your partner picked a whole number from {self.config.low} to {self.config.high}. Guess it."
        return Step(observation=told, role="user")

    def rewards(self) -> dict[str, float]:
        guesser = 0.0 if self.game is None else self.game.score()
        keeper = -1.0 if self.forfeit or self.game is None else -guesser
        return {GUESSER: guesser, KEEPER: keeper}

    def success(self) -> bool:
        """The guesser found the secret (the keeper's rows report the same episodes' figure)."""
        return self.game is not None and self.game.success()


class GuessNumberDuel:
    name = "guess-number-duel"
    roles = (GUESSER, KEEPER)  # every role needs a policy: [rl.environment] roles

    def __init__(self, config: GuessNumberDuelConfig) -> None:
        self.config = config

    def start(self, prompt, row, seed: int) -> GuessNumberDuelEpisode:
        """The forfeit's secret is drawn from the episode's seed alone: a regenerated rollout replays it."""
        drawn = random.Random(seed).randint(self.config.low, self.config.high)
        return GuessNumberDuelEpisode(self.config, prompt, drawn)


def build_guess_number_duel(config: GuessNumberDuelConfig) -> GuessNumberDuel:
    """Two roles: the keeper picks the secret, the guesser guesses it ("higher" / "lower" after each
    wrong guess); zero-sum (the keeper gets minus the guesser's guess-number reward)."""
    return GuessNumberDuel(config)


@hookimpl
def register_environments(register):
    register(name="guess-number", config=GuessNumberConfig, build=build_guess_number)
    register(name="guess-number-duel", config=GuessNumberDuelConfig, build=build_guess_number_duel)
