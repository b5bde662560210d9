"""The built-in `transformers` engine of `hpref rl`, registered through the `register_engines` hook:
`EngineActor`, `model.generate` on CPU (or on whatever device torch defaults to), weights swapped in
begin/load/commit steps (`hpref.rl.engines.versioned`). vLLM (`hpref.rl.engines.vllm_engine`) or a
plugin's engine register the same way, chosen by `[rl.engine] name = "..."`; the Ray actor around
whichever one the recipe names is `hpref.rl.engines.host.EngineHost`. The methods every engine has are
the `Engine` protocol (`hpref.rl.protocols`).

This module is loaded by `hpref --help` (it is a built-in plugin): torch is imported inside build.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from hpref.hookspecs import hookimpl
from hpref.recipe.rl import PolicyModelConfig
from hpref.recipe.rl_sampling import KNOBS_OFF
from hpref.recipe.schema import LoraSection
from hpref.rl.engines.requests import generation_result
from hpref.rl.engines.versioned import VersionedWeights
from hpref.rl.policy import (
    apply_env,
    cache_keyword,
    left_padded,
    stop_token_ids,
    trim_completion,
)
from hpref.rl.protocols import EngineConfigBase
from hpref.rl.rollout_types import GenerationRequest

if TYPE_CHECKING:
    from hpref.rl.rollout_types import Generation


class TransformersEngineConfig(EngineConfigBase):
    """`[rl.engine] name = "transformers"` (`hpref.rl.protocols.EngineConfig`)."""

    #: serves several LoRA adapters over one base (`rl.share_base`; PEFT's mixed-adapter batches)
    serves_adapters: ClassVar[bool] = True
    hostable: ClassVar[bool] = True  # sampling draws from per-request generators (`sampling`)
    #: the sampling knobs `generate` takes (`hpref.recipe.rl_sampling`): all of them
    sampling_knobs: ClassVar[frozenset[str]] = frozenset(KNOBS_OFF)
    #: runs on the CPU (or whatever device torch defaults to), in the policy's float32 weights
    num_gpus: ClassVar[float] = 0.0
    dtype: ClassVar[str] = "float32"

    threads: int = Field(1, ge=1, description="torch threads of each engine actor")
    batch_rows: int = Field(
        32,
        ge=0,
        description="a shared base's engine (rl.share_base) runs the requests it batches in passes of at "
        "most this many answers (a larger request alone; 0 = every request in one pass). 32: on a 2-core "
        "CPU a 64-answer pass of SmolLM2 ran at 0.69x the tokens/s of a 32-answer one",
    )
    share_prefill: bool = Field(
        True,
        description="run each prompt through the model once and share its KV cache across the group's "
        "answers (a group of G answers pays one prompt forward, not G)",
    )
    prefill_precision: Literal["auto", "fp32", "bf16"] = Field(
        "fp32",
        description="compute dtype of the shared prompt forward (bf16 = autocast; answers are decoded in "
        "fp32 either way). fp32 by default: with the prompt shared, bf16 saved ~10% of a SmolLM2 "
        "rollout here and moved greedy log-probs by up to 0.035; auto = the one measured faster here",
    )


def build_transformers(
    config: TransformersEngineConfig,
    *,
    policy: str,
    model: PolicyModelConfig,
    env: Any = None,
    adapters: dict[str, LoraSection] | None = None,
) -> EngineActor:
    """transformers `generate` on CPU, with versioned weights (begin/load/commit updates);
    `adapters`: a shared base's LoRA policies by id (`rl.share_base`)."""
    return EngineActor(
        policy,
        model,
        threads=config.threads,
        env=env,
        batch_rows=config.batch_rows,
        share_prefill=config.share_prefill,
        prefill_precision=config.prefill_precision,
        adapters=adapters,
    )


@hookimpl
def register_engines(register):
    register(name="transformers", config=TransformersEngineConfig, build=build_transformers)


class EngineActor(VersionedWeights):
    """Generation for one policy (transformers on CPU), with versioned weights (`VersionedWeights`);
    with `adapters`, for every LoRA policy of a shared base: the base once, one PEFT adapter per
    policy, and every request of a batch on its own adapter (PEFT's mixed-adapter batches)."""

    def __init__(
        self,
        policy: str,
        model: PolicyModelConfig,
        threads: int = 1,
        env: dict[str, str] | None = None,
        share_prefill: bool = True,
        prefill_precision: str = "fp32",
        adapters: dict[str, LoraSection] | None = None,
        batch_rows: int = 0,
    ) -> None:
        apply_env(env)
        import torch

        from hpref.models.precision import ProbeShape, resolve_precision

        torch.set_num_threads(threads)
        self.policy = policy
        self.batch_rows = batch_rows
        from hpref.models.causal_lm import build_policy_model  # torch: not at import (`hpref --help`)

        self.model, self.tokenizer = build_policy_model(model)
        self.peft: Any = None  # PEFT's handle of a shared base's adapters
        self.adapter_shapes = {}
        if adapters:
            self._add_adapters(adapters, model.seed)
        self.model.eval()
        self.share_prefill = share_prefill
        shape = ProbeShape.of(self.model.config)
        self.prefill_dtype = resolve_precision(prefill_precision, torch.device("cpu"), shape)
        self.stop_ids = stop_token_ids(self.tokenizer, self.model)
        self.shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self.dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.version = 0

    def _add_adapters(self, adapters: dict[str, LoraSection], seed: int) -> None:
        """One adapter per policy, drawn as its trainer draws it (`B` = 0: the base until a sync)."""
        from hpref.models.lm_adapters import adapter_items, add_lm_adapter, apply_lora_to_causal_lm

        for i, (name, settings) in enumerate(adapters.items()):
            if i == 0:
                self.peft = apply_lora_to_causal_lm(self.model, settings, seed=seed, adapter=name)
            else:
                add_lm_adapter(self.peft, self.model, settings, name, seed=seed)
            self.adapter_shapes[name] = {k: tuple(t.shape) for k, t in adapter_items(self.model, name)}
        self.peft.eval()  # PEFT's wrapper has a training flag of its own, which mixed batches check

    def _on_adapters(self, names: list[str | None]) -> Any:
        """PEFT's mixed-adapter forward for the rows of `names` (one per row), or nothing to do."""
        from contextlib import nullcontext

        if self.peft is None:
            return nullcontext()
        return self.peft.base_model._enable_peft_forward_hooks(adapter_names=names)

    def _swap_in_adapter(self, adapter: str, state: dict[str, Any]) -> None:
        from hpref.models.lm_adapters import load_adapter_tensors

        load_adapter_tensors(self.model, adapter, state, source=f"engine '{self.policy}' adapter '{adapter}'")

    def prompt_ids(self, prompts: list[tuple[str, ...]]) -> list[list[int]]:
        from hpref.models.causal_lm import encode_prompt

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
        """Several `generate` requests in as few batches as their group sizes allow, each request on
        its adapter and drawn from its own seed (`hpref.rl.engines.sampling`): its answers are the
        ones it would get alone."""
        out: list[Generation | None] = [None] * len(requests)
        for size in sorted({r.group_size for r in requests}):
            picked = [i for i, r in enumerate(requests) if r.group_size == size]
            for chunk in self._passes([requests[i] for i in picked], picked):
                for i, result in zip(
                    chunk, self._generate_together([requests[i] for i in chunk]), strict=True
                ):
                    out[i] = result
        return [r for r in out if r is not None]

    def _passes(self, requests: list[GenerationRequest], indices: list[int]) -> list[list[int]]:
        """`indices` (of `requests`, in order) in passes of at most `batch_rows` answers each."""
        passes: list[list[int]] = []
        rows = 0
        for request, i in zip(requests, indices, strict=True):
            n = request.rows
            if passes and (not self.batch_rows or rows + n <= self.batch_rows):
                passes[-1].append(i)
                rows += n
            else:
                passes.append([i])
                rows = n
        return passes

    def _generate_together(self, requests: list[GenerationRequest]) -> list[Generation]:
        """One batch of requests of one group size: every prompt's KV cache computed once
        (`_prefill`), then sampled step by step, each request's rows by `RowSampler`."""
        import torch
        from transformers import StoppingCriteriaList

        from hpref.rl.engines.sampling import Block, RowSampler, StopAtStrings

        start = time.perf_counter()
        group = requests[0].group_size
        per_request = [r.contexts if r.contexts is not None else self.prompt_ids(r.prompts) for r in requests]
        prompt_ids = [ids for ids in per_request for ids in ids]
        prompt_adapters = [r.adapter for r, ids in zip(requests, per_request, strict=True) for _ in ids]
        row_adapters = [a for a in prompt_adapters for _ in range(group)]
        blocks, first = [], 0
        for r, ids in zip(requests, per_request, strict=True):
            rows = len(ids) * group
            blocks.append(Block.of_request(r, first, first + rows))
            first += rows
        width = max(len(p) for p in prompt_ids)
        pad = self.tokenizer.pad_token_id
        input_ids, attention = left_padded(prompt_ids, width, pad)
        cache = None
        if self.share_prefill and width > 1:
            with self._on_adapters(prompt_adapters):
                cache = self._prefill(input_ids, attention, group)
        input_ids = input_ids.repeat_interleave(group, dim=0)
        attention = attention.repeat_interleave(group, dim=0)
        sampler = RowSampler(blocks, [width - len(prompt_ids[i // group]) for i in range(first)])
        stopping = StopAtStrings(self.tokenizer, blocks, width)  # ends a row at its stop string
        with torch.no_grad(), self._on_adapters(row_adapters):
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                **({cache_keyword(self.model): cache} if cache is not None else {}),
                max_new_tokens=max(r.max_new_tokens for r in requests),
                pad_token_id=pad,
                eos_token_id=self.stop_ids,
                do_sample=False,  # greedy over `sampler`'s scores: exactly the token it drew
                logits_processor=[sampler],
                stopping_criteria=StoppingCriteriaList([stopping]) if stopping.rows else None,
                return_dict_in_generate=True,
            )
        new = out.sequences[:, width:]
        logp = sampler.token_logprobs()
        results = []
        for r, block in zip(requests, blocks, strict=True):
            rows, completions, logprobs = [], [], []
            for i in range(block.start, block.stop):
                tokens = trim_completion(new[i, : r.max_new_tokens].tolist(), self.stop_ids, pad)
                rows.append(prompt_ids[i // group])
                completions.append(tokens)
                logprobs.append(logp[i, : len(tokens)].tolist())
            version = self.get_version(r.adapter)
            results.append(
                generation_result(
                    self.tokenizer, rows, completions, logprobs, version, start, block.stop_strings
                )
            )
        return results

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

    def _swap_in(self, state: Mapping[str, Any]) -> None:
        """Each tensor copied into its weight as it is read from the stage (`commit_update` checked
        every name and shape first): one tensor beyond the model, where `load_state_dict` would
        read the whole state before its first copy."""
        import torch

        weights = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in state.items():
                weights[name].copy_(tensor)
