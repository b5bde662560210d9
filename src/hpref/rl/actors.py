"""The three kinds of actor of `hpref rl`: engine, rollout executor, trainer.

They are plain classes so they can be unit-tested in-process; the driver turns them into Ray actors
(`ray.remote(cls).options(num_cpus=...)`), or wraps them in `LocalActor` for runs without Ray. Both
kinds of handle are called the same way, `await handle.method.remote(...)`.

Numbers live in small functions (`encode_prompt`, `trim_completion`, `staleness_decision`,
`rollout_prompts`, `pad_batch`); the classes only hold state and call them.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import io
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Literal

from hpref.errors import UserError
from hpref.rl.config import PolicyConfig, PolicyModelConfig, RLConfig, RolloutConfig

TOKENIZER_MIN_FREQUENCY = 2
TOKENIZER_SEED = 0
USER, ASSISTANT = "<|user|>", "<|assistant_a|>"


# --------------------------------------------------------------------------------------------------
# handles


class LocalActor:
    """An in-process stand-in for a Ray actor handle: `await h.method.remote(...)`.

    Calls run one at a time, as on a Ray actor: synchronous methods in a worker thread under a
    lock, coroutine methods on the caller's event loop.
    """

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        self._lock = threading.Lock()

    @property
    def wrapped(self) -> Any:
        return self._obj

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._obj, name)
        lock = self._lock

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                if inspect.iscoroutinefunction(fn):
                    return fn(*args, **kwargs)

                def locked() -> Any:
                    with lock:
                        return fn(*args, **kwargs)

                return asyncio.to_thread(locked)

        return _Method()


def apply_env(env: dict[str, str] | None) -> None:
    """Set the driver's cache and offline variables in an actor's process.

    Passed as an argument rather than a Ray `runtime_env`: a runtime env forces fresh worker
    processes, while plain arguments let Ray reuse its pre-started workers (seconds per actor).
    """
    os.environ.update(env or {})


# --------------------------------------------------------------------------------------------------
# models and prompts


def policy_tokenizer(model: PolicyModelConfig) -> Any:
    """The tokenizer of a policy: the folder's own, or hpref's cached tiny BPE."""
    if model.path is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model.path)
    from hpref.models.tokenizer import load_or_train_tokenizer

    return load_or_train_tokenizer(
        vocab_size=model.vocab_size,
        min_frequency=TOKENIZER_MIN_FREQUENCY,
        num_texts=model.tokenizer_texts,
        seed=TOKENIZER_SEED,
    )


def build_policy_model(model: PolicyModelConfig) -> tuple[Any, Any]:
    """(causal LM, tokenizer). A tiny model is seeded, so the engine and the trainer of one policy
    build identical weights independently (version 0) without shipping them."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    tokenizer = policy_tokenizer(model)
    if model.path is not None:
        from hpref.logs import route_transformers_logs

        route_transformers_logs()  # the load report goes to the actor's log, not the console
        lm = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
        return lm, tokenizer
    config = tiny_policy_config(
        model,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(model.seed)
    return LlamaForCausalLM(config).float(), tokenizer


def tiny_policy_config(model: PolicyModelConfig, **tokens: Any) -> Any:
    """The `LlamaConfig` of a tiny policy (`tokens`: vocab_size and the special token ids)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_hidden_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_key_value_heads,
        max_position_embeddings=model.max_position_embeddings,
        tie_word_embeddings=False,
        **tokens,
    )


def policy_skeleton(model: PolicyModelConfig) -> Any:
    """The policy's causal LM on the meta device: its module tree without weights or a tokenizer
    (seconds less than a build), for checks of settings that depend on the architecture."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model.path is not None:
        config = AutoConfig.from_pretrained(model.path)
    else:  # the vocabulary size is the target's; only the embedding's shape depends on it
        config = tiny_policy_config(model, vocab_size=model.vocab_size)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_policy_lora(config: RLConfig, policies: list[str], where: str, *, skip_paths: bool = False) -> None:
    """Before any actor starts: every LoRA policy's adapters can be injected into its LM (their
    `target_modules` name linear layers it has). A `RecipeError` of one line naming the policy.
    `skip_paths`: leave out policies whose model is a local folder (a check for another machine)."""
    from hpref.errors import RecipeError
    from hpref.models.adapters import apply_lora_to_causal_lm

    for p in policies:
        policy = config.policies[p]
        if policy.lora is None or (skip_paths and policy.model.path is not None):
            continue
        try:
            skeleton = policy_skeleton(policy.model)
        except (OSError, ValueError) as exc:
            raise RecipeError(
                f"{where}: rl.policies.{p}.model.path: no causal LM config to adapt there "
                f"({str(exc).splitlines()[0]})"
            ) from None
        try:
            apply_lora_to_causal_lm(skeleton, policy.lora, seed=policy.model.seed)
        except UserError as exc:
            raise RecipeError(f"{where}: rl.policies.{p}.{exc}") from None


def encode_prompt(tokenizer: Any, turns: tuple[str, ...]) -> list[int]:
    """Token ids a policy continues: bos, then `<|user|>turn` per turn, then the assistant marker.

    Only the last turn is answered; earlier turns are context (the arena's prompts for RL are
    single-turn by default).
    """
    ids = [tokenizer.bos_token_id]
    for turn in turns:
        ids.append(tokenizer.convert_tokens_to_ids(USER))
        ids.extend(tokenizer.encode(turn, add_special_tokens=False))
    ids.append(tokenizer.convert_tokens_to_ids(ASSISTANT))
    return ids


def trim_completion(tokens: list[int], eos_id: int, pad_id: int) -> list[int]:
    """A sampled continuation up to and including the first eos (the policy must learn to stop, so
    eos is trained on); padding after it is dropped."""
    out = []
    for t in tokens:
        if t == eos_id:
            out.append(t)
            break
        if t == pad_id:
            break
        out.append(t)
    return out


def _rng(*parts: object) -> random.Random:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def rollout_prompts(rollout: RolloutConfig, rollout_id: int, *, salt: str = "rl") -> list[tuple[str, ...]]:
    """The prompts of rollout `rollout_id`: prompt i of the stream depends only on (seed, i), so every
    policy answers the same prompts at the same rollout id and a restored position replays nothing."""
    from hpref.data.synthetic import generate_prompt

    first = rollout_id * rollout.prompts_per_rollout
    return [
        generate_prompt(_rng(salt, rollout.seed, i), turns=1, families=rollout.families)
        for i in range(first, first + rollout.prompts_per_rollout)
    ]


def sample_seed(seed: int, policy: str, rollout_id: int) -> int:
    """The sampling seed of one policy's rollout: regenerating it gives the same answers."""
    return _rng("sample", seed, policy, rollout_id).getrandbits(62)


def pad_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> dict[str, Any]:
    """Right-padded `[B, L]` tensors of prompt + completion, for one teacher-forced forward pass.

    `targets[:, t]` is the token at t + 1 and `mask[:, t]` is 1 where that token is a completion token:
    logits at position t predict it. Prompt tokens and padding never count.
    """
    import torch

    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        row = p + c
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        mask[i, len(p) - 1 : len(row) - 1] = 1.0
    return {"input_ids": input_ids, "attention_mask": attention, "targets": input_ids[:, 1:], "mask": mask}


def completion_logprobs(model: Any, batch: dict[str, Any], temperature: float) -> Any:
    """Per-token log-probs `[B, L-1]` of the batch's targets under `model` at `temperature` (the
    sampling distribution the engine drew from)."""
    from hpref.rl.algorithms import sequence_logprobs

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    return sequence_logprobs(logits / temperature, batch["targets"])


# --------------------------------------------------------------------------------------------------
# engine


class EngineActor:
    """Generation for one policy (transformers on CPU), with versioned weights.

    Weight updates are three steps so a failed transfer never leaves half-loaded weights serving:
    `begin_update(version)` opens a staging area, `load_weights(state)` fills it, `commit_update()`
    swaps it in (or `abort_update()` drops it).
    """

    def __init__(
        self, policy: str, model: PolicyModelConfig, threads: int = 1, env: dict[str, str] | None = None
    ) -> None:
        apply_env(env)
        import torch

        torch.set_num_threads(threads)
        self.policy = policy
        self.model, self.tokenizer = build_policy_model(model)
        self.model.eval()
        self.version = 0
        self._staging: tuple[int, dict[str, Any]] | None = None

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
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, r in enumerate(rows):  # left padding: every row's continuation starts at `width`
            input_ids[i, width - len(r) :] = torch.tensor(r)
            attention[i, width - len(r) :] = 1
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
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                eos_token_id=self.tokenizer.eos_token_id,
                output_logits=True,
                return_dict_in_generate=True,
                **sampling,
            )
        new = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1)[:, : new.shape[1]].float()
        scale = 1.0 if greedy else temperature
        logp = torch.log_softmax(logits / scale, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        completions, logprobs = [], []
        for i in range(len(rows)):
            tokens = trim_completion(new[i].tolist(), self.tokenizer.eos_token_id, pad)
            completions.append(tokens)
            logprobs.append(logp[i, : len(tokens)].tolist())
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        return {
            "prompt_ids": rows,
            "completions": completions,
            "logprobs": logprobs,
            "texts": texts,
            "version": self.version,
            "tokens": sum(len(c) for c in completions),
            "seconds": time.perf_counter() - start,
        }

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
        self.model.load_state_dict(state, strict=True)
        self.version = version
        return version

    def abort_update(self) -> None:
        self._staging = None

    def get_version(self) -> int:
        return self.version


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

    def generate(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.engine.generate(*args, **kwargs)

    def begin_update(self, version: int) -> None:
        self.engine.begin_update(version)

    def load_weights(self, state: dict[str, Any]) -> None:
        self.engine.load_weights(state)

    def commit_update(self) -> int:
        return self.engine.commit_update()

    def abort_update(self) -> None:
        self.engine.abort_update()

    def get_version(self) -> int:
        return self.engine.get_version()


# --------------------------------------------------------------------------------------------------
# rollout executor


Decision = Literal["use", "regenerate"]


class StaleWeightsError(RuntimeError):
    """An engine is further behind its trainer than the staleness limit allows."""


def expected_version(rollout_id: int, update_interval: int) -> int:
    """The trainer's weight version when it starts rollout `rollout_id` (one publish per interval)."""
    return rollout_id // update_interval


def staleness_decision(
    policy: str,
    rollout_id: int,
    data_version: int | None,
    engine_version: int,
    update_interval: int,
    limit: int,
) -> Decision:
    """Serve buffered data, regenerate it, or fail.

    Data of rollout `r` is fresh enough when its weights are at most `limit` versions behind the
    trainer's. Stale data is regenerated if the engine now has fresh enough weights; if the engine
    itself is too far behind, the trainer did not publish a new version in time: an error, because
    waiting would deadlock (the trainer waits for this very rollout).
    """
    needed = expected_version(rollout_id, update_interval) - limit
    if data_version is not None and data_version >= needed:
        return "use"
    if engine_version >= needed:
        return "regenerate"
    raise StaleWeightsError(
        f"policy '{policy}': rollout {rollout_id} needs weights of version >= {needed} but the engine "
        f"serves version {engine_version}: no weight update was published in time"
    )


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
    ) -> None:
        apply_env(env)
        from hpref.plugins import load_plugins

        self.config = config if isinstance(config, RLConfig) else RLConfig.model_validate(config)
        if self.config.reward_config is None:
            from hpref.rl.config import resolve_reward

            self.config.reward_config = resolve_reward(self.config.reward)
        component = load_plugins().get("reward", self.config.reward.name)
        self.reward = component.build(self.config.reward_config)
        self.policies = list(policies)
        self.engines = engines
        self.positions = {p: 0 for p in self.policies}
        self._buffer: dict[str, dict[int, asyncio.Task]] = {p: {} for p in self.policies}
        # each policy's answers per rollout id, for judging the other policies against them
        self._answers: dict[tuple[str, int], list[list[str]]] = {}
        self._start_answers: dict[str, list[str]] = {}

    def _wants_opponents(self) -> bool:
        return len(self.policies) > 1 and bool(getattr(self.reward, "wants_opponents", False))

    async def _opponents(
        self, policy: str, rollout_id: int, prompts: list[tuple[str, ...]]
    ) -> tuple[list[list[str]], int]:
        """Other policies' answers to this rollout's prompts: (answers per prompt, tokens generated).

        Every policy answers the same prompts at the same rollout id, so an opponent that already
        produced this rollout lends its own answers (free); otherwise its engine samples
        `opponent_answers` per prompt now, seeded by (opponent, policy, rollout), at its current
        weights. Which of the two happens depends on how far each policy has got, so cross-policy
        rewards, unlike within-group ones, are not replayed bit for bit after a resume.
        """
        k = int(getattr(self.reward, "opponent_answers", 1))
        per_prompt: list[list[str]] = [[] for _ in prompts]
        generated = 0
        for q in self.policies:
            if q == policy:
                continue
            cached = self._answers.get((q, rollout_id))
            if cached is None:
                rollout = self.config.policy_rollout(q)
                out = await self.engines[q].generate.remote(
                    prompts,
                    k,
                    rollout.max_new_tokens,
                    rollout.temperature,
                    rollout.top_k,
                    sample_seed(rollout.seed, f"{q}>{policy}", rollout_id),
                )
                generated += out["tokens"]
                cached = [out["texts"][i * k : (i + 1) * k] for i in range(len(prompts))]
            for i, answers in enumerate(cached):
                per_prompt[i].extend(answers[:k])
        return per_prompt, generated

    def _forget_answers(self) -> None:
        """Keep only answers of rollouts some policy may still produce (bounded memory)."""
        oldest = min(self.positions.values()) - 1
        for key in [key for key in self._answers if key[1] < oldest]:
            del self._answers[key]

    async def _produce(self, policy: str, rollout_id: int) -> dict[str, Any]:
        rollout = self.config.policy_rollout(policy)
        prompts = rollout_prompts(rollout, rollout_id)
        out = await self.engines[policy].generate.remote(
            prompts,
            rollout.group_size,
            rollout.max_new_tokens,
            rollout.temperature,
            rollout.top_k,
            sample_seed(rollout.seed, policy, rollout_id),
        )
        g = rollout.group_size
        groups = [out["texts"][i * g : (i + 1) * g] for i in range(len(prompts))]
        if self._wants_opponents():
            self._answers[(policy, rollout_id)] = groups
            opponents, opponent_tokens = await self._opponents(policy, rollout_id, prompts)
            # a judge model's forward pass would block the event loop that serves every policy's get()
            scores = await asyncio.to_thread(self.reward.score_groups, prompts, groups, opponents)
        else:
            opponent_tokens = 0
            scores = await asyncio.to_thread(self.reward.score_groups, prompts, groups)
        truth = getattr(self.reward, "true_utility", None)
        out.update(
            rollout_id=rollout_id,
            policy=policy,
            group_size=g,
            temperature=rollout.temperature,
            opponent_tokens=opponent_tokens,
            rewards=[float(s) for group in scores for s in group],
            true_utility=[truth(p, a) for p, group in zip(prompts, groups, strict=True) for a in group]
            if truth
            else None,
        )
        return out

    def _prefetch(self, policy: str, after: int) -> None:
        buffer = self._buffer[policy]
        for r in range(after + 1, after + 1 + self.config.rollout.max_buffered):
            if r not in buffer:
                buffer[r] = asyncio.ensure_future(self._produce(policy, r))

    async def get(self, rollout_id: int, policy: str) -> dict[str, Any]:
        if policy not in self.positions:
            raise KeyError(f"rollout executor: unknown policy '{policy}'")
        if rollout_id != self.positions[policy]:
            raise RuntimeError(
                f"policy '{policy}' asked for rollout {rollout_id} but its next rollout is "
                f"{self.positions[policy]}: each policy drains its own buffer in order"
            )
        task = self._buffer[policy].pop(rollout_id, None)
        data = await task if task is not None else None
        engine_version = await self.engines[policy].get_version.remote()
        decision = staleness_decision(
            policy,
            rollout_id,
            None if data is None else data["version"],
            engine_version,
            self.config.update_weights_interval,
            self.config.staleness_limit,
        )
        if decision == "regenerate":
            data = await self._produce(policy, rollout_id)
        assert data is not None
        data["stale_regenerated"] = task is not None and decision == "regenerate"
        self.positions[policy] = rollout_id + 1
        self._forget_answers()
        self._prefetch(policy, rollout_id)
        return data

    def _drop_buffers(self) -> None:
        for buffer in self._buffer.values():
            for task in buffer.values():
                task.cancel()
            buffer.clear()

    def _eval_prompts(self) -> list[tuple[str, ...]]:
        rollout = self.config.rollout
        eval_cfg = rollout.model_copy(update={"prompts_per_rollout": rollout.eval_prompts})
        return rollout_prompts(eval_cfg, 0, salt="eval")

    async def _greedy_answers(self, policy: str, prompts: list[tuple[str, ...]]) -> list[str]:
        max_new = self.config.policy_rollout(policy).max_new_tokens
        gen = await self.engines[policy].generate.remote(prompts, 1, max_new, 1.0, 0, 0, True)
        return list(gen["texts"])

    async def record_start(self, policies: list[str]) -> dict[str, float]:
        """Greedy eval answers of each policy's starting checkpoint; returns their true utility.

        Called while every engine still serves the weights it was built with (version 0: the
        warm-up checkpoint, the policy's model folder, or its seeded init), before a resume pushes
        restored weights, so `win_rate_vs_start` always compares against the true start.
        """
        truth = getattr(self.reward, "true_utility", None)
        prompts = self._eval_prompts()
        if truth is None or not prompts:
            return {}
        out = {}
        for p in policies:
            version = await self.engines[p].get_version.remote()
            if version != 0:
                raise RuntimeError(f"record_start: engine '{p}' already serves version {version}, not 0")
            self._start_answers[p] = await self._greedy_answers(p, prompts)
            utilities = [truth(q, a) for q, a in zip(prompts, self._start_answers[p], strict=True)]
            out[p] = sum(utilities) / len(utilities)
        return out

    async def evaluate(self, policies: list[str]) -> dict[str, Any]:
        """Greedy answers of every policy on fixed eval prompts, judged by the ground truth.

        Returns `true_utility` (mean per policy), `win_rate_vs_start` (per policy: the mean over
        prompts of P(win) + P(tie) / 2 of its answer against its starting checkpoint's, from the
        arena judge's outcome probabilities; 0.5 = no better than where it began) and `battles`: one
        `(p, q, expected score of p)` per prompt and pair of players, the players being the policies
        and their starting checkpoints (`<id>@start`) — the input of the Bradley-Terry leaderboard.
        Empty when the reward knows no ground truth.
        """
        from hpref.data.synthetic import davidson

        prompts = self._eval_prompts()
        truth = getattr(self.reward, "true_utility", None)
        if truth is None or not prompts:
            return {"true_utility": {}, "win_rate_vs_start": {}, "battles": []}
        utilities: dict[str, list[float]] = {}
        for p in policies:
            answers = await self._greedy_answers(p, prompts)
            utilities[p] = [truth(q, a) for q, a in zip(prompts, answers, strict=True)]
        for p in policies:
            if p in self._start_answers:
                start = self._start_answers[p]
                utilities[f"{p}@start"] = [truth(q, a) for q, a in zip(prompts, start, strict=True)]

        def expected(u_p: list[float], u_q: list[float]) -> list[float]:
            out = []
            for a, b in zip(u_p, u_q, strict=True):
                win, _lose, tie = davidson(a, b)
                out.append(win + 0.5 * tie)
            return out

        players = list(utilities)
        battles = []
        for i, p in enumerate(players):
            for q in players[i + 1 :]:
                battles.extend((p, q, score) for score in expected(utilities[p], utilities[q]))
        win_rates = {}
        for p in policies:
            if f"{p}@start" in utilities:
                scores = expected(utilities[p], utilities[f"{p}@start"])
                win_rates[p] = sum(scores) / len(scores)
        return {
            "true_utility": {p: sum(u) / len(u) for p, u in utilities.items()},
            "win_rate_vs_start": win_rates,
            "battles": battles,
        }

    async def save(self, folder: str) -> None:
        """Write the data position. Prefetched data is not saved: it is regenerated identically
        (seeded by policy and rollout id) from the restored weights."""
        from hpref.runfolder import integrity
        from hpref.runfolder.files import write_json_atomic

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path / "executor.json", {"positions": self.positions}, sort_keys=True)
        integrity.write_manifest(path)

    async def load(self, folder: str) -> dict[str, int]:
        """Restore the data position of the policies saved in `folder`; returns it."""
        path = Path(folder) / "executor.json"
        self._drop_buffers()
        self._answers.clear()
        saved: dict[str, int] = {}
        if path.is_file():
            from hpref.runfolder import integrity
            from hpref.runfolder.safe_load import CheckpointError

            integrity.require_verified(path.parent)
            try:
                saved = json.loads(path.read_text(encoding="utf-8"))["positions"]
                saved = {str(p): int(n) for p, n in saved.items()}
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"{path}: damaged ({type(exc).__name__}: {exc})") from None
        for p in self.policies:
            self.positions[p] = int(saved.get(p, 0))
        return {p: self.positions[p] for p in self.policies if p in saved}

    async def shutdown(self) -> None:
        self._drop_buffers()


# --------------------------------------------------------------------------------------------------
# trainer


TRAINER_STATE = "trainer.pt"


class TrainerActor:
    """GRPO for one policy: a step per rollout, weights for the engine, save and load."""

    def __init__(
        self,
        policy: str,
        config: PolicyConfig | dict[str, Any],
        update_interval: int,
        threads: int = 1,
        env: dict[str, str] | None = None,
    ):
        apply_env(env)
        import torch

        torch.set_num_threads(threads)
        self.policy = policy
        self.config = config if isinstance(config, PolicyConfig) else PolicyConfig.model_validate(config)
        self.update_interval = update_interval
        self.model, self.tokenizer = build_policy_model(self.config.model)
        self.lora = None  # PEFT's handle when the policy has [lora]; self.model stays the LM it adapts
        if self.config.lora is not None:
            from hpref.models.adapters import apply_lora_to_causal_lm

            try:
                self.lora = apply_lora_to_causal_lm(self.model, self.config.lora, seed=self.config.model.seed)
            except UserError as exc:
                raise UserError(f"rl.policies.{policy}.{exc}") from None
            from loguru import logger

            from hpref.models.adapters import count_parameters

            trainable, total = count_parameters(self.model)
            logger.info(
                f"policy '{policy}': LoRA r={self.config.lora.r} on "
                f"{', '.join(sorted(self.lora.peft_config['default'].target_modules))}: "
                f"{trainable:,} of {total:,} parameters train ({trainable / total:.2%})"
            )
        self.model.train()
        self.reference = None
        self.wants_reference = self.config.kl_coef > 0 or self.config.measure_kl
        if self.wants_reference and self.lora is None:  # the frozen starting policy
            # (with LoRA the frozen base is the start: `_reference_logprobs` turns the adapters off)
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        # Only what trains: all weights, or the adapters alone (a frozen base needs no Adam moments)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )
        self.rollouts_done = 0
        self.version = 0

    def train(self, rollout: dict[str, Any]) -> dict[str, float]:
        """One GRPO update on a rollout (`epochs_per_rollout` passes); returns its metrics."""
        import torch

        from hpref.rl.algorithms import group_advantages, policy_loss

        if rollout["rollout_id"] != self.rollouts_done:
            raise RuntimeError(
                f"trainer '{self.policy}' got rollout {rollout['rollout_id']}, expected {self.rollouts_done}"
            )
        start = time.perf_counter()
        cfg = self.config
        rewards = torch.tensor(rollout["rewards"], dtype=torch.float32)
        adv = group_advantages(rewards, rollout["group_size"], scale_by_std=cfg.scale_by_std)
        batch = pad_batch(rollout["prompt_ids"], rollout["completions"], self.tokenizer.pad_token_id)
        mask = batch["mask"]
        old = torch.zeros_like(mask)
        for i, lp in enumerate(rollout["logprobs"]):  # the engine's (behaviour) log-probs
            start_col = len(rollout["prompt_ids"][i]) - 1
            old[i, start_col : start_col + len(lp)] = torch.tensor(lp)
        ref = self._reference_logprobs(batch, rollout["temperature"])
        stats: dict[str, float] = {}
        for epoch in range(cfg.epochs_per_rollout):
            logp = completion_logprobs(self.model, batch, rollout["temperature"])
            out = policy_loss(
                logp,
                old,
                adv,
                mask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                ref_logprobs=ref,
                kl_coef=cfg.kl_coef,
                aggregation=cfg.aggregation,
            )
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            grad_norm = (
                torch.nn.utils.clip_grad_norm_(self.trainable, cfg.grad_clip)
                if cfg.grad_clip
                else torch.tensor(0.0)
            )
            self.optimizer.step()
            if epoch == 0:
                mismatch = ((logp.detach() - old).abs() * mask).sum() / mask.sum().clamp(min=1)
                stats["engine_trainer_logprob_diff"] = float(mismatch)
            stats.update(
                loss=float(out.loss.detach()),
                kl=float(out.kl),
                clip_fraction=float(out.clip_fraction),
                ratio_mean=float(out.ratio_mean),
                grad_norm=float(grad_norm),
            )
        self.rollouts_done += 1
        tokens = float(mask.sum())
        seconds = time.perf_counter() - start
        stats.update(
            train_tokens=tokens, train_tokens_per_s=tokens * cfg.epochs_per_rollout / max(seconds, 1e-9)
        )
        return stats

    def _reference_logprobs(self, batch: dict[str, Any], temperature: float) -> Any:
        """Log-probs under the frozen starting policy, or None when no KL is asked for."""
        import torch

        if not self.wants_reference:
            return None
        with torch.no_grad():
            if self.lora is not None:
                # LoRA's B starts at zero and the base never steps, so the base alone is the start
                with self.lora.disable_adapter():
                    return completion_logprobs(self.model, batch, temperature)
            return completion_logprobs(self.reference, batch, temperature)

    def update_weights(self) -> tuple[int, dict[str, Any]]:
        """Publish the current weights: (the new version, a CPU state dict for the engine).

        With LoRA the engine gets merged weights (base + B A alpha/r, under the plain LM's keys), not
        the adapter: it then loads a plain transformers state dict whether or not the policy has
        adapters, so no engine (nor an engine plugin such as vLLM) has to know PEFT, hold the base
        separately, or pay for the adapter's extra matmuls while generating. The price is a full
        state dict per sync, the same as without LoRA."""
        self.version = expected_version(self.rollouts_done, self.update_interval)
        if self.lora is not None:
            from hpref.models.adapters import merged_lm_state

            return self.version, merged_lm_state(self.model)
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return self.version, state

    def save(self, folder: str) -> None:
        """The model as a transformers folder (a usable starting checkpoint), optimizer and counters.

        With LoRA only what trains: PEFT's adapter folder (`adapter/`, loadable by `peft`), the
        optimizer state of the adapters, the counters, and `policy_base.json`, which names the frozen
        base (the policy's `model` settings) and the adapter settings that resume must match."""
        import torch

        from hpref.runfolder import integrity
        from hpref.runfolder.files import write_bytes_atomic, write_json_atomic

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            from hpref.models.adapters import POLICY_ADAPTER_DIR, POLICY_BASE_FILE

            self.lora.save_pretrained(
                str(path / POLICY_ADAPTER_DIR), safe_serialization=True, save_embedding_layers=False
            )
            write_json_atomic(path / POLICY_BASE_FILE, self._base_description(), indent=2, sort_keys=True)
        else:
            self.model.save_pretrained(path / "model")
            self.tokenizer.save_pretrained(path / "model")
        buffer = io.BytesIO()
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "rollouts_done": self.rollouts_done,
                "version": self.version,
            },
            buffer,
        )
        write_bytes_atomic(path / TRAINER_STATE, buffer.getvalue())
        integrity.write_manifest(path)  # sizes and SHA-256 of every file, verified by `load`

    def load(self, folder: str) -> int:
        """Restore from `folder`; returns the rollout id to start at (0 when there is nothing there)."""
        from safetensors.torch import load_file

        from hpref.models.adapters import POLICY_BASE_FILE
        from hpref.runfolder import integrity
        from hpref.runfolder.safe_load import CheckpointError, load_torch_file

        path = Path(folder)
        if not (path / TRAINER_STATE).is_file():
            return 0
        integrity.require_verified(path)
        if self.lora is not None:
            self._load_adapter(path)
        else:
            weights_file = path / "model" / "model.safetensors"
            if not weights_file.is_file() and (path / POLICY_BASE_FILE).is_file():
                raise CheckpointError(
                    f"{path}: holds a LoRA adapter, but policy '{self.policy}' has no [lora] now; "
                    "resume with the adapter settings it was saved with"
                )
            try:
                weights = load_file(str(weights_file))
                self.model.load_state_dict(weights, strict=True)
            except Exception as exc:  # safetensors' header errors and shape mismatches
                raise CheckpointError(f"{weights_file}: cannot load ({type(exc).__name__}: {exc})") from None
        state = load_torch_file(path / TRAINER_STATE)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.rollouts_done = int(state["rollouts_done"])
            self.version = int(state["version"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path / TRAINER_STATE}: damaged ({type(exc).__name__}: {exc})") from None
        return self.rollouts_done

    def _base_description(self) -> dict[str, Any]:
        """What a LoRA save leaves out and resume must find again: the base and the adapter shape."""
        assert self.config.lora is not None
        return {
            "format": 1,
            "base": self.config.model.model_dump(mode="json"),
            "lora": self.config.lora.model_dump(mode="json"),
        }

    def _load_adapter(self, path: Path) -> None:
        """The adapter of a LoRA save into this trainer, after checking it adapts this very base."""
        from safetensors.torch import load_file

        from hpref.models.adapters import (
            PEFT_WEIGHTS_FILE,
            POLICY_ADAPTER_DIR,
            POLICY_BASE_FILE,
            load_lm_adapter_state,
        )
        from hpref.runfolder.safe_load import CheckpointError

        described = path / POLICY_BASE_FILE
        if not described.is_file():
            raise CheckpointError(
                f"{path}: holds full weights (no {POLICY_BASE_FILE}), but policy '{self.policy}' has "
                "[lora] now; resume without it, or start a new run"
            )
        try:
            saved = json.loads(described.read_text(encoding="utf-8"))
            saved_base, saved_lora = dict(saved["base"]), dict(saved["lora"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{described}: damaged ({type(exc).__name__}: {exc})") from None
        want = self._base_description()
        for part, have in (("base", saved_base), ("lora", saved_lora)):
            if have != want[part]:
                diff = sorted(k for k in set(have) | set(want[part]) if have.get(k) != want[part].get(k))
                key = "model" if part == "base" else "lora"
                raise CheckpointError(
                    f"{described}: the adapter was trained with other {key} settings than policy "
                    f"'{self.policy}' has now ({key}.{diff[0]}: saved {have.get(diff[0])!r}, now "
                    f"{want[part].get(diff[0])!r}); an adapter only fits the base it was trained on"
                )
        weights_file = path / POLICY_ADAPTER_DIR / PEFT_WEIGHTS_FILE
        try:
            load_lm_adapter_state(self.lora, load_file(str(weights_file)), source=str(weights_file))
        except ValueError as exc:
            raise CheckpointError(str(exc).splitlines()[0]) from None
        except Exception as exc:  # safetensors' header errors
            raise CheckpointError(f"{weights_file}: cannot load ({type(exc).__name__}: {exc})") from None
