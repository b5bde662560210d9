"""How a run's policies play a rollout's episodes on their engines (`[rl.environment]`): alone, each
policy its own episodes (`hpref.rl.rollout.episodes`), or together, the policies seated in the
environment's roles (`hpref.rl.rollout.joint`); the requests each turn sends to an engine (or, on a
shared base, through the `RequestBatcher` with the policy's adapter), and what a policy's tokenizer
does for its episodes. The rollout executor asks it for episodes and keeps everything else (buffers,
rewards, evals, saves). Engines in the executor's own process (`rl.engines_in_executor`) are
started there from their specs (`engines_here`) and called as their actors would be."""

from __future__ import annotations

from typing import Any

from hpref.data.prompts import Prompt
from hpref.recipe.rl import RLConfig
from hpref.recipe.rl_sampling import sampling_knobs
from hpref.rl.environments.registry import build_environment, context_bound, policy_roles, seated_roles
from hpref.rl.rollout.batching import RequestBatcher
from hpref.rl.rollout.episodes import Bounds, Played, TurnCodec, play_episodes
from hpref.rl.rollout.joint import Judge, Seating, play_together
from hpref.rl.rollout_types import Generation, GenerationRequest


def engines_here(specs: dict[str, Any], env: dict[str, str] | None) -> dict[str, Any]:
    """Each policy's engine started in this process from its `hpref.rl.engines.host.EngineSpec`, once
    per hosting policy (a shared base's one engine serves every policy)."""
    started: dict[str, Any] = {}
    for spec in specs.values():
        if spec.policy not in started:
            started[spec.policy] = spec.start(env)
    return {p: started[spec.policy] for p, spec in specs.items()}


class Players:
    """The policies' side of a rollout: who plays which role, and their engines' turns."""

    def __init__(
        self,
        config: RLConfig,
        policies: list[str],
        engines: dict[str, Any],
        prompts: Any,
        batcher: RequestBatcher | None,
    ) -> None:
        self.config, self.policies, self.engines = config, list(policies), engines
        self.prompts, self.batcher = prompts, batcher
        #: where the episodes happen (`[rl.environment]`; `single-turn`: a prompt and one answer)
        self.environment = build_environment(config)
        #: role -> policy when the policies act together in its episodes, else None (each its own)
        self.seated = seated_roles(config, self.environment, self.policies, "recipe")
        #: policy -> the role it plays in its own episodes (empty when they act together)
        self.roles = {} if self.seated else policy_roles(config, self.environment, self.policies, "recipe")
        self._codecs = {p: TurnCodec(self._tokenizer_of(p)) for p in self.policies}

    async def generate(self, policy: str, *request: Any, **knobs: Any) -> Generation:
        """The policy's engine's `generate(prompts, group_size, max_new_tokens, temperature, top_k, seed[,
        greedy], **knobs on)`, or on a shared base its adapter's (a `GenerationRequest`), batched with
        the other policies'."""
        if self.batcher is None:
            return await self.engines[policy].generate.remote(*request, **knobs)
        return await self.batcher.generate(GenerationRequest(*request, adapter=policy, **knobs))

    def _tokenizer_of(self, policy: str) -> Any:
        def load() -> Any:
            from hpref.models.causal_lm import policy_tokenizer

            return policy_tokenizer(self.config.policies[policy].model)

        return load

    async def play(
        self, policy: str, prompts: list[Prompt], answers: int, seed: int, greedy: bool = False
    ) -> Played:
        """`answers` episodes per prompt played by the policy's engine with its rollout settings
        (`greedy`: the evals' answers); the first turn is the one request a single answer is."""
        rollout = self.config.policy_rollout(policy)
        knobs = sampling_knobs(rollout, greedy=greedy)
        if greedy:
            settings: tuple[Any, ...] = (rollout.max_new_tokens, 1.0, 0, 0, True)
        else:
            settings = (rollout.max_new_tokens, rollout.temperature, rollout.top_k, seed)

        async def first_turn() -> Generation:
            return await self.generate(policy, prompts, answers, *settings, **knobs)

        async def next_turn(live: list[Prompt], contexts: list[list[int]], turn_seed: int) -> Generation:
            return await self._continue(policy, live, contexts, turn_seed, greedy)

        bounds = self._bounds(policy, self.roles[policy])
        rows = self.prompt_rows(prompts)
        codec = self._codecs[policy]
        return await play_episodes(
            self.environment, codec, first_turn, next_turn, prompts, rows, answers, seed, bounds
        )

    def _bounds(self, policy: str, role: str) -> Bounds:
        section, rollout = self.config.environment, self.config.policy_rollout(policy)
        context = context_bound(self.config, policy)
        return Bounds(role, section.max_turns, context, rollout.max_new_tokens)

    async def _continue(
        self, policy: str, prompts: list[Prompt], contexts: list[list[int]], seed: int, greedy: bool
    ) -> Generation:
        """One answer per token context, sampled by the policy's engine with its rollout settings."""
        rollout = self.config.policy_rollout(policy)
        knobs = sampling_knobs(rollout, greedy=greedy)
        temperature, top_k = (1.0, 0) if greedy else (rollout.temperature, rollout.top_k)
        adapter = policy if self.batcher is not None else None
        sampled = (rollout.max_new_tokens, temperature, top_k, seed, greedy)
        request = GenerationRequest(prompts, 1, *sampled, adapter=adapter, contexts=contexts, **knobs)
        if self.batcher is not None:
            return await self.batcher.generate(request)
        return (await self.engines[policy].generate_batch.remote([request]))[0]

    async def play_together(
        self, prompts: list[Prompt], group: int, seed: int, greedy: bool, judge: Judge | None = None
    ) -> dict[str, Played]:
        """`group` episodes per prompt in which the seated policies act together (`rollout.joint`);
        `judge`: the run's pair judge, for episodes judged in pairs (debate)."""
        assert self.seated is not None
        seating = Seating(self.seated, self._codecs, {p: self._bounds(p, "") for p in self.policies})

        async def sample(
            policy: str, live: list[Prompt], contexts: list[list[int]], turn_seed: int
        ) -> Generation:
            return await self._continue(policy, live, contexts, turn_seed, greedy)

        rows = self.prompt_rows(prompts)
        return await play_together(self.environment, seating, sample, prompts, rows, group, seed, judge)

    async def version(self, policy: str) -> int:
        """The weight version the policy's engine (or adapter) serves."""
        if self.batcher is None:
            return await self.engines[policy].get_version.remote()
        return await self.engines[policy].get_version.remote(adapter=policy)

    def prompt_rows(self, prompts: list[Prompt]) -> list[dict[str, Any]]:
        """The prompt file's row of each prompt ({} from a source without rows: `PromptSource.row`)."""
        row = getattr(self.prompts, "row", None)
        return [row(p) if row is not None else {} for p in prompts]
