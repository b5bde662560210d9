"""The supervised warm-up: the checkpoint a policy starts RL from, made by hpref itself.

A random-init tiny Llama writes token soup, so its first rollouts carry no signal a reward could
rank. The warm-up fine-tunes it on the synthetic arena's answers (the simulated assistants' answers
to single-turn prompts, right and wrong ones alike) so that its first rollouts are already answers,
some right, some near misses: room for RL to improve and a fair starting policy to measure against.

    [rl.warmup]              # policies without model.path start from the warm-up of their model
    steps = 300
    batch_size = 32
    lr = 3e-3

With `path` (`hpref.recipe.rl_warmup`) every policy, pretrained ones too, is fine-tuned on the user's
own answers instead, with a held-out loss before and after (`hpref.rl.warmup.data`).

`warmup_checkpoint(model, warmup, lora=...)` returns the folder of the checkpoint, training it on
first use. It is cached under `<HPREF_CACHE>/rl-warmup/<hash of model + warm-up settings>` (with a
data file: + its digest, the model folder's files and the LoRA settings), written under a temporary
name and renamed into place, like the tokenizer cache, so a second run, a resume, or a second policy
with the same settings reuses it. `hpref rl-warmup RECIPE` builds them ahead of time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from hpref.recipe.rl import PolicyModelConfig, RLConfig, WarmupConfig
from hpref.recipe.rl_warmup import DATA_KEYS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hpref.recipe.schema import LoraSection

WARMUP_FORMAT = 1  # bump when the warm-up's data or training changes, so caches are not reused
META_FILE = "hpref_warmup.json"


def has_warmup(model: PolicyModelConfig, warmup: WarmupConfig) -> bool:
    """Whether a policy starts from a warm-up: every policy on a data file's answers, only tiny
    random-init ones on the synthetic arena's (a pretrained model already answers)."""
    return warmup.path is not None or not model.pretrained


def warmup_settings(
    config: RLConfig, order: Sequence[str]
) -> dict[str, tuple[PolicyModelConfig, LoraSection | None]]:
    """{policy: (its model, the LoRA settings its warm-up trains)} for the policies of `order` that
    start from a warm-up (`config.warmup` set). The arena's warm-up trains every weight of a tiny
    model; one on a data file trains the policy's adapters when it has them (merged into the
    checkpoint). Policies on a shared base (`config.share_base`) share one warm-up, made with the
    leader's adapter settings, so their start stays one base."""
    assert config.warmup is not None
    out = {}
    for p in order:
        policy = config.policies[p]
        if not has_warmup(policy.model, config.warmup):
            continue
        lora = config.policies[order[0]].lora if config.share_base else policy.lora
        out[p] = (policy.model, lora if config.warmup.path is not None else None)
    return out


def cache_key(model: PolicyModelConfig, warmup: WarmupConfig, lora: LoraSection | None = None) -> str:
    if warmup.path is None:  # the arena's warm-up: the key it always had
        payload: dict[str, Any] = {
            "format": WARMUP_FORMAT,
            "model": model.model_dump(mode="json"),
            "warmup": warmup.model_dump(mode="json", exclude={"threads", *DATA_KEYS}),
        }
    else:
        from hpref.rl.warmup.data import data_key

        payload = data_key(model, warmup, lora)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_folder(
    model: PolicyModelConfig, warmup: WarmupConfig, lora: LoraSection | None = None
) -> Path:
    from hpref.cache_root import cache_root

    return cache_root() / "rl-warmup" / cache_key(model, warmup, lora)


def is_cached(model: PolicyModelConfig, warmup: WarmupConfig, lora: LoraSection | None = None) -> bool:
    return (checkpoint_folder(model, warmup, lora) / META_FILE).is_file()


def sft_examples(
    tokenizer: PreTrainedTokenizerBase, warmup: WarmupConfig
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + eos) pairs from single-turn arena battles.

    Prompts are encoded exactly as the engine encodes a rollout's prompt (`encode_prompt`), so the
    policy learns to answer in the position it will be sampled from.
    """
    from hpref.arena import generate_battles
    from hpref.models.causal_lm import encode_prompt

    out = []
    for battle in generate_battles(
        warmup.battles, warmup.seed, max_turns=1, labels="soft", families=warmup.families
    ):
        prompt_ids = encode_prompt(tokenizer, battle.prompt)
        answers = [battle.response_a[0], battle.response_b[0]]
        if warmup.answers == "preferred":
            p_a, p_b, _ = battle.truth
            answers = [answers[0] if p_a >= p_b else answers[1]]
        for answer in answers:
            ids = tokenizer.encode(answer, add_special_tokens=False)[: warmup.max_answer_tokens]
            out.append((prompt_ids, [*ids, tokenizer.eos_token_id]))
    return out


def lr_multiplier(step: int, warmup: WarmupConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak at the last step."""
    if step < warmup.warmup_steps:
        return (step + 1) / warmup.warmup_steps
    span = max(1, warmup.steps - warmup.warmup_steps)
    progress = min(1.0, (step - warmup.warmup_steps) / span)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_warmup(model_config: PolicyModelConfig, warmup: WarmupConfig, folder: Path) -> dict[str, Any]:
    """Fine-tune the tiny model of `model_config` on arena answers; save a transformers folder and
    return what the warm-up's meta file records."""
    import torch

    from hpref.models.causal_lm import build_policy_model
    from hpref.rl.policy import completion_logprobs, pad_batch

    if warmup.threads:
        torch.set_num_threads(warmup.threads)
    start = time.perf_counter()
    model, tokenizer = build_policy_model(model_config)
    model.train()
    examples = sft_examples(tokenizer, warmup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=warmup.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(warmup.seed)
    losses: list[float] = []
    tokens = 0
    for step in range(warmup.steps):
        for group in optimizer.param_groups:
            group["lr"] = warmup.lr * lr_multiplier(step, warmup)
        batch_examples = rng.sample(examples, min(warmup.batch_size, len(examples)))
        batch = pad_batch(
            [p for p, _ in batch_examples], [a for _, a in batch_examples], tokenizer.pad_token_id
        )
        # the trainer's own log-probs: the LM head on answer positions only, chunked (no [B, L, V] logits)
        logp = completion_logprobs(model, batch, 1.0)
        mask = batch["mask"]
        loss = -(logp * mask).sum() / mask.sum()  # answer tokens only: the prompt is given
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        tokens += int(mask.sum())
    seconds = time.perf_counter() - start
    tail = losses[-min(20, len(losses)) :]
    meta = {
        "format": WARMUP_FORMAT,
        "model": model_config.model_dump(mode="json"),
        "warmup": warmup.model_dump(mode="json"),
        "examples": len(examples),
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "answer_tokens": tokens,
        "seconds": seconds,
    }
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return meta


def warmup_checkpoint(
    model: PolicyModelConfig, warmup: WarmupConfig, lora: LoraSection | None = None
) -> Path:
    """The warm-up checkpoint of this model: from the cache, or trained now and cached. `lora`: the
    adapters a warm-up on a data file trains and merges (the arena's warm-up trains every weight)."""
    if not has_warmup(model, warmup):
        raise ValueError("a pretrained policy (model.name or model.path) starts from it; it has no warm-up")
    if warmup.path is None:
        lora = None
    final = checkpoint_folder(model, warmup, lora)
    if (final / META_FILE).is_file():
        logger.info(f"rl warm-up: using the cached checkpoint {final}")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    answers = "synthetic arena answers" if warmup.path is None else f"the answers of {warmup.path}"
    logger.info(f"rl warm-up: {warmup.steps} supervised steps on {answers} -> {final}")
    try:
        if warmup.path is None:
            meta = train_warmup(model, warmup, tmp)
        else:
            from hpref.rl.warmup import data as warmup_data

            meta = warmup_data.train_on_data(
                model, warmup, lora, tmp, schedule=lambda step: lr_multiplier(step, warmup)
            )
        # written last: its presence is what marks a folder as a finished warm-up (`is_cached`)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same warm-up first: theirs is equivalent
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    held_out = ""
    if meta.get("eval_loss_before") is not None:
        held_out = f", held-out loss {meta['eval_loss_before']:.3f} -> {meta['eval_loss_after']:.3f}"
    logger.info(
        f"rl warm-up: loss {meta['first_loss']:.2f} -> {meta['final_loss']:.2f}{held_out} in "
        f"{meta['seconds']:.0f} s"
    )
    return final
