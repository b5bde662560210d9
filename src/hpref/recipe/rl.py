"""The `[rl]` section of a recipe (`hpref rl`): typed, like every other section.

    [rl]
    num_rollouts = 40            # rollouts the leader runs; followers run until it ends
    save_interval = 10           # global save every N leader rollouts (0 = only at the end)
    eval_interval = 10           # park everyone and evaluate every N leader rollouts (0 = never)
    update_weights_interval = 1  # push trainer weights to the engine every N rollouts per policy
    staleness_limit = 1          # most weight versions a rollout's engine may lag its trainer
    keep_last = 2                # keep the newest N global saves (0 = all; the recorded one stays)

    [rl.warmup]                  # optional: policies start from a supervised warm-up on the arena's
    steps = 300                  # answers (tiny ones) or `path` = your own (hpref.recipe.rl_warmup)

    [rl.engine]                  # a registered inference engine (`register_engines`) and its
    name = "transformers"        # parameters; plugins can add vLLM/SGLang engines

    [rl.prompts]                 # a registered prompt source (`register_prompts`) and its parameters:
    name = "pairwise"            # synthetic (default), arithmetic, pairwise, arena, file (builtin.prompts)
    path = "hh-rlhf.jsonl.gz"

    [rl.rollout]                 # shared by every policy
    group_size = 4
    prompts_per_rollout = 8
    max_new_tokens = 24
    temperature = 1.0

    [rl.reward]                  # a registered reward component and its parameters
    name = "rule"                # or "judge" with path = an `hpref save` export

    # or several rewards, each with a weight (instead of [rl.reward]): the sum trains the policies,
    # each is also logged on its own (reward_<name>_mean, eval_reward_<name>)
    [rl.rewards.quality]
    name = "judge"
    path = "runs/minilm-reward-export"
    [rl.rewards.format]
    name = "rule"
    function = "my_rewards:format_reward"   # (prompt, answer) or (prompt, answer, row)
    weight = 0.2

    [rl.defaults]                # settings every policy starts from ...
    lr = 1e-4
    [rl.policies.a]              # ... and each policy's own table, over the defaults
    model = { seed = 1 }
    [rl.policies.b]
    algorithm = { name = "grpo", kl_coef = 0.05 }   # the algorithm and its settings (default: grpo)
    rollout = { temperature = 0.7 }   # only the keys in POLICY_ROLLOUT_OVERRIDES
    lora = { r = 8 }             # LoRA: only this policy's adapter trains (hpref.recipe.LoraSection)
    [rl.policies.c]
    trainer_backend = "megatron" # the trainer on megatron-core (hpref.models.megatron.causal_lm)

The recipe's top-level `[lora]` section gives every policy adapters: it is read as if written in
`[rl.defaults.lora]`, below it (`rl.defaults.lora` and `rl.policies.<id>.lora` change its keys). A
policy without a `lora` table, with no `[lora]` either, trains all its weights.

`--policies a,b` picks which run; the first is the leader. `parse_rl_section` validates all of it
and raises `RecipeError` with one line naming the dotted key.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)

from hpref.errors import RecipeError, UserError, did_you_mean
from hpref.recipe.rl_components import (
    EngineSection,
    EnvironmentSection,
    PromptsSection,
    RewardSection,
    WeightedRewardSection,
    check_reward_sections,
    resolve_algorithm,
    resolve_engine,
    resolve_environment,
    resolve_prompts,
    resolve_reward,
)

# the policies' tables live in `rl_policy`; importers reach them here, with the rest of `[rl]`
from hpref.recipe.rl_policy import POLICY_ROLLOUT_OVERRIDES as POLICY_ROLLOUT_OVERRIDES
from hpref.recipe.rl_policy import PolicyConfig, Section, refuse_grpo_keys
from hpref.recipe.rl_policy import PolicyLoraSection as PolicyLoraSection
from hpref.recipe.rl_policy import PolicyModelConfig as PolicyModelConfig
from hpref.recipe.rl_policy import PolicyRolloutOverrides as PolicyRolloutOverrides
from hpref.recipe.rl_sampling import MinP, RepetitionPenalty, StopStrings, TopP, check_engine_knobs
from hpref.recipe.rl_warmup import WarmupConfig
from hpref.recipe.schema import LoraSection, describe_error

POLICY_ID = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


class RolloutConfig(Section):
    group_size: int = Field(4, ge=2, description="answers per prompt (GRPO compares within a group)")
    prompts_per_rollout: int = Field(8, ge=1, description="prompts every policy answers per rollout")
    max_new_tokens: int = Field(24, ge=1, description="longest answer, in tokens")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_k: int = Field(0, ge=0, description="top-k sampling (0 = off)")
    top_p: TopP = 1.0  # these four: hpref.recipe.rl_sampling
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: StopStrings = []
    seed: int = Field(0, description="seed of the prompt stream's order and of sampling")
    max_buffered: int = Field(
        2,
        ge=1,
        description="rollouts generated ahead per policy (bounded buffer); never more than staleness_limit x "
        "update_weights_interval, beyond which the data would be too stale to train on",
    )
    eval_prompts: int = Field(32, ge=0, description="fixed prompts each eval answers greedily")


class ScheduleConfig(Section):
    """`[rl.schedule]`: the policies with `train = true` take turns to learn."""

    alternate: int = Field(
        ge=1,
        description="rollouts each learning policy learns in its turn, in the recipe's order of the policies",
    )

    def learns(self, policy: str, learning: list[str], rollout_id: int) -> bool:
        """Whether `policy` (one of `learning`, in turn order) learns from its rollout `rollout_id`."""
        return learning[(rollout_id // self.alternate) % len(learning)] == policy


class RLConfig(Section):
    policies: dict[str, PolicyConfig] = Field(description="the policies, by id")
    num_rollouts: int = Field(20, ge=1, description="rollouts the leader runs")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="shared rollout settings")
    prompts: PromptsSection = Field(default_factory=lambda: PromptsSection(), description="the prompt source")
    reward: RewardSection = Field(default_factory=RewardSection, description="the reward component")
    rewards: dict[str, WeightedRewardSection] | None = Field(
        None,
        description="several reward components by name, each with a weight, instead of [rl.reward]: an "
        "answer's reward is the weighted sum, and each component is logged on its own",
    )
    eval_scorer: RewardSection | None = Field(
        None,
        description="a second reward component that scores every eval's answers and is never trained "
        "against (e.g. another exported reward model): reward hacking shows as `reward` rising without it",
    )
    engine: EngineSection = Field(default_factory=lambda: EngineSection(), description="the inference engine")
    schedule: ScheduleConfig | None = Field(
        None,
        description="which policies learn when: alternate = N gives the learning policies turns of N "
        "rollouts each, the others acting frozen meanwhile (agent by agent, as MARFT trains)",
    )
    environment: EnvironmentSection = Field(
        default_factory=lambda: EnvironmentSection(),
        description="where episodes happen: single-turn (a prompt, one answer: the default), tool (the "
        "policy calls tools over several turns) or a plugin's",
    )
    warmup: WarmupConfig | None = Field(
        None,
        description="supervised warm-up, the policies' starting checkpoint: tiny ones on the synthetic "
        "arena's answers, or every policy on path = your own answers",
    )
    keep_last: int = Field(
        0, ge=0, description="keep the newest N global saves (0 = all); the recorded one is never deleted"
    )
    save_interval: int = Field(
        0, ge=0, description="global save every N leader rollouts (0 = only at the end)"
    )
    eval_interval: int = Field(0, ge=0, description="evaluate every N leader rollouts (0 = never)")
    update_weights_interval: int = Field(1, ge=1, description="push weights to the engine every N rollouts")
    staleness_limit: int = Field(1, ge=0, description="most weight versions a rollout's engine may lag")
    time_limit_s: float | None = Field(
        None,
        gt=0,
        description="the leader ends (final eval and save) after the rollout at which the policies' "
        "loops have run this many seconds, if num_rollouts has not ended it first",
    )
    park_timeout: float = Field(600.0, gt=0, description="seconds the leader waits for followers to park")
    stop_timeout_s: float = Field(
        300.0,
        gt=0,
        description="on SIGTERM or Ctrl-C the leader's rollout in flight finishes and a global save is "
        "written within this many seconds, else the run stops at once without it (keep it under your "
        "scheduler's grace period; hpref.rl.control.stop)",
    )
    weight_sync_bucket_mb: float = Field(
        256.0,
        gt=0,
        description="a weight sync streams the trainer's weights to the engine in buckets of about this "
        "many MiB (in the engine's dtype), so a sync's extra memory is bounded by a bucket, not the model",
    )
    share_base: bool | None = Field(
        None,
        description="LoRA policies of one base share one engine and one trainer group: the base held once, "
        "each policy its adapter, optimizer and settings, the engine batching every policy's prompts "
        "(default: on when there are several policies, all LoRA adapters of the same base, and their "
        "engines run on a GPU; off for CPU engines, where one shared engine measured 1.64x the wall time "
        "of two apart; `hpref rl --plan` and rl.json say what was decided and why; "
        "hpref.rl.placement.shared_base)",
    )
    engines_in_executor: bool | None = Field(
        None,
        description="each policy's engine runs inside the rollout executor's process, in a thread of its "
        "own, instead of in a Ray actor process of its own: one process fewer per policy (default: on for "
        "engines that can be hosted there, the transformers engine, when they run on CPU; off for GPU "
        "engines and vLLM; set false to spread CPU engines over a multi-node cluster; "
        "hpref.rl.placement.engine_process)",
    )
    executor_in_driver: bool | None = Field(
        None,
        description="the rollout executor (prompts, rewards, buffers, and the engines it hosts) runs in the "
        "`hpref rl` process itself instead of a Ray actor process of its own: one process fewer per run "
        "(default: on when the engines are in the executor, i.e. CPU transformers engines; off otherwise; "
        "hpref.rl.placement.engine_process)",
    )
    colocate: bool = Field(
        False,
        description="each policy's engine shares its trainer rank 0's GPU (engines that can sleep release "
        "their memory while the trainer steps); off: engines and trainers get devices of their own",
    )
    debug_exit_after_rollout: int | None = Field(
        None, ge=1, description="tests: save and stop after this leader rollout, as if interrupted"
    )

    # resolved by parse_rl_section; not part of the recipe text
    prompts_config: Any = Field(None, exclude=True, description="(internal) the validated prompts config")
    reward_config: Any = Field(None, exclude=True, description="(internal) the validated reward config")
    rewards_config: Any = Field(None, exclude=True, description="(internal) the validated rewards' configs")
    eval_scorer_config: Any = Field(None, exclude=True, description="(internal) the validated scorer config")
    engine_config: Any = Field(None, exclude=True, description="(internal) the validated engine config")
    environment_config: Any = Field(
        None, exclude=True, description="(internal) the validated environment config"
    )
    share_base_reason: str | None = Field(
        None,
        exclude=True,
        description="(internal) why share_base is what it is (hpref.rl.placement.shared_base)",
    )
    engines_in_executor_reason: str | None = Field(
        None,
        exclude=True,
        description="(internal) why engines_in_executor is what it is (hpref.rl.placement.engine_process)",
    )
    executor_in_driver_reason: str | None = Field(
        None,
        exclude=True,
        description="(internal) why executor_in_driver is what it is (hpref.rl.placement.engine_process)",
    )

    @model_validator(mode="after")
    def _combinations(self) -> RLConfig:
        if self.debug_exit_after_rollout is not None and self.debug_exit_after_rollout > self.num_rollouts:
            raise ValueError(
                f"debug_exit_after_rollout ({self.debug_exit_after_rollout}) is after the last rollout "
                f"({self.num_rollouts}), so it would never fire"
            )
        if self.eval_interval and self.rollout.eval_prompts == 0:
            raise ValueError("eval_interval > 0 needs rollout.eval_prompts > 0")
        return self

    @model_serializer(mode="wrap")
    def _one_reward_table(self, handler: Any) -> dict[str, Any]:
        # `reward` always has its default; beside `rewards` it would make the resolved recipe (the
        # run folder's recipe.toml, rl.json) one that is refused when read back
        data = handler(self)
        if self.rewards is not None and isinstance(data, dict):
            data.pop("reward", None)
        return data

    def policy_rollout(self, policy: str) -> RolloutConfig:
        """The shared rollout settings with this policy's whitelisted overrides applied."""
        own = self.policies[policy].rollout.model_dump(exclude_none=True)
        return self.rollout.model_copy(update=own)

    def learns(self, policy: str, rollout_id: int, order: list[str]) -> bool:
        """Whether `policy` learns from its rollout `rollout_id` in a run of `order`: never with
        `train = false`; with `[rl.schedule]`, in its turn among the run's learning policies."""
        if not self.policies[policy].train:
            return False
        if self.schedule is None:
            return True
        learning = [p for p in order if self.policies[p].train]
        return self.schedule.learns(policy, learning, rollout_id)

    def select(self, policies: list[str]) -> list[str]:
        """Check `--policies` against the declared ids; returns them in order (leader first)."""
        if not policies:
            raise UserError("--policies needs at least one policy id (the first is the leader)")
        seen: set[str] = set()
        for p in policies:
            if p in seen:
                raise UserError(f"--policies names '{p}' twice")
            seen.add(p)
            if p not in self.policies:
                raise UserError(
                    f"--policies: no policy '{p}' in [rl.policies]{did_you_mean(p, self.policies)}; "
                    f"declared: {', '.join(sorted(self.policies))}"
                )
        return list(policies)


# --------------------------------------------------------------------------------------------------
# parsing


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, tables merged key by key (so a policy can change one model key)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _describe(exc: ValidationError, model: type[BaseModel], prefix: str) -> str:
    """`hpref.recipe.schema.describe_error` for a table under the dotted `prefix`."""
    return describe_error(exc, model, tuple(prefix.split(".")), plain_value_errors=True)


def parse_rl_section(
    data: dict[str, Any] | None,
    where: str = "recipe",
    *,
    lora: LoraSection | dict[str, Any] | None = None,
    resolve: bool = True,
) -> RLConfig:
    """Validate the `[rl]` table (policy tables merged over `[rl.defaults]`) and, with `resolve`, its
    reward and engine components against the plugin registry (`resolve_rl_components`).

    `lora`: the recipe's top-level `[lora]` section, every policy's default adapter settings (as if
    it were `[rl.defaults.lora]`, under that table). Every error is a `RecipeError` of one line:
    `<where>: rl.<dotted key>: <what is wrong>`.
    """
    if not data:
        raise RecipeError(f"{where}: rl: hpref rl needs an [rl] section with at least one [rl.policies.<id>]")
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: rl: expected a table")
    data = dict(data)
    defaults = data.pop("defaults", {}) or {}
    if not isinstance(defaults, dict):
        raise RecipeError(f"{where}: rl.defaults: expected a table")
    refuse_grpo_keys(defaults, "rl.defaults", where)
    if lora is not None:
        if isinstance(lora, LoraSection):  # only the keys the recipe set, so a policy's table can add
            lora = lora.model_dump(mode="json", exclude_unset=True)
        defaults = _merge({"lora": dict(lora)}, defaults)
    try:
        PolicyConfig.model_validate(defaults)
    except ValidationError as exc:
        raise RecipeError(f"{where}: {_describe(exc, PolicyConfig, 'rl.defaults')}") from None
    policies_raw = data.get("policies")
    if not isinstance(policies_raw, dict) or not policies_raw:
        raise RecipeError(f"{where}: rl.policies: declare at least one policy as [rl.policies.<id>]")
    policies: dict[str, PolicyConfig] = {}
    for pid, table in policies_raw.items():
        if not POLICY_ID.match(pid):
            raise RecipeError(
                f"{where}: rl.policies.{pid}: a policy id is 1-32 lowercase letters, digits, '-' or '_', "
                "starting with a letter"
            )
        if not isinstance(table, dict):
            raise RecipeError(f"{where}: rl.policies.{pid}: expected a table")
        refuse_grpo_keys(table, f"rl.policies.{pid}", where)
        try:
            policies[pid] = PolicyConfig.model_validate(_merge(defaults, table))
        except ValidationError as exc:
            raise RecipeError(f"{where}: {_describe(exc, PolicyConfig, f'rl.policies.{pid}')}") from None
    data["policies"] = policies
    check_reward_sections(data, where)
    for internal, public in (
        ("reward_config", "reward"),
        ("rewards_config", "rewards"),
        ("engine_config", "engine"),
        ("environment_config", "environment"),
        ("prompts_config", "prompts"),
        ("eval_scorer_config", "eval_scorer"),
        ("share_base_reason", "share_base"),
        ("engines_in_executor_reason", "engines_in_executor"),
        ("executor_in_driver_reason", "executor_in_driver"),
    ):
        if internal in data:
            raise RecipeError(f"{where}: rl.{internal}: unknown key (did you mean '{public}'?)")
    try:
        config = RLConfig.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"{where}: {_describe(exc, RLConfig, 'rl')}") from None
    if resolve:
        resolve_rl_components(config, where)
    return config


def resolve_rl_components(config: RLConfig, where: str = "recipe") -> None:
    """Validate the prompts, reward, engine and each policy's algorithm parameters against their
    registered components (in place), and each policy's trainer backend's name."""
    from hpref.plugins import load_plugins

    registry = load_plugins()
    for policy, settings in config.policies.items():
        resolve_algorithm(settings.algorithm, policy, where)
        try:
            registry.get("trainer_backend", settings.trainer_backend)
        except UserError as exc:
            raise RecipeError(f"{where}: rl.policies.{policy}.trainer_backend: {exc}") from None
    config.prompts_config = resolve_prompts(config.prompts, where)
    if config.rewards is None:
        config.reward_config = resolve_reward(config.reward, where)
    else:
        config.rewards_config = {
            name: resolve_reward(section, where, key=f"rl.rewards.{name}")
            for name, section in config.rewards.items()
        }
    if config.eval_scorer is not None:
        config.eval_scorer_config = resolve_reward(config.eval_scorer, where, key="rl.eval_scorer")
    config.engine_config = resolve_engine(config.engine, where)
    config.environment_config = resolve_environment(config.environment, where)
    check_engine_knobs(config, where)
