"""The rollout executor of `hpref rl`: the Ray actor that turns the prompt stream into every policy's
typed rollouts, holding the buffers and the reward.

Every policy answers the same prompts at the same rollout id (`hpref.rl.rollout.prompts`), sampled
with a seed of (policy, rollout); a save keeps the rollouts prefetched ahead of the trainer, so a
resume trains on the data an uninterrupted run does. `staleness_decision` says whether buffered data
is still fresh enough for the trainer; a shared base's requests go to its engine together
(`hpref.rl.rollout.batching`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from hpref.data.prompts import Prompt
from hpref.errors import UserError
from hpref.recipe.rl import RLConfig
from hpref.rl.algorithms.registry import build_algorithm
from hpref.rl.policy import apply_env
from hpref.rl.protocols import SharedTurn
from hpref.rl.rollout.batching import RequestBatcher
from hpref.rl.rollout.episodes import Played
from hpref.rl.rollout.evaluation import answers_report
from hpref.rl.rollout.joint import first_role
from hpref.rl.rollout.pairing import JudgedPairs, judged_pairs
from hpref.rl.rollout.players import Players, engines_here
from hpref.rl.rollout.prompts import build_prompt_source, rollout_prompts, sample_seed
from hpref.rl.rollout.rewards import RewardSet, build_reward
from hpref.rl.rollout_types import Rollout, Verdict
from hpref.rl.staleness import staleness_decision
from hpref.runfolder.layout import EXECUTOR_STATE


class RolloutExecutor:
    """Prompts, per-policy groups of answers, rewards, and a bounded buffer per policy.

    `get(rollout_id, policy)` serves rollouts strictly in order per policy (each policy drains only
    its own buffer) and then prefetches the next ones up to `max_buffered`, so generation of rollout
    r + 1 overlaps training on r. The data position (each policy's next rollout id) is what `save`
    writes and `load` restores.
    """

    def __init__(
        self,
        config: RLConfig | dict[str, Any],
        policies: list[str],
        engines: dict[str, Any],
        env: dict[str, str] | None = None,
        prompts: Any = None,
        hosted: bool = False,
    ) -> None:
        apply_env(env)
        from hpref.recipe.rl import resolve_reward
        from hpref.recipe.rl_rewards import reward_parts

        self.config = config if isinstance(config, RLConfig) else RLConfig.model_validate(config)
        #: what the policies train on: `[rl.reward]`, or `[rl.rewards.<name>]`'s weighted sum
        self.reward = RewardSet.from_parts(reward_parts(self.config))
        #: the second scorer of evals, never trained against (`[rl.eval_scorer]`)
        self.scorer = None
        if self.config.eval_scorer is not None:
            if self.config.eval_scorer_config is None:
                self.config.eval_scorer_config = resolve_reward(self.config.eval_scorer, key="rl.eval_scorer")
            scorer = build_reward(self.config.eval_scorer.name, self.config.eval_scorer_config)
            self.scorer = RewardSet.single(scorer, "scorer")
        #: `[rl.prompts]`, built by the launcher (which checked the file) or here
        self.prompts = prompts if prompts is not None else build_prompt_source(self.config)
        # a reward's ground truth means something only for the prompts it was made for
        self.truth = self.reward.true_utility if self.prompts.ground_truth else None
        self.policies = list(policies)
        #: each policy's engine actor, or (`hosted`: rl.engines_in_executor) started here from its spec
        self.engines = engines = engines_here(engines, env) if hosted else engines
        #: each policy's algorithm: what its rollouts carry (judged pairs for online DPO)
        self.algorithms = {p: build_algorithm(p, self.config.policies[p]) for p in self.policies}
        if any(a.needs_preferences for a in self.algorithms.values()) and not self.reward.judges_pairs:
            raise UserError(
                f"{', '.join(self.reward.names)}: not every reward judges answer pairs (judge_answers)"
            )
        #: a shared base's one engine serves every policy's adapter, requests batched together
        self.batcher = (
            RequestBatcher(engines[self.policies[0]], self.config.engine_config.batch_rows)
            if self.config.share_base
            else None
        )
        #: how the policies' engines play the episodes (`[rl.environment]`), alone or together
        self.players = Players(self.config, self.policies, engines, self.prompts, self.batcher)
        # the rollouts whose episodes the seated policies played together, by rollout id
        self._joint: dict[int, asyncio.Future] = {}
        self.positions = {p: 0 for p in self.policies}
        #: every judged match of the rollouts taken so far (`_count_matches`): the live leaderboard's
        self.standings: dict[str, dict[str, list[float]]] = {}
        self._buffer: dict[str, dict[int, asyncio.Task]] = {p: {} for p in self.policies}
        # each policy's answers per rollout id, for judging the other policies against them
        self._answers: dict[tuple[str, int], list[list[str]]] = {}
        # each policy's starting checkpoint's greedy eval episodes
        self._start_answers: dict[str, Played] = {}

    async def engine_call(self, policy: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """The driver's and trainer groups' call of an engine built here (`HostedEngine`)."""
        return await getattr(self.engines[policy], method).remote(*args, **kwargs)

    async def _together(self, policy: str, rollout_id: int, fresh: bool) -> tuple[list[Prompt], Played]:
        """The policy's part of the rollout's episodes played together, played once for every seated
        policy (again when `fresh`: a stale part regenerates them), and the prompt of each group."""
        task = self._joint.get(rollout_id)
        prompts = rollout_prompts(self.prompts, self.config.rollout, rollout_id)
        if task is None or fresh:
            seed = sample_seed(self.config.rollout.seed, "+".join(sorted(self.policies)), rollout_id)
            task = asyncio.ensure_future(
                self.players.play_together(prompts, self.config.rollout.group_size, seed, False, self._judge)
            )
            self._joint[rollout_id] = task
            # each partner's part is buffered now, whoever's prefetch played it, so a save keeps it: a
            # part left out would be played again after a resume, at its partners' newer weights
            for q in set((self.players.seated or {}).values()) - {policy}:
                if rollout_id >= self.positions[q] and rollout_id not in self._buffer[q]:
                    self._buffer[q][rollout_id] = asyncio.ensure_future(self._produce(q, rollout_id))
        played = (await task)[policy]
        roles = sorted(set(played.row_roles or []), key=list(self.players.seated or {}).index)
        return [p for p in prompts for _ in roles], played

    async def _judge(
        self, prompts: list[Prompt], pairs: list[tuple[str, str]], rows: list[dict[str, Any]]
    ) -> list[Verdict]:
        """The run's rewards' verdicts on answer pairs (episodes judged in pairs: debate), off the
        event loop: a judge model's forward pass would block every policy's `get`."""
        given = rows if self.reward.wants_rows else None
        return await asyncio.to_thread(self.reward.judge_answers, prompts, pairs, given)

    def _wants_opponents(self, policy: str | None = None) -> bool:
        """Whether other policies' answers are wanted: by the reward (cross-policy judging), or by
        `policy`'s algorithm (cross-policy pairs); with no `policy`, by anyone."""
        if len(self.policies) < 2:
            return False
        reward_wants = self.reward.wants_opponents

        def wants(q: str) -> bool:
            algorithm = self.algorithms[q]
            # a pairwise algorithm judges its own pairs: the reward's cross-policy setting is not its
            return algorithm.cross_policy if algorithm.needs_preferences else reward_wants

        return any(wants(q) for q in ([policy] if policy is not None else self.policies))

    async def _opponents(
        self, policy: str, rollout_id: int, prompts: list[tuple[str, ...]]
    ) -> tuple[list[list[str]], list[list[str]], int]:
        """Other policies' answers to this rollout's prompts: (answers per prompt, the policy of each,
        tokens generated).

        Every policy answers the same prompts at the same rollout id, so an opponent that already
        produced this rollout lends its own answers (free); otherwise its engine samples
        `opponent_answers` per prompt now, seeded by (opponent, policy, rollout), at its current
        weights. Which of the two happens depends on how far each policy has got, so cross-policy
        rewards, unlike within-group ones, are not replayed bit for bit after a resume.
        """
        k = self.reward.opponent_answers
        per_prompt: list[list[str]] = [[] for _ in prompts]
        owners: list[list[str]] = [[] for _ in prompts]
        generated = 0
        for q in self.policies:
            if q == policy:
                continue
            cached = self._answers.get((q, rollout_id))
            if cached is None:
                seed = sample_seed(self.config.policy_rollout(q).seed, f"{q}>{policy}", rollout_id)
                out = await self.players.play(q, prompts, k, seed)
                generated += out.tokens
                cached = [out.texts[i * k : (i + 1) * k] for i in range(len(prompts))]
            for i, answers in enumerate(cached):
                per_prompt[i].extend(answers[:k])
                owners[i].extend([q] * len(answers[:k]))
        return per_prompt, owners, generated

    def _forget_answers(self) -> None:
        """Keep only answers of rollouts some policy may still produce (bounded memory)."""
        oldest = min(self.positions.values()) - 1
        for key in [key for key in self._answers if key[1] < oldest]:
            del self._answers[key]
        for r in [r for r in self._joint if r < oldest]:
            del self._joint[r]

    async def _produce(self, policy: str, rollout_id: int, fresh: bool = False) -> Rollout:
        rollout = self.config.policy_rollout(policy)
        g = group = rollout.group_size  # answers per prompt; rows per advantage group
        if self.players.seated is not None:  # the policies act together: groups per start and role
            prompts, out = await self._together(policy, rollout_id, fresh)
            shared = self.players.environment
            if isinstance(shared, SharedTurn) and self.players.seated[shared.shared_role] == policy:
                g, group = 1, len(prompts)  # a turn shared per start: a row per start, all one group
        else:
            prompts = rollout_prompts(self.prompts, rollout, rollout_id)
            seed = sample_seed(rollout.seed, policy, rollout_id)
            out = await self.players.play(policy, prompts, rollout.group_size, seed)
        groups = [out.texts[i * g : (i + 1) * g] for i in range(len(prompts))]
        algorithm = self.algorithms[policy]
        judged = JudgedPairs.none()
        opponents, owners, opponent_tokens = None, None, 0
        if self._wants_opponents():  # someone judges against this policy's answers: lend them
            self._answers[(policy, rollout_id)] = groups
        if self._wants_opponents(policy):
            opponents, owners, opponent_tokens = await self._opponents(policy, rollout_id, prompts)
        rows = self._rows(prompts)
        components = None
        # a judge model's forward pass would block the event loop that serves every policy's get()
        roles = out.row_roles or [self.players.roles.get(policy, "")] * len(out.rewards)
        given = [None if r is None else r[role] for r, role in zip(out.rewards, roles, strict=True)]
        if algorithm.needs_preferences:
            if any(r is not None for r in given):
                raise RuntimeError(
                    f"{algorithm.name} of '{policy}' judges answer pairs with the run's rewards, and the "
                    f"'{self.players.environment.name}' environment gives episodes rewards of its own"
                )
            rivals = opponents if algorithm.cross_policy else None
            judged = await asyncio.to_thread(judged_pairs, self.reward, prompts, groups, rivals, rows, owners)
            rewards = judged.rewards
        elif all(r is not None for r in given):  # the environment scored every episode itself
            rewards = [float(r) for r in given]  # type: ignore[arg-type]
        else:
            scores, parts = await asyncio.to_thread(
                self.reward.score_components, prompts, groups, opponents, rows
            )
            scored = [float(s) for group in scores for s in group]
            rewards = [scored[i] if r is None else float(r) for i, r in enumerate(given)]
            if self.reward.named:
                components = {name: [s for group in part for s in group] for name, part in parts.items()}
        if any(out.stats.turn_rewards):  # the environment's per-turn rewards, on top of either
            rewards = [r + t for r, t in zip(rewards, out.stats.turn_rewards, strict=True)]
        truth = self.truth
        return Rollout(
            prompt_ids=out.prompt_ids,
            completions=out.completions,
            logprobs=out.logprobs,
            texts=out.texts,
            version=out.version,
            tokens=out.tokens,
            seconds=out.seconds,
            masks=None if out.single_turn else out.masks,
            episodes=None if self.players.environment.name == "single-turn" else out.stats,
            rollout_id=rollout_id,
            policy=policy,
            group_size=group,
            temperature=rollout.temperature,
            opponent_tokens=opponent_tokens,
            rewards=rewards,
            true_utility=[truth(p, a) for p, group in zip(prompts, groups, strict=True) for a in group]
            if truth
            else None,
            reward_components=components,
            pairs=judged.pairs,
            verdicts=judged.verdicts,
            opponent_texts=judged.opponent_texts,
            matches=out.matches or judged.matches(policy, len(out.completions)),
        )

    def _rows(self, prompts: list[Prompt]) -> list[dict[str, Any]] | None:
        """The prompt file's row of each prompt, when a reward reads rows (`wants_rows`)."""
        if not self.reward.wants_rows and not (self.scorer is not None and self.scorer.wants_rows):
            return None
        return self.players.prompt_rows(prompts)

    def _prefetch(self, policy: str, after: int) -> None:
        """Start generating the rollouts after `after` that can still be fresh when trained on.

        Data generated now comes from weights at most one version newer than those of rollout
        `after`; the trainer accepts data `staleness_limit` versions behind, i.e. rollouts up to
        `staleness_limit x update_weights_interval` ahead. Prefetching further only makes data the
        staleness rule throws away (on a SmolLM2 policy with limit 1 and two rollouts buffered, every
        second rollout was generated twice, the second time while the trainer waited)."""
        buffer = self._buffer[policy]
        useful = self.config.staleness_limit * self.config.update_weights_interval
        for r in range(after + 1, after + 1 + min(self.config.rollout.max_buffered, useful)):
            if r not in buffer and r >= self.positions[policy]:  # not one it has taken already
                buffer[r] = asyncio.ensure_future(self._produce(policy, r))

    def _prefetch_together(self) -> None:
        """A shared base's prefetch: every policy's next rollouts at once, from the rollout all of
        them have taken (the slowest's position), so their requests reach the one engine in the
        same turn and go as one batch (`RequestBatcher`). A policy ahead of the others gets what it
        needs beyond that on demand, in `get`."""
        taken = min(self.positions.values()) - 1
        for q in self.policies:
            self._prefetch(q, taken)

    async def get(self, rollout_id: int, policy: str) -> Rollout:
        if policy not in self.positions:
            raise KeyError(f"rollout executor: unknown policy '{policy}'")
        if rollout_id != self.positions[policy]:
            raise RuntimeError(
                f"policy '{policy}' asked for rollout {rollout_id} but its next rollout is "
                f"{self.positions[policy]}: each policy drains its own buffer in order"
            )
        task = self._buffer[policy].pop(rollout_id, None)
        data = await task if task is not None else None
        engine_version = await self.players.version(policy)
        decision = staleness_decision(
            policy,
            rollout_id,
            None if data is None else data.version,
            engine_version,
            self.config.update_weights_interval,
            self.config.staleness_limit,
        )
        if decision == "regenerate":
            data = await self._produce(policy, rollout_id, fresh=True)
        assert data is not None
        data.stale_regenerated = task is not None and decision == "regenerate"
        data.standings = self._count_matches(data.matches)
        self.positions[policy] = rollout_id + 1
        self._buffer[policy].pop(rollout_id, None)  # a part a partner's replay buffered meanwhile
        self._forget_answers()
        if self.batcher is not None:
            self._prefetch_together()
        else:
            self._prefetch(policy, rollout_id)
        return data

    def _count_matches(self, matches: list[tuple[str, str, float]]) -> dict[str, dict[str, list[float]]]:
        """Add a taken rollout's matches to the run's standings (counted when taken, so a save and its
        resume count each once); a copy of them, for the live leaderboard."""
        for player, opponent, score in matches:
            games = self.standings.setdefault(player, {}).setdefault(opponent, [0.0, 0.0])
            games[0] += 1.0
            games[1] += float(score)
        return {p: {q: list(g) for q, g in row.items()} for p, row in self.standings.items()}

    async def settle(self, policy: str) -> None:
        """Wait for the rollouts in flight that `policy`'s engine answers (prefetched, or played
        together with it): an episode's later turns must come from the weights its first turn came
        from, so a weight push (or a colocated engine's sleep) waits for them (`Driver.step`). A
        failure among them is raised where the rollout is taken, not here."""
        flying = [t for t in self._buffer[policy].values() if not t.done()]
        flying += [t for t in self._joint.values() if not t.done()]
        if flying:
            await asyncio.gather(*flying, return_exceptions=True)

    def _drop_buffers(self) -> None:
        if self.batcher is not None:
            self.batcher.cancel()
        for buffer in self._buffer.values():
            for task in buffer.values():
                task.cancel()
            buffer.clear()

    def _eval_prompts(self) -> list[Prompt]:
        return self.prompts.eval_prompts(self.config.rollout.seed, self.config.rollout.eval_prompts)

    async def _greedy_answers(self, policies: list[str], prompts: list[Prompt]) -> dict[str, Played]:
        """Each policy's greedy episodes on `prompts` (single-turn: its greedy answers), with its
        repetition penalty and stop strings (`sampling_knobs`: its behaviour, as in its rollouts),
        all at once: separate engines answer in parallel, a shared one in one batch. Policies that act
        together play one episode per prompt, each reported in the first role it plays."""
        if self.players.seated is not None:
            together = await self.players.play_together(prompts, 1, 0, True, self._judge)
            return {p: first_role(together[p], len(prompts)) for p in policies}
        played = await asyncio.gather(*(self.players.play(p, prompts, 1, 0, greedy=True) for p in policies))
        return dict(zip(policies, played, strict=True))

    async def record_start(self, policies: list[str]) -> dict[str, Any]:
        """Greedy eval answers of each policy's starting checkpoint; returns their eval report.

        Called while every engine still serves the weights it was built with (version 0: the
        warm-up checkpoint, the policy's model folder, or its seeded init), before a resume pushes
        restored weights, so the `<id>@start` players of every eval are the true start.
        """
        prompts = self._eval_prompts()
        if not prompts:
            return {}
        for p in policies:
            version = await self.players.version(p)
            if version != 0:
                raise RuntimeError(f"record_start: engine '{p}' already serves version {version}, not 0")
        self._start_answers.update(await self._greedy_answers(policies, prompts))
        return await self._report(prompts, {}, policies)

    async def evaluate(self, policies: list[str]) -> dict[str, Any]:
        """Greedy answers of every policy (and of its start, `<id>@start`) to the held-out eval
        prompts, scored by the ground truth when the prompts have one, by the training reward, and by
        `[rl.eval_scorer]` when set (`hpref.rl.rollout.evaluation.answers_report` does the numbers
        and says what the report holds)."""
        prompts = self._eval_prompts()
        if not prompts:
            return {"true_utility": {}, "win_rate_vs_start": {}, "battles": [], "leaderboard_battles": []}
        return await self._report(prompts, await self._greedy_answers(policies, prompts), policies)

    async def _report(
        self, prompts: list[Prompt], played: dict[str, Played], policies: list[str]
    ) -> dict[str, Any]:
        for p in policies:
            if p in self._start_answers:
                played[f"{p}@start"] = self._start_answers[p]
        scorers = {"scorer": self.scorer, "reward": self.reward}
        episodes = self.players.environment.name != "single-turn"
        return await answers_report(
            scorers, self.truth, prompts, played, policies, self._rows(prompts), episodes
        )

    async def save(self, folder: str) -> None:
        """Write the data position and the rollouts prefetched past it (waiting for one in flight):
        made by weights older than the saved ones, regenerated they were other answers, and a
        resumed run trained on them was no longer the uninterrupted one (benchmarks/chaos_rl.py)."""
        from hpref.runfolder import integrity
        from hpref.runfolder.files import write_json_atomic

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        # first every rollout in flight: one played together buffers its partners' parts as it starts
        for task in [t for b in self._buffer.values() for t in b.values()]:
            await task
        ahead = {p: [(await t).to_json() for _r, t in sorted(b.items())] for p, b in self._buffer.items()}
        state = {"positions": self.positions, "buffered": ahead, "standings": self.standings}
        write_json_atomic(path / EXECUTOR_STATE, state, sort_keys=True)
        integrity.write_manifest(path)

    async def load(self, folder: str) -> dict[str, int]:
        """Restore the data position of the policies saved in `folder`; returns it."""
        path = Path(folder) / EXECUTOR_STATE
        self._drop_buffers()
        self._answers.clear()
        saved: dict[str, int] = {}
        ahead: list[Rollout] = []  # a save made before they were kept has none: regenerated then
        if path.is_file():
            from hpref.runfolder import integrity
            from hpref.runfolder.safe_load import CheckpointError

            integrity.require_verified(path.parent)
            try:
                state = json.loads(path.read_text(encoding="utf-8"))
                saved = {str(p): int(n) for p, n in state["positions"].items()}
                ahead = [Rollout.from_json(r) for rows in state.get("buffered", {}).values() for r in rows]
                standings = state.get("standings", {})  # a save made before they were kept: none
                self.standings = {
                    str(p): {str(q): [float(g[0]), float(g[1])] for q, g in row.items()}
                    for p, row in standings.items()
                }
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"{path}: damaged ({type(exc).__name__}: {exc})") from None
        for p in self.policies:
            self.positions[p] = int(saved.get(p, 0))
        for data in ahead:
            if data.policy in self._buffer and data.rollout_id >= self.positions[data.policy]:
                self._buffer[data.policy][data.rollout_id] = done = asyncio.get_running_loop().create_future()
                done.set_result(data)
        return {p: self.positions[p] for p in self.policies if p in saved}

    async def shutdown(self) -> None:
        self._drop_buffers()
