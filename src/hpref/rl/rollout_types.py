"""What travels through `hpref rl`, typed: what an engine is asked (`GenerationRequest`) and what it
answers (`Generation`), and the `Rollout` the executor makes of it (answers + rewards, and the judged
pairs a pairwise algorithm asks for), which the driver hands to the trainer and to the metrics row.
One object from the executor on, filled in one place (`hpref.rl.rollout.executor.RolloutExecutor.
_produce`); the driver marks a regenerated one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from hpref.recipe.rl_sampling import KNOBS_OFF

if TYPE_CHECKING:
    from hpref.data.prompts import Prompt

#: a three-way verdict on an answer pair: (P(first preferred), P(second preferred), P(tie))
Verdict = tuple[float, float, float]


@dataclass(frozen=True)
class GenerationRequest:
    """`Engine.generate`'s arguments as one request of `generate_batch` (every built-in engine's
    `generate` is the batch of its one request, so a request is served alike alone or batched). It
    crosses Ray to the engine's actor (a plain dataclass: pickled as is). The sampling knobs are off
    at their `KNOBS_OFF` values (`hpref.recipe.rl_sampling`)."""

    prompts: list[Prompt]
    group_size: int
    max_new_tokens: int
    temperature: float
    top_k: int = 0
    seed: int = 0
    greedy: bool = False
    #: the policy whose LoRA adapter answers, on a shared base's engine (`rl.share_base`)
    adapter: str | None = None
    top_p: float = KNOBS_OFF["top_p"]
    min_p: float = KNOBS_OFF["min_p"]
    repetition_penalty: float = KNOBS_OFF["repetition_penalty"]
    stop: tuple[str, ...] = KNOBS_OFF["stop"]
    #: an episode's later turns: the token ids each prompt continues from (the transcript so far, the
    #: policy's earlier turns as it generated them), used as they are instead of encoding `prompts`
    contexts: list[list[int]] | None = None

    def __post_init__(self) -> None:
        # a recipe's stop strings arrive as a list; the request holds them as a tuple, as `KNOBS_OFF`
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.contexts is not None and len(self.contexts) != len(self.prompts):
            raise ValueError(f"{len(self.contexts)} contexts for {len(self.prompts)} prompts")

    @property
    def rows(self) -> int:
        """The answers it asks for: `group_size` per prompt."""
        return len(self.prompts) * self.group_size


@dataclass
class Generation:
    """What every engine's `generate` returns, one per `generate_batch` request
    (`hpref.rl.protocols.Engine`; built by `hpref.rl.engines.requests.generation_result`)."""

    prompt_ids: list[list[int]]  # each answer's prompt tokens (a group's answers share one prompt)
    completions: list[list[int]]  # each answer's tokens, eos included
    logprobs: list[list[float]]  # per completion token, at the sampling temperature
    texts: list[str]
    version: int  # the engine's weight version that generated them
    tokens: int
    seconds: float


@dataclass(frozen=True)
class Turn:
    """One role's turn in an episode (`hpref.rl.protocols.Episode.step`), as its engine sampled it."""

    role: str
    #: decoded by the policy's own tokenizer, cut at its stop strings (what a reward reads)
    text: str
    #: the tokens the engine generated (the context of later turns keeps these, never a re-encoding)
    tokens: tuple[int, ...]
    #: it ended at a stop token or string; False: cut at `max_new_tokens`
    finished: bool


@dataclass(frozen=True)
class Step:
    """An environment's answer to a turn (`hpref.rl.protocols.Episode.step`): the observation the next
    turn sees (rendered by the policy's chat template as a `role` message: "tool" or "user"), or the
    end of the episode; a reward for the turn just taken when the environment has per-turn rewards;
    and what it counted (tool calls, and those that failed: an error is an observation, never a
    crash). Where several policies act, an episode may go on with no observation: the next role
    acts on what it had (debate's second answer, written without seeing the first)."""

    observation: str | None = None
    role: str = "tool"
    done: bool = False
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0

    def __post_init__(self) -> None:
        if self.role not in ("tool", "user"):
            raise ValueError(f"a Step's observation is a 'tool' or 'user' message, not {self.role!r}")


@dataclass
class EpisodeStats:
    """Per episode of a rollout (one per answer row), what the environment and its bounds counted."""

    turns: list[int]
    tool_calls: list[int]
    tool_errors: list[int]
    #: ended by `max_turns` or `max_context_tokens`, not by the environment: trained on as far as it went
    truncated: list[bool]
    #: the environment's verdict on the episode when it has one (`Episode.success`), else None
    success: list[float | None]
    #: the sum of the environment's per-turn rewards (`Step.reward`) in each episode
    turn_rewards: list[float]
    #: each row's own turns' rewards (`Step.reward`, 0 where none), in order: where GRPO's per-turn
    #: advantages read each turn's reward-to-go (None: a save from before they were kept)
    turn_steps: list[list[float]] | None = None


@dataclass
class Rollout:
    """One policy's rollout: `prompts x group_size` answers (a group's answers consecutive), one
    reward each, and for an algorithm that `needs_preferences` the verdict of each pair."""

    policy: str
    rollout_id: int
    group_size: int
    temperature: float
    prompt_ids: list[list[int]]
    completions: list[list[int]]
    logprobs: list[list[float]]
    texts: list[str]
    version: int
    tokens: int
    seconds: float
    rewards: list[float]
    #: answer pairs judged for an algorithm that `needs_preferences`, as (row, row): a row below
    #: len(completions) is the policy's answer, a row from len(completions) on is
    #: `opponent_texts[row - len(completions)]`, another policy's answer to the first row's prompt
    pairs: list[tuple[int, int]] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    opponent_texts: list[str] = field(default_factory=list)
    true_utility: list[float] | None = None
    #: with several rewards (`[rl.rewards.<name>]`): each component's reward per answer, before weights
    reward_components: dict[str, list[float]] | None = None
    opponent_tokens: int = 0
    stale_regenerated: bool = False
    #: multi-turn episodes (`[rl.environment]`): per row, one flag per `completions` token, 1 where the
    #: policy generated it (trained on), 0 where it is context (an observation, a turn's closing
    #: token the template adds); `logprobs` then hold the engine's log-probs of the 1s only. None: a
    #: single answer per row, every token the policy's.
    masks: list[list[int]] | None = None
    episodes: EpisodeStats | None = None
    #: the judged matches this rollout adds to the run's live leaderboard, each (this policy, another
    #: policy, this policy's score in [0, 1]): debate verdicts, online DPO's cross-policy pairs
    matches: list[tuple[str, str, float]] = field(default_factory=list)
    #: the matches of every rollout taken so far, this one's included, as {player: {opponent: [games,
    #: player's summed score]}}: what the live leaderboard is fitted to (set when the rollout is taken)
    standings: dict[str, dict[str, list[float]]] | None = None

    def own_lengths(self) -> list[int]:
        """Each row's tokens the policy generated (its answer's length; every turn's, in an episode)."""
        if self.masks is None:
            return [len(c) for c in self.completions]
        return [sum(m) for m in self.masks]

    def to_json(self) -> dict[str, Any]:
        """Plain lists, numbers and strings (a save's `executor.json`: no code runs from it)."""
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Rollout:
        episodes = row.get("episodes")
        data = cls(**{**row, "episodes": EpisodeStats(**episodes) if episodes is not None else None})
        data.pairs = [(int(a), int(b)) for a, b in data.pairs]
        data.verdicts = [tuple(v) for v in data.verdicts]  # type: ignore[misc]
        data.matches = [(str(a), str(b), float(s)) for a, b, s in data.matches]
        return data

    @classmethod
    def from_generation(cls, out: Generation, **fields: Any) -> Rollout:
        """The rollout of a generation: its answers as the engine gave them, and `fields`."""
        return cls(
            prompt_ids=out.prompt_ids,
            completions=out.completions,
            logprobs=out.logprobs,
            texts=out.texts,
            version=out.version,
            tokens=out.tokens,
            seconds=out.seconds,
            **fields,
        )


@dataclass
class TrainingRows:
    """What a step trains on (`Algorithm.prepare`): rows of (prompt, answer) tokens in groups of `group`
    consecutive rows that share a prompt (a micro-batch holds whole groups), the log-probs the engine
    sampled them with (None for rows it did not sample), the temperature the trainer's log-probs are
    taken at, and the algorithm's own per-row data (`values`)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    group: int
    behaviour: list[list[float]] | None
    temperature: float
    values: Any = None
    #: the loss reads a group's rows together (online DPO's pairs): a micro-batch never splits one
    whole_groups: bool = False
    #: per row, whether it is one of the policy's own sampled answers (None: all are); the trainer's
    #: `entropy` metric reads those rows only (not an opponent's answer in a cross-policy pair)
    sampled: list[bool] | None = None
    #: metrics of the whole step the algorithm knows once (the advantages' spread), reported as they
    #: are: not summed over micro-batches or ranks
    metrics: dict[str, float] = field(default_factory=dict)
    #: per row, per completion token: 1 where the policy generated it (the loss, the KL and the
    #: entropy read those), 0 for context inside the completion (an episode's observations); None:
    #: every completion token counts. `behaviour` then holds log-probs of the 1s only.
    masks: list[list[int]] | None = None

    def trained_tokens(self) -> int:
        """The tokens the step trains on: every completion token, or the 1s of `masks`."""
        if self.masks is None:
            return sum(len(c) for c in self.completions)
        return sum(sum(m) for m in self.masks)


def rollout_of_tokens(
    rollout_id: int,
    prompt_ids: list[list[int]],
    completions: list[list[int]],
    logprobs: list[list[float]],
    rewards: list[float],
    group_size: int,
    temperature: float = 1.0,
    policy: str = "a",
    **fields: Any,
) -> Rollout:
    """A rollout made of token ids alone, what a trainer reads (tests and benchmarks that step a
    trainer without an engine): no texts, version 0."""
    values: dict[str, Any] = {
        "policy": policy,
        "rollout_id": rollout_id,
        "group_size": group_size,
        "temperature": temperature,
        "prompt_ids": prompt_ids,
        "completions": completions,
        "logprobs": logprobs,
        "texts": [""] * len(completions),
        "version": 0,
        "tokens": sum(len(c) for c in completions),
        "seconds": 0.0,
        "rewards": rewards,
    }
    return Rollout(**{**values, **fields})
