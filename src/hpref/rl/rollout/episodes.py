"""A rollout's episodes (`[rl.environment]`): each prompt's `group_size` episodes played turn by turn,
every turn of every live episode in one engine call, until the environment ends them or a bound does.

    played = await play_episodes(environment, codec, first, next, prompts, rows, group, seed, bounds)

The first turn is the request a single answer always was (`first_turn`: the prompts, `group_size`
answers each, the rollout's seed), so a `single-turn` run draws exactly what it did before
environments existed. Later turns continue each episode's own token ids (`next_turn`: one request,
one answer per live episode, a seed per turn): the policy's earlier turns stay the tokens it
generated, never decoded and re-encoded (the drift verl and OpenRLHF document), and an observation
is appended as the policy's chat template renders a tool or user message (`hpref.models.causal_lm.
observation_ids`). A turn cut at `max_new_tokens` gets its closing token appended as context first.

What the trainer gets per episode is one row: the prompt, then everything after it, with a mask that
is 1 on the policy's own tokens (trained on, with the engine's log-probs) and 0 on observations and
closing tokens (context: out of the loss, the KL and the entropy). `max_turns` and
`max_context_tokens` end an episode the environment has not ended; it is trained on as far as it
went and counted as truncated.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpref.data.prompts import Prompt, stream_rng
from hpref.rl.rollout_types import EpisodeStats, Generation, Turn

if TYPE_CHECKING:
    from hpref.rl.protocols import Environment, Episode

FirstTurn = Callable[[], Awaitable[Generation]]
#: (the live episodes' prompts, their contexts, the turn's seed) -> one answer per context
NextTurn = Callable[[list[Prompt], list[list[int]], int], Awaitable[Generation]]


@dataclass(frozen=True)
class Bounds:
    """What ends an episode the environment has not ended (`[rl.environment]`), and the role the
    policy plays in it."""

    role: str
    max_turns: int
    max_context_tokens: int
    max_new_tokens: int


class TurnCodec:
    """The policy's tokenizer's part in an episode: the token that closes a turn cut short, and an
    observation's tokens (`hpref.models.causal_lm`), each distinct observation encoded once. The
    tokenizer is loaded on first use (`load`): a single-turn run never needs it."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self._tokenizer: Any = None
        self._seen: dict[tuple[str, str], list[int]] = {}

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._load()
        return self._tokenizer

    def closes(self, tokens: list[int]) -> bool:
        """Whether a turn's last token is the one that closes a turn (the policy's eos)."""
        from hpref.models.causal_lm import turn_end_id

        return bool(tokens) and tokens[-1] == turn_end_id(self.tokenizer)

    @property
    def end(self) -> int:
        from hpref.models.causal_lm import turn_end_id

        return turn_end_id(self.tokenizer)

    def observation(self, role: str, text: str) -> list[int]:
        from hpref.models.causal_lm import observation_ids

        key = (role, text)
        if key not in self._seen:
            self._seen[key] = observation_ids(self.tokenizer, role, text)
        return self._seen[key]


@dataclass
class Playing:
    """One episode in progress: its row's prompt tokens and everything after them so far."""

    episode: Episode
    prompt: Prompt
    prompt_ids: list[int]
    completion: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    turn_reward: float = 0.0
    #: the reward of each of its turns (`Step.reward`, 0 where none), in order
    step_rewards: list[float] = field(default_factory=list)
    truncated: bool = False
    ended: bool = False
    final: str = ""
    #: (role, text) of every message after the prompt: the eval files' transcripts
    transcript: list[tuple[str, str]] = field(default_factory=list)

    def context(self) -> list[int]:
        return self.prompt_ids + self.completion


@dataclass
class Played:
    """A rollout's episodes, one row each (the group's episodes consecutive, as answers are)."""

    prompt_ids: list[list[int]]
    completions: list[list[int]]
    masks: list[list[int]]
    logprobs: list[list[float]]  # the policy's own tokens' only
    texts: list[str]  # each episode's last answer of the policy (what the run's rewards score)
    version: int  # the oldest weight version any of its turns was sampled with
    tokens: int  # tokens the policy generated
    seconds: float
    #: each episode's rewards from the environment (None: the run's rewards score its last answer)
    rewards: list[dict[str, float] | None]
    stats: EpisodeStats
    transcripts: list[list[tuple[str, str]]]
    #: the newest weight version any of its turns was sampled with: `version` itself whenever no
    #: weight push came between its turns (the driver waits for episodes in flight: `settle`)
    newest: int | None = None
    #: episodes several policies play (`hpref.rl.rollout.joint`): the role of each row (its policy
    #: may play several); None: every row is the policy's one role
    row_roles: list[str] | None = None
    #: the judged matches of episodes several policies play, as (this policy, the other, this
    #: policy's score in [0, 1]): one per episode a pair judge scored with this policy first
    matches: list[tuple[str, str, float]] = field(default_factory=list)

    @property
    def single_turn(self) -> bool:
        """No episode went past its first answer (nothing but the policy's tokens in any row)."""
        return all(all(m) for m in self.masks)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of an episode batch's later turn (the first turn samples with `seed` itself)."""
    return stream_rng("turn", seed, turn).getrandbits(62)


def episode_seed(seed: int, index: int) -> int:
    """The seed `Environment.start` gets for a rollout's episode `index`."""
    return stream_rng("episode", seed, index).getrandbits(62)


async def play_episodes(
    environment: Environment,
    codec: TurnCodec,
    first_turn: FirstTurn,
    next_turn: NextTurn,
    prompts: Sequence[Prompt],
    rows: Sequence[dict[str, Any]],
    group: int,
    seed: int,
    bounds: Bounds,
) -> Played:
    """Play `group` episodes per prompt to their end (see the module docstring)."""
    episodes = [
        environment.start(prompt, rows[i], episode_seed(seed, i * group + k))
        for i, prompt in enumerate(prompts)
        for k in range(group)
    ]
    out = await first_turn()
    playing = [
        Playing(episode, prompts[i // group], list(out.prompt_ids[i])) for i, episode in enumerate(episodes)
    ]
    versions, seconds = [out.version], out.seconds
    live = list(range(len(playing)))
    turn = 0
    while True:
        for j, i in enumerate(live):
            take_turn(playing[i], environment.name, out, j, codec, bounds)
        live = [i for i in live if not playing[i].ended]
        if not live:
            break
        turn += 1
        contexts = [playing[i].context() for i in live]
        out = await next_turn([playing[i].prompt for i in live], contexts, turn_seed(seed, turn))
        versions.append(out.version)
        seconds += out.seconds
    return Played(
        prompt_ids=[p.prompt_ids for p in playing],
        completions=[p.completion for p in playing],
        masks=[p.mask for p in playing],
        logprobs=[p.logprobs for p in playing],
        texts=[p.final for p in playing],
        version=min(versions),
        newest=max(versions),
        tokens=sum(sum(p.mask) for p in playing),
        seconds=seconds,
        rewards=[end_rewards(p) for p in playing],
        stats=EpisodeStats(
            turns=[p.turns for p in playing],
            tool_calls=[p.tool_calls for p in playing],
            tool_errors=[p.tool_errors for p in playing],
            truncated=[p.truncated for p in playing],
            success=[none_or_float(p.episode.success()) for p in playing],
            turn_rewards=[p.turn_reward for p in playing],
            turn_steps=[p.step_rewards for p in playing],
        ),
        transcripts=[p.transcript for p in playing],
    )


def take_turn(playing: Playing, name: str, out: Generation, j: int, codec: TurnCodec, bounds: Bounds) -> None:
    """Row `j` of `out` is `playing`'s turn: kept as generated, given to the environment, and either
    the end or the observation appended (unless a bound ends the episode first)."""
    acting = playing.episode.actor()
    if acting != bounds.role:
        raise RuntimeError(
            f"environment '{name}': its episode asked role '{acting}' to act, and this policy's episodes "
            f"are played by role '{bounds.role}' alone (rl.environment.roles)"
        )
    tokens = list(out.completions[j])
    playing.completion += tokens
    playing.mask += [1] * len(tokens)
    playing.logprobs += list(out.logprobs[j])
    playing.turns += 1
    playing.final = out.texts[j]
    playing.transcript.append((acting, out.texts[j]))
    # an answer shorter than the limit ended at a stop token or string (the engine cuts there)
    finished = len(tokens) < bounds.max_new_tokens or codec.closes(tokens)
    step = playing.episode.step(Turn(acting, out.texts[j], tuple(tokens), finished))
    playing.tool_calls += step.tool_calls
    playing.tool_errors += step.tool_errors
    if step.reward is not None:
        playing.turn_reward += float(step.reward)
    playing.step_rewards.append(0.0 if step.reward is None else float(step.reward))
    if step.done:
        playing.ended = True
        return
    if step.observation is None:  # only where several policies act: the next turn is another's
        raise RuntimeError(
            f"environment '{name}': its episode went on with no observation, and a policy playing alone "
            f"takes its next turn after one (Step.observation)"
        )
    context = ([] if finished else [codec.end]) + codec.observation(step.role, step.observation)
    room = len(playing.context()) + len(context) + bounds.max_new_tokens <= bounds.max_context_tokens
    if playing.turns >= bounds.max_turns or not room:
        playing.ended = playing.truncated = True
        return
    playing.completion += context
    playing.mask += [0] * len(context)
    playing.transcript.append((step.role, step.observation))


def end_rewards(playing: Playing) -> dict[str, float] | None:
    """The environment's rewards at the episode's end, each role's, or None when it leaves the
    scoring to the run's rewards (`EpisodeStats.turn_rewards` are added to either by the executor)."""
    rewards = playing.episode.rewards()
    if rewards is None:
        return None
    return {role: float(value) for role, value in rewards.items()}


def none_or_float(value: bool | None) -> float | None:
    return None if value is None else float(value)
