"""Episodes several policies act in (#50): an environment with several roles, each role played by
the policy `[rl.environment] roles = { speaker = "a", listener = "b" }` names (one policy may play
several: self-play).

    played = await play_together(environment, seating, sample, prompts, rows, group, seed)
    played["a"]  # policy a's rows: per prompt, per role it plays, `group` episodes (a GRPO group)

Each role keeps a transcript of its own, in its policy's tokens: it starts from the role's opening
(`Episode.opening(role)` when the episode has one, else the prompt, laid out by the policy's chat
template) the first time it acts, every observation the environment addresses to it (the `Step`
before its turn) is appended as a tool or user message, and its turns stay the tokens its engine
generated, as in a single policy's episodes (`hpref.rl.rollout.episodes`). Each round, every live
episode's acting role takes its turn: one engine request per policy for all of them (a shared base's
requests batched into one call, each row on its policy's adapter), the policies' requests at once.

A role's row is its transcript after its opening, with a mask that is 1 on its own tokens; its
reward is the environment's for that role (`Episode.rewards()`), or the run's rewards scoring its
last answer, or, in an environment whose two roles are judged as a pair (`JudgedInPairs`: debate),
its share of the pair's verdict: the run's pair judge reads both orders, and each side gets its
P(win) + P(tie)/2, averaged over the orders (the two sides' rewards sum to 1).
A policy's rollout lists its rows by prompt, then role, then episode, so a group of
`group` consecutive rows is one role's answers to one start: a role is compared with itself, never
with its partner (AT-GRPO's grouping per role; per turn position too, under GRPO's
`turn_advantages`: turn k of a role is compared with turn k of the start's other episodes, which
unlike AT-GRPO's tree sampling are independent episodes, not samples from one state).

In an environment with a `SharedTurn` (propose-solve), the shared role acts once, first, and only in
each start's first episode: its turn (the same tokens) is given to the start's other episodes, so
they are `group` independent continuations of one turn (a solver's attempts at one problem). That
role's rows are one per start (its start's first episode's seat), and every episode's rewards are
the environment's `start_rewards` over the start's episodes together.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpref.data.prompts import Prompt
from hpref.rl.protocols import JudgedInPairs, OpensPerRole, SharedTurn
from hpref.rl.rollout.episodes import Bounds, Played, TurnCodec, episode_seed, none_or_float, turn_seed
from hpref.rl.rollout_types import EpisodeStats, Generation, Turn, Verdict

if TYPE_CHECKING:
    from hpref.rl.protocols import Environment, Episode

#: (policy, the rows' prompts, their contexts, the round's seed) -> one answer per context
Sample = Callable[[str, list[Prompt], list[list[int]], int], Awaitable[Generation]]
#: (prompts, answer pairs, the prompts' rows) -> a (P(first), P(second), P(tie)) verdict per pair
Judge = Callable[[list[Prompt], list[tuple[str, str]], list[dict[str, Any]]], Awaitable[list[Verdict]]]


@dataclass
class Seat:
    """One role's transcript in one episode: its opening's tokens, then everything after them."""

    policy: str
    prompt_ids: list[int] = field(default_factory=list)
    completion: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    final: str = ""
    opened: bool = False
    #: its last turn was cut at max_new_tokens: its closing token goes first into what follows
    cut: bool = False
    transcript: list[tuple[str, str]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # of the weights each of its turns came from
    step_rewards: list[float] = field(default_factory=list)  # each of its turns' `Step.reward` (0: none)

    def context(self) -> list[int]:
        return self.prompt_ids + self.completion

    def append(self, tokens: list[int]) -> None:
        """Context after the opening: an observation, a closing token (not trained on)."""
        self.completion += tokens
        self.mask += [0] * len(tokens)


@dataclass
class Table:
    """One episode in progress, with a seat per role."""

    episode: Episode
    prompt: Prompt
    seats: dict[str, Seat]
    ended: bool = False
    truncated: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    turn_rewards: dict[str, float] = field(default_factory=dict)
    #: its rewards per role when they depend on other episodes too, once given: a pair's verdict
    #: (`JudgedInPairs`), a start's (`SharedTurn`)
    together: dict[str, float] | None = None
    row: dict[str, Any] = field(default_factory=dict)
    #: the start's first episode, whose shared role's turn (`SharedTurn`) this episode takes as its own
    lead: Table | None = None


@dataclass
class Seating:
    """Which policy plays each role, and what each policy needs to take a turn."""

    roles: dict[str, str]  # role -> policy
    codecs: dict[str, TurnCodec]  # policy -> its tokenizer's part
    bounds: dict[str, Bounds]  # policy -> its turns' bounds (its max_new_tokens)

    def roles_of(self, policy: str) -> list[str]:
        return [role for role, p in self.roles.items() if p == policy]


async def play_together(
    environment: Environment,
    seating: Seating,
    sample: Sample,
    prompts: Sequence[Prompt],
    rows: Sequence[dict[str, Any]],
    group: int,
    seed: int,
    judge: Judge | None = None,
) -> dict[str, Played]:
    """Play `group` episodes per prompt with every role seated (see the module docstring); each
    policy's part of them. `judge`: the run's pair judge, for an environment that is `JudgedInPairs`."""
    began = time.perf_counter()
    shared = environment.shared_role if isinstance(environment, SharedTurn) else None
    tables = set_tables(environment, seating, prompts, rows, group, seed, shared)
    turn = 0
    live = list(tables)
    while live:
        turn += 1
        asked: dict[str, list[tuple[Table, str]]] = {}
        sharing: dict[int, list[Table]] = {}  # a start's first episode -> the others, given its shared turn
        for table in live:
            role = table.episode.actor()
            if role not in table.seats:
                raise RuntimeError(
                    f"environment '{environment.name}': its episode asked role '{role}' to act, which no "
                    f"policy plays (rl.environment.roles: {seating.roles})"
                )
            seat = table.seats[role]
            if not seat.opened:
                open_seat(seat, table, role, seating.codecs[seat.policy])
            if role == shared and table.lead is not None:  # its start's first episode plays it now
                if turn > 1:  # else a later episode's turn would be one its row (the first's) lacks
                    raise RuntimeError(f"environment '{environment.name}': '{role}' must act once, first")
                sharing.setdefault(id(table.lead), []).append(table)
                continue
            asked.setdefault(seat.policy, []).append((table, role))
        order = sorted(asked)
        outs = await asyncio.gather(
            *(
                sample(
                    p,
                    [t.prompt for t, _ in asked[p]],
                    [t.seats[role].context() for t, role in asked[p]],
                    turn_seed(seed, turn),
                )
                for p in order
            )
        )
        for p, out in zip(order, outs, strict=True):
            for j, (table, role) in enumerate(asked[p]):
                for taker in [table, *(sharing.pop(id(table), []) if role == shared else [])]:
                    take_seat_turn(taker, role, out, j, seating)
        live = [t for t in live if not t.ended]
    for table in tables:  # a role the episode ended before it acted still has its row: its opening
        for role, seat in table.seats.items():
            if not seat.opened:
                open_seat(seat, table, role, seating.codecs[seat.policy])
    if isinstance(environment, JudgedInPairs):
        if judge is None:
            raise RuntimeError(
                f"environment '{environment.name}' judges its episodes in pairs: no judge given"
            )
        await judge_tables(tables, environment.judged_roles, judge)
    if isinstance(environment, SharedTurn):
        give_start_rewards(tables, environment, group)
    seconds = time.perf_counter() - began
    parts = {
        p: policy_part(tables, seating.roles_of(p), group, seconds, shared)
        for p in sorted(set(seating.roles.values()))
    }
    if isinstance(environment, JudgedInPairs):  # the live leaderboard's matches, each once
        role = environment.judged_roles[0]
        first, second = (seating.roles[r] for r in environment.judged_roles)
        if first != second:  # self-play: a policy against itself is no match
            parts[first].matches = [(first, second, (t.together or {})[role]) for t in tables]
    return parts


def set_tables(
    environment: Environment,
    seating: Seating,
    prompts: Sequence[Prompt],
    rows: Sequence[dict[str, Any]],
    group: int,
    seed: int,
    shared: str | None,
) -> list[Table]:
    """`group` episodes per prompt, each seeded by its place; with a shared role, each start's later
    episodes led by its first."""
    tables: list[Table] = []
    for i, prompt in enumerate(prompts):
        for k in range(group):
            episode = environment.start(prompt, rows[i], episode_seed(seed, i * group + k))
            seats = {role: Seat(policy) for role, policy in seating.roles.items()}
            lead = tables[i * group] if shared is not None and k else None
            tables.append(Table(episode, prompt, seats, row=rows[i], lead=lead))
    return tables


def give_start_rewards(tables: list[Table], environment: SharedTurn, group: int) -> None:
    """Each start's episodes' rewards, from all of them together (`SharedTurn.start_rewards`: a
    proposer's reward is its problem's solve rate over the start's attempts)."""
    for first in range(0, len(tables), group):
        start = tables[first : first + group]
        given = environment.start_rewards([t.episode for t in start])
        if len(given) != len(start):
            raise RuntimeError(f"start_rewards gave {len(given)} episodes' rewards for {len(start)} episodes")
        for table, rewards in zip(start, given, strict=True):
            table.together = rewards


async def judge_tables(tables: list[Table], roles: tuple[str, str], judge: Judge) -> None:
    """Each episode's two judged roles' last answers, judged in both orders in one call (a judge may
    favour a position: the orders' mean has no such bias); each role's reward is its P(win) plus half
    the P(tie), averaged over the orders."""
    first, second = roles
    prompts, pairs, rows = [], [], []
    for t in tables:
        x, y = t.seats[first].final, t.seats[second].final
        prompts += [t.prompt, t.prompt]
        pairs += [(x, y), (y, x)]
        rows += [t.row, t.row]
    verdicts = await judge(prompts, pairs, rows)
    if len(verdicts) != len(pairs):
        raise RuntimeError(f"the pair judge gave {len(verdicts)} verdicts for {len(pairs)} answer pairs")
    for i, t in enumerate(tables):
        (win, _, tie), (_, win_r, tie_r) = verdicts[2 * i], verdicts[2 * i + 1]
        score = 0.5 * ((win + 0.5 * tie) + (win_r + 0.5 * tie_r))
        t.together = {first: score, second: 1.0 - score}


def open_seat(seat: Seat, table: Table, role: str, codec: TurnCodec) -> None:
    """The role's first context: its opening (the episode's own for the role, else the prompt) in
    its policy's layout, with whatever observations reached it before it first acted added to the
    opening's last message (the listener's question and the speaker's message are one user message:
    appended as messages of their own after the layout's generation prompt, they would leave an
    empty assistant turn open before them)."""
    from hpref.models.causal_lm import encode_prompt

    opening = table.episode.opening(role) if isinstance(table.episode, OpensPerRole) else table.prompt
    waiting = [text for _, text in seat.transcript]  # observations addressed to it before it opened
    if waiting:
        opening = (*opening[:-1], "\n\n".join([opening[-1], *waiting]))
    seat.prompt_ids = encode_prompt(codec.tokenizer, tuple(opening))
    seat.completion, seat.mask = [], []
    seat.opened = True


def take_seat_turn(table: Table, role: str, out: Generation, j: int, seating: Seating) -> None:
    """Row `j` of `out` is the turn of `role` in `table`: kept as generated, given to the environment;
    its observation goes to the role that acts next, unless the episode ends (the environment, or a
    bound of the role that just acted or of the next one)."""
    seat = table.seats[role]
    bounds, codec = seating.bounds[seat.policy], seating.codecs[seat.policy]
    tokens = list(out.completions[j])
    seat.completion += tokens
    seat.mask += [1] * len(tokens)
    seat.logprobs += list(out.logprobs[j])
    seat.turns += 1
    seat.final = out.texts[j]
    seat.transcript.append((role, out.texts[j]))
    seat.versions.append(out.version)
    finished = len(tokens) < bounds.max_new_tokens or codec.closes(tokens)
    seat.cut = not finished
    step = table.episode.step(Turn(role, out.texts[j], tuple(tokens), finished))
    table.tool_calls += step.tool_calls
    table.tool_errors += step.tool_errors
    if step.reward is not None:
        table.turn_rewards[role] = table.turn_rewards.get(role, 0.0) + float(step.reward)
    seat.step_rewards.append(0.0 if step.reward is None else float(step.reward))
    if step.done:
        table.ended = True
        return
    if seat.turns >= bounds.max_turns:
        table.ended = table.truncated = True
        return
    nxt = table.episode.actor()
    target = table.seats.get(nxt)
    if target is None:
        raise RuntimeError(f"the episode asked role '{nxt}' to act, which no policy plays")
    if step.observation is None:  # the next role acts on what it had (debate's unseen first answers)
        return
    target_codec, target_bounds = seating.codecs[target.policy], seating.bounds[target.policy]
    context = ([target_codec.end] if target.cut else []) + target_codec.observation(
        step.role, step.observation
    )
    room = len(target.context()) + len(context) + target_bounds.max_new_tokens
    if target.opened and room > target_bounds.max_context_tokens:
        table.ended = table.truncated = True
        return
    target.append(context)
    target.cut = False
    target.transcript.append((step.role, step.observation))


def policy_part(
    tables: list[Table], roles: list[str], group: int, seconds: float, shared: str | None = None
) -> Played:
    """One policy's rows of the episodes: per start (`group` consecutive episodes), per role it plays,
    per episode (the `shared` role: its start's first episode only, the one that took its turn); each
    row's reward from the environment as {its role: value}, or None."""
    seats: list[tuple[Table, str]] = []
    for start in range(0, len(tables), group):
        for role in roles:
            seats += [(t, role) for t in tables[start : start + (1 if role == shared else group)]]
    given = {id(t): t.together if t.together is not None else t.episode.rewards() for t in tables}
    rows = [t.seats[role] for t, role in seats]
    return Played(
        prompt_ids=[s.prompt_ids for s in rows],
        completions=[s.completion for s in rows],
        masks=[s.mask for s in rows],
        logprobs=[s.logprobs for s in rows],
        texts=[s.final for s in rows],
        version=min((v for s in rows for v in s.versions), default=0),
        tokens=sum(sum(s.mask) for s in rows),
        seconds=seconds,
        rewards=[None if given[id(t)] is None else {role: float(given[id(t)][role])} for t, role in seats],
        stats=EpisodeStats(
            turns=[s.turns for s in rows],
            tool_calls=[t.tool_calls for t, _ in seats],
            tool_errors=[t.tool_errors for t, _ in seats],
            truncated=[t.truncated for t, _ in seats],
            success=[none_or_float(t.episode.success()) for t, _ in seats],
            turn_rewards=[t.turn_rewards.get(role, 0.0) for t, role in seats],
            turn_steps=[s.step_rewards for s in rows],
        ),
        transcripts=[s.transcript for s in rows],
        row_roles=[role for _, role in seats],
    )


def first_role(played: Played, prompts: int) -> Played:
    """The rows of the first role a policy plays, one per prompt, of one episode per prompt (an
    eval's: its answers read as a single policy's are)."""
    roles = len(played.texts) // prompts
    picked = [i * roles for i in range(prompts)]
    stats = played.stats

    def pick(values: list[Any]) -> list[Any]:
        return [values[i] for i in picked]

    def pick_some(values: list[Any] | None) -> list[Any] | None:
        return None if values is None else pick(values)

    return Played(
        prompt_ids=pick(played.prompt_ids),
        completions=pick(played.completions),
        masks=pick(played.masks),
        logprobs=pick(played.logprobs),
        texts=pick(played.texts),
        version=played.version,
        tokens=sum(sum(m) for m in pick(played.masks)),
        seconds=played.seconds,
        rewards=pick(played.rewards),
        stats=EpisodeStats(*(pick_some(getattr(stats, f)) for f in EpisodeStats.__dataclass_fields__)),
        transcripts=pick(played.transcripts),
        row_roles=pick(played.row_roles or []) or None,
    )
