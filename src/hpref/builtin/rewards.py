"""Built-in reward components for `hpref rl`: `rule`, `judge` and `remote` (`remote_reward`).

A reward's `build(config)` returns an object with

    score_groups(prompts: list[tuple[str, ...]], groups: list[list[str]], opponents=None)
        -> list[list[float]]

`groups[i]` are the answers (one per sample of a GRPO group) to `prompts[i]`; the result has the same
shape. Scoring whole groups at once lets a pairwise judge compare answers within a group and batch
every comparison into one forward pass. A pairwise reward with `wants_opponents = True` also gets
`opponents[i]`: other policies' answers to the same prompt (the rollout executor collects them), and
each answer's reward is its mean win probability (+ half the tie probability) over the other answers
of its group and those opponents: cross-policy judging. Rewards also expose `true_utility(prompt,
answer)` when they know the ground truth, for the metrics that reveal reward hacking.

`judge` on a reward model's export (`head = "reward"`) scores each answer alone: a group of G answers
costs G sequences (packed two by two), not G (G - 1) pairs, and the reward is the model's scalar score,
as in TRL or OpenRLHF; other policies' answers change nothing, so it asks for none.

`judge` scores through `hpref.builtin.scoring.ExportScorer`, which `hpref serve` shares; `remote`
asks such a server over HTTP. torch is imported inside `judge`'s build only: `hpref --help` loads
this module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from hpref.builtin.remote_reward import RemoteConfig, build_remote
from hpref.builtin.scoring import pairwise_rewards
from hpref.exports.layout import export_problem
from hpref.hookspecs import hookimpl

Prompt = tuple[str, ...]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _CrossPolicy(_Config):
    cross_policy: bool = Field(
        True,
        description="with several policies, also judge each answer against the other policies' answers "
        "to the same prompt (pairwise rewards only)",
    )
    opponent_answers: int = Field(
        2, ge=1, description="answers of each other policy per prompt that an answer is judged against"
    )


class RuleConfig(_CrossPolicy):
    #: `judge_answers` gives three-way verdicts (online DPO; `hpref.rl.protocols.PairJudge`)
    judges_pairs: ClassVar[bool] = True

    mode: Literal["utility", "pairwise"] = Field(
        "utility",
        description="utility = the arena judge's latent utility of each answer; pairwise = mean win "
        "probability (+ half the tie probability) against the other answers of the group",
    )
    function: str | None = Field(
        None,
        description="'module:function' taking (prompt turns, answer) — or (prompt turns, answer, row), the "
        "prompt file row's other columns (a reference answer, a label) — and returning a float, instead "
        "of the synthetic arena's judge",
    )
    columns: list[str] = Field(
        default_factory=list,
        description="the prompt file's columns the function reads from its row: checked before the run "
        "starts (empty: not checked; the row has every column beside the conversation's)",
    )


class JudgeConfig(_CrossPolicy):
    judges_pairs: ClassVar[bool] = True

    path: str = Field(description="folder of a preference model exported by `hpref train` + `hpref save`")
    formatter: str = Field(
        "pab", description="the formatter the judge was trained with (a reward model always uses 'answers')"
    )
    max_length: int = Field(512, ge=16, description="token budget of one judged pair")
    symmetric: bool = Field(
        True, description="judge each pair in both orders and average, cancelling the judge's position bias"
    )
    micro_batch_tokens: int = Field(16384, ge=64, description="tokens per packed scoring forward pass")

    def export_problem(self) -> str | None:
        """Why `path` is not an `hpref save` export on this machine, or None. Checked before any actor
        starts (`check_reward_exports`), not when the recipe is read: a shipped recipe names an
        export its user makes first, and `hpref recipes check --portable` must accept it."""
        return export_problem(self.path)


def check_reward_exports(rewards: dict[str, Any], where: str) -> None:
    """Every judge reward's export exists and every remote reward's server listens (`rewards`:
    dotted key -> validated reward config, e.g. {"rl.reward": ...}); a `RecipeError` of one line
    naming the key otherwise."""
    from hpref.errors import RecipeError

    for key, config in rewards.items():
        problem = config.export_problem() if isinstance(config, JudgeConfig | RemoteConfig) else None
        if problem:
            field = "url" if isinstance(config, RemoteConfig) else "path"
            raise RecipeError(f"{where}: {key}.{field}: {problem}")


def rule_function(spec: str, key: str = "rl.reward") -> tuple[Callable[..., float], bool]:
    """A rule reward's user function and whether it takes the row: `(prompt, answer)` or
    `(prompt, answer, row)`. A `UserError` naming `key`.function when it cannot be loaded or called so."""
    import inspect

    from hpref.errors import UserError

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"{key}.function: expected 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"{key}.function: cannot load {spec!r}: {exc}") from None
    if not callable(fn):
        raise UserError(f"{key}.function: {spec!r} is not callable")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: called as (prompt, answer)
        return fn, False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    rest = any(p.kind == p.VAR_POSITIONAL for p in params)
    keyword_only = [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if len(required) > 3 or keyword_only or (len(positional) < 2 and not rest):
        shown = ", ".join(p.name for p in params)
        raise UserError(
            f"{key}.function: {spec!r} takes ({shown}); a rule function takes (prompt, answer) or "
            "(prompt, answer, row)"
        )
    return fn, len(positional) >= 3 or rest


class RuleReward:
    """The synthetic arena's ground-truth judge (or a user function) as the reward."""

    def __init__(self, config: RuleConfig) -> None:
        from hpref import arena as synthetic

        self.config = config
        self._synthetic = synthetic
        function, self.wants_rows = rule_function(config.function) if config.function else (None, False)
        self._function = function or synthetic.answer_utility
        #: scores within a group are win probabilities against each other (else: one score per answer)
        self.pairwise = config.mode == "pairwise"
        # a utility is absolute: other policies' answers would not change it
        self.wants_opponents = self.pairwise and config.cross_policy
        self.opponent_answers = config.opponent_answers

    def true_utility(self, prompt: Prompt, answer: str) -> float:
        return float(self._synthetic.answer_utility(prompt, answer))

    def _utility(self, prompt: Prompt, answer: str, row: dict[str, Any] | None) -> float:
        if self.wants_rows:
            return float(self._function(prompt, answer, dict(row or {})))
        return float(self._function(prompt, answer))

    def score_groups(
        self,
        prompts: Sequence[Prompt],
        groups: Sequence[Sequence[str]],
        opponents: Sequence[Sequence[str]] | None = None,
        rows: Sequence[dict[str, Any]] | None = None,
    ) -> list[list[float]]:
        """`rows[i]`: the prompt file's row of `prompts[i]`, for a function that takes it."""
        out = []
        for g, (prompt, answers) in enumerate(zip(prompts, groups, strict=True)):
            row = rows[g] if rows else None
            if self.config.mode == "utility":
                out.append([self._utility(prompt, a, row) for a in answers])
                continue
            everyone = [*answers, *(opponents[g] if opponents else ())]
            utilities = [self._utility(prompt, a, row) for a in everyone]

            def win(i: int, j: int, u: list[float] = utilities) -> float:
                p_a, _p_b, p_tie = self._synthetic.davidson(u[i], u[j])
                return p_a + 0.5 * p_tie

            out.append(pairwise_rewards(len(answers), win, len(everyone)))
        return out

    def judge_answers(
        self,
        prompts: Sequence[Prompt],
        pairs: Sequence[tuple[str, str]],
        rows: Sequence[dict[str, Any]] | None = None,
    ) -> list[tuple[float, float, float]]:
        """Davidson's three outcomes on the two answers' utilities (the arena judge's own model of ties)."""
        rows = rows or [None] * len(prompts)  # type: ignore[list-item]
        return [
            self._synthetic.davidson(self._utility(p, a, row), self._utility(p, b, row))
            for p, (a, b), row in zip(prompts, pairs, rows, strict=True)
        ]


class JudgeReward:
    """An hpref preference model judging every pair of answers within a group (`ExportScorer`, which
    `hpref serve` shares)."""

    def __init__(self, config: JudgeConfig) -> None:
        from hpref import arena as synthetic
        from hpref.builtin.scoring import ExportScorer

        self.config = config
        self.scorer = ExportScorer.load(
            config.path,
            formatter=config.formatter,
            max_length=config.max_length,
            micro_batch_tokens=config.micro_batch_tokens,
        )
        self.model = self.scorer.model
        #: a scalar reward model: each answer scored alone, no pairs, no opponents
        self.scalar = self.scorer.paired
        self._synthetic = synthetic
        self.pairwise = not self.scalar
        self.wants_opponents = config.cross_policy and self.pairwise
        self.opponent_answers = config.opponent_answers

    def true_utility(self, prompt: Prompt, answer: str) -> float:
        return float(self._synthetic.answer_utility(prompt, answer))

    def judge_pairs(self, battles: list[Any]) -> list[tuple[float, float, float]]:
        """(p_a, p_b, p_tie) of each battle, scored in packed micro-batches."""
        return self.scorer.judge_pairs(battles)

    def score_groups(
        self,
        prompts: Sequence[Prompt],
        groups: Sequence[Sequence[str]],
        opponents: Sequence[Sequence[str]] | None = None,
    ) -> list[list[float]]:
        """Within-group pairs, and each answer against each opponent, in one batched judging pass
        (both orders of a pair when `symmetric`); a reward model scores each answer alone."""
        return self.scorer.score_groups(prompts, groups, opponents, symmetric=self.config.symmetric)

    def judge_answers(
        self, prompts: Sequence[Prompt], pairs: Sequence[tuple[str, str]]
    ) -> list[tuple[float, float, float]]:
        """The export's (p_first, p_second, p_tie) of each pair, both orders averaged when `symmetric`
        (a reward model's are Davidson's on its two scores, with its learnt tie strength), in one
        packed pass."""
        jobs = [
            self.scorer.judge_job(tuple(p), a, b, swap=self.config.symmetric)
            for p, (a, b) in zip(prompts, pairs, strict=True)
        ]
        return self.scorer.run(jobs)


def build_rule(config: RuleConfig) -> RuleReward:
    """The synthetic arena's ground-truth judge (or a user function) scoring each answer."""
    return RuleReward(config)


def build_judge(config: JudgeConfig) -> JudgeReward:
    """An exported hpref preference model: reward = win probability (+ half tie) within the group
    and against the other policies' answers."""
    return JudgeReward(config)


@hookimpl
def register_rewards(register):
    register(name="rule", config=RuleConfig, build=build_rule)
    register(name="judge", config=JudgeConfig, build=build_judge)
    register(name="remote", config=RemoteConfig, build=build_remote)
