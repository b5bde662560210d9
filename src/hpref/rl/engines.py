"""Built-in inference engines of `hpref rl`, registered through the `register_engines` hook.

An engine component's `build(config, *, policy, model, env)` returns an object with the engine
methods the rollout executor and the driver call (see `hpref.hookspecs.register_engines`). The
built-in `transformers` engine is `EngineActor`: `model.generate` on CPU (or on whatever device
torch defaults to), weights swapped in begin/load/commit steps. vLLM or SGLang engines can come
from plugins the same way, chosen by `[rl.engine] name = "..."`; `EngineHost` is the Ray actor
around whichever engine the recipe names. The methods every engine has are the `Engine` protocol
(`hpref.rl.protocols`).

This module is loaded by `hpref --help` (it is a built-in plugin): torch is imported inside build.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hpref.hookspecs import hookimpl
from hpref.recipe.rl import PolicyModelConfig
from hpref.rl.policy import (
    apply_env,
    build_policy_model,
    cache_keyword,
    encode_prompt,
    left_padded,
    stop_token_ids,
    trim_completion,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TransformersEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threads: int = Field(1, ge=1, description="torch threads of each engine actor")
    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs each engine actor reserves")
    share_prefill: bool = Field(
        True,
        description="run each prompt through the model once and share its KV cache across the group's "
        "answers (a group of G answers pays one prompt forward, not G)",
    )
    prefill_precision: Literal["auto", "fp32", "bf16"] = Field(
        "fp32",
        description="compute dtype of the shared prompt forward (bf16 = autocast; answers are decoded in "
        "fp32 either way). fp32 by default: with the prompt shared, bf16 saved ~10% of a SmolLM2 "
        "rollout here and moved greedy log-probs by up to 0.035; auto = bf16 on a bf16 CPU",
    )


def build_transformers(
    config: TransformersEngineConfig, *, policy: str, model: PolicyModelConfig, env: Any = None
) -> EngineActor:
    """transformers `generate` on CPU, with versioned weights (begin/load/commit updates)."""
    return EngineActor(
        policy,
        model,
        threads=config.threads,
        env=env,
        share_prefill=config.share_prefill,
        prefill_precision=config.prefill_precision,
    )


@hookimpl
def register_engines(register):
    register(name="transformers", config=TransformersEngineConfig, build=build_transformers)


# --------------------------------------------------------------------------------------------------
# engine


def generation_result(
    tokenizer: PreTrainedTokenizerBase,
    rows: list[list[int]],
    completions: list[list[int]],
    logprobs: list[list[float]],
    version: int,
    started: float,
) -> dict[str, Any]:
    """What every engine's `generate` returns (`hpref.rl.protocols.Engine`); texts are decoded by the
    policy's own tokenizer, so every engine gives the reward the same text for the same tokens."""
    return {
        "prompt_ids": rows,
        "completions": completions,
        "logprobs": logprobs,
        "texts": [tokenizer.decode(c, skip_special_tokens=True) for c in completions],
        "version": version,
        "tokens": sum(len(c) for c in completions),
        "seconds": time.perf_counter() - started,
    }


class VersionedWeights:
    """The weight-update steps every engine shares (the `Engine` protocol's second half).

    Three steps so a failed transfer never leaves half-loaded weights serving: `begin_update(version)`
    opens a staging area, `load_weights(state)` fills it (in parts, if the sender splits it),
    `commit_update()` checks it is whole (`check_state`) and hands it to the engine's `_swap_in`
    (or `abort_update()` drops it). An engine sets `policy`, `shapes` (every weight name of its
    model with its shape) and `version = 0`, and implements `_swap_in(state)`, which must leave the
    old weights serving when it raises.
    """

    policy: str
    version: int
    shapes: dict[str, tuple[int, ...]]
    #: the torch dtype name of the engine's weights: a sync sends them in it (half the bytes of fp32
    #: for a bf16 engine, and nothing for the engine to cast)
    dtype: str = "float32"
    _staging: tuple[int, dict[str, Any]] | None = None

    def weight_dtype(self) -> str:
        return self.dtype

    #: where the engine takes a sync's bytes: "cuda" for an engine on a GPU (NCCL from a GPU
    #: trainer), else "cpu" (gloo)
    channel_device: str = "cpu"
    _channel: Any = None

    def weight_channel_device(self) -> str:
        return self.channel_device

    def connect_weight_channel(self, host: str, port: int, device: str) -> None:
        """Join the trainer's weight channel as its rank 1 (`hpref.rl.weight_channel`)."""
        import torch

        from hpref.rl.weight_channel import connect

        where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self._channel = connect(None, host, port, 1, where)

    def receive_weights(self, layout: list[tuple[str, tuple[int, ...]]]) -> None:
        """One bucket of a sync from the channel, staged like `load_weights`'s part."""
        import torch

        if self._channel is None:
            raise RuntimeError(f"engine '{self.policy}': receive_weights before connect_weight_channel")
        self.load_weights(self._channel.receive(layout, getattr(torch, self.dtype)))

    def sleep(self) -> None:
        """Free what the engine holds on its device while its colocated trainer steps (`rl.colocate`);
        an engine with nothing to free (on the CPU) keeps it. `wake` brings it back."""
        return None

    def wake(self) -> None:
        return None

    def begin_update(self, version: int) -> None:
        if version < self.version:
            raise ValueError(
                f"engine '{self.policy}': version {version} is older than the live {self.version}"
            )
        self._staging = (version, {})

    def load_weights(self, state: dict[str, Any]) -> None:
        if self._staging is None:
            raise RuntimeError(f"engine '{self.policy}': load_weights without begin_update")
        self._staging[1].update(state)

    def commit_update(self) -> int:
        if self._staging is None:
            raise RuntimeError(f"engine '{self.policy}': commit_update without begin_update")
        version, state = self._staging
        self._staging = None
        # before the first copy: torch's strict load_state_dict copies every matching tensor and
        # only then raises for a missing or misshapen one, which left a part of the new weights
        # serving under the old version
        self.check_state(state)
        self._swap_in(state)
        self.version = version
        return version

    def check_state(self, state: dict[str, Any]) -> None:
        """Every weight name of the model, each with its shape, and nothing else; else a refusal
        that names what differs and the version that keeps serving."""
        missing = sorted(set(self.shapes) - set(state))
        unknown = sorted(set(state) - set(self.shapes))
        wrong = sorted(n for n in set(state) & set(self.shapes) if tuple(state[n].shape) != self.shapes[n])
        if missing or unknown or wrong:
            parts = [
                f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}"
                for what, names in (("missing", missing), ("unknown", unknown), ("wrong shape", wrong))
                if names
            ]
            raise ValueError(
                f"engine '{self.policy}': weight update refused ({'; '.join(parts)}); "
                f"version {self.version} keeps serving"
            )

    def abort_update(self) -> None:
        self._staging = None

    def get_version(self) -> int:
        return self.version

    def _swap_in(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class EngineActor(VersionedWeights):
    """Generation for one policy (transformers on CPU), with versioned weights (`VersionedWeights`)."""

    def __init__(
        self,
        policy: str,
        model: PolicyModelConfig,
        threads: int = 1,
        env: dict[str, str] | None = None,
        share_prefill: bool = True,
        prefill_precision: str = "fp32",
    ) -> None:
        apply_env(env)
        import torch

        from hpref.models.precision import resolve_precision

        torch.set_num_threads(threads)
        self.policy = policy
        self.model, self.tokenizer = build_policy_model(model)
        self.model.eval()
        self.share_prefill = share_prefill
        hidden = getattr(self.model.config, "hidden_size", None)
        self.prefill_dtype = resolve_precision(prefill_precision, torch.device("cpu"), hidden)
        self.stop_ids = stop_token_ids(self.tokenizer, self.model)
        self.shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self.dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.version = 0

    def prompt_ids(self, prompts: list[tuple[str, ...]]) -> list[list[int]]:
        return [encode_prompt(self.tokenizer, p) for p in prompts]

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
        import torch

        start = time.perf_counter()
        prompt_ids = self.prompt_ids(prompts)
        rows = [ids for ids in prompt_ids for _ in range(group_size)]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        input_ids, attention = left_padded(prompt_ids, width, pad)
        cache = self._prefill(input_ids, attention, group_size) if self.share_prefill and width > 1 else None
        input_ids = input_ids.repeat_interleave(group_size, dim=0)
        attention = attention.repeat_interleave(group_size, dim=0)
        torch.manual_seed(seed)
        sampling: dict[str, Any] = (
            {"do_sample": False}
            if greedy
            else {"do_sample": True, "temperature": temperature, "top_k": top_k or None, "top_p": 1.0}
        )
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                **({cache_keyword(self.model): cache} if cache is not None else {}),
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                eos_token_id=self.stop_ids,
                output_logits=True,
                return_dict_in_generate=True,
                **sampling,
            )
        new = out.sequences[:, width:]
        scale = 1.0 if greedy else temperature
        # step by step: stacking every step's [rows, vocab] logits first (and their log-softmax)
        # held two more copies of ~0.4 GB for 32 rows x 64 tokens of SmolLM2's 49k vocabulary
        logp = torch.stack(
            [
                torch.log_softmax(step.float() / scale, dim=-1).gather(-1, new[:, t : t + 1]).squeeze(-1)
                for t, step in enumerate(out.logits[: new.shape[1]])
            ],
            dim=1,
        )
        completions, logprobs = [], []
        for i in range(len(rows)):
            tokens = trim_completion(new[i].tolist(), self.stop_ids, pad)
            completions.append(tokens)
            logprobs.append(logp[i, : len(tokens)].tolist())
        return generation_result(self.tokenizer, rows, completions, logprobs, self.version, start)

    def _prefill(self, input_ids: Any, attention: Any, group_size: int) -> Any:
        """The KV cache of every prompt but its last token, computed once per prompt and repeated for
        the group's answers; `generate` then starts from the last prompt token. The prompt forward is
        most of a short answer's cost (measured on SmolLM2-135M, 16 rows x 170 prompt tokens, 32 new
        tokens, 1 thread: 15.8 s without sharing, 8.9 s with it), and bf16 halves it again on a bf16
        CPU; the last prompt token and the answer run in fp32, so the sampling distribution and the
        log-probs the trainer compares with are fp32 computations over the shared cache."""
        import torch

        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
        bf16 = self.prefill_dtype == torch.bfloat16
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = self.model(
                input_ids=input_ids[:, :-1],
                attention_mask=attention[:, :-1],
                position_ids=positions[:, :-1],
                use_cache=True,
            )
        cache = out.past_key_values
        if bf16:  # the cache's tensors are bf16; the fp32 decode that extends it expects its own dtype
            for layer in getattr(cache, "layers", []):
                layer.keys, layer.values = layer.keys.float(), layer.values.float()
        cache.batch_repeat_interleave(group_size)
        return cache

    def _swap_in(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state, strict=True)  # whole: `commit_update` checked every name


class EngineHost:
    """The Ray actor around a registered engine component (`[rl.engine] name = ...`).

    Ray needs the actor's methods on its class, so this class names every engine method and
    forwards it; the component itself is built inside the actor's process by its plugin's `build`.
    """

    def __init__(
        self,
        name: str,
        config: Any,
        policy: str,
        model: PolicyModelConfig,
        env: dict[str, str] | None = None,
    ) -> None:
        apply_env(env)
        from hpref.plugins import load_plugins

        component = load_plugins().get("engine", name)
        if not isinstance(config, component.config):
            config = component.config.model_validate(config or {})
        self.engine = component.build(config, policy=policy, model=model, env=env)
        # A colocated engine (`rl.colocate`) sleeps while its trainer steps, and a `generate` that
        # arrives meanwhile (the executor's next rollout) waits for `wake`; for the wake to arrive,
        # the launcher gives such an actor two threads (max_concurrency=2), and this lock keeps the
        # engine itself at one call at a time, as a one-thread actor does.
        self._awake = threading.Event()
        self._awake.set()
        self._lock = threading.Lock()

    def generate(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from hpref.memory import release_freed_memory

        self._awake.wait()
        with self._lock:
            out = self.engine.generate(*args, **kwargs)
        release_freed_memory()  # a rollout's logits and KV caches: GiBs glibc would keep (hpref.memory)
        return out

    def sleep(self) -> None:
        with self._lock:
            self._awake.clear()
            self.engine.sleep()

    def wake(self) -> None:
        with self._lock:
            self.engine.wake()
            self._awake.set()

    def begin_update(self, version: int) -> None:
        with self._lock:
            self.engine.begin_update(version)

    def load_weights(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.engine.load_weights(state)

    def weight_dtype(self) -> str:
        return self.engine.weight_dtype()

    def weight_channel_device(self) -> str:
        return self.engine.weight_channel_device()

    def connect_weight_channel(self, host: str, port: int, device: str) -> None:
        self.engine.connect_weight_channel(host, port, device)

    def receive_weights(self, layout: list[tuple[str, tuple[int, ...]]]) -> None:
        with self._lock:
            self.engine.receive_weights(layout)

    def commit_update(self) -> int:
        from hpref.memory import release_freed_memory

        with self._lock:
            version = self.engine.commit_update()
        release_freed_memory()  # the staged state dict, copied into the model
        return version

    def abort_update(self) -> None:
        with self._lock:
            self.engine.abort_update()

    def get_version(self) -> int:
        return self.engine.get_version()
