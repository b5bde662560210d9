"""The supervised warm-up: the starting checkpoint of tiny policies, made by hpref itself.

A random-init tiny Llama writes token soup, so its first rollouts carry no signal a reward could
rank. The warm-up fine-tunes it on the synthetic arena's answers (the simulated assistants' answers
to single-turn prompts, right and wrong ones alike) so that its first rollouts are already answers,
some right, some near misses: room for RL to improve and a fair starting policy to measure against.

    [rl.warmup]              # policies without model.path start from the warm-up of their model
    steps = 300
    batch_size = 32
    lr = 3e-3

`warmup_checkpoint(model, warmup)` returns the folder of the checkpoint, training it on first use.
It is cached under `<HPREF_CACHE>/rl-warmup/<hash of model + warm-up settings>` (written under a
temporary name and renamed into place, like the tokenizer cache), so a second run, or a second
policy with the same model settings, reuses it. `hpref rl-warmup RECIPE` builds them ahead of time.
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from hpref.recipe.rl import PolicyModelConfig, WarmupConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

WARMUP_FORMAT = 1  # bump when the warm-up's data or training changes, so caches are not reused
META_FILE = "hpref_warmup.json"


def cache_key(model: PolicyModelConfig, warmup: WarmupConfig) -> str:
    payload = {
        "format": WARMUP_FORMAT,
        "model": model.model_dump(mode="json"),
        "warmup": warmup.model_dump(mode="json", exclude={"threads"}),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_folder(model: PolicyModelConfig, warmup: WarmupConfig) -> Path:
    from hpref.models.tokenizer import cache_root

    return cache_root() / "rl-warmup" / cache_key(model, warmup)


def is_cached(model: PolicyModelConfig, warmup: WarmupConfig) -> bool:
    return (checkpoint_folder(model, warmup) / META_FILE).is_file()


def sft_examples(
    tokenizer: PreTrainedTokenizerBase, warmup: WarmupConfig
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + eos) pairs from single-turn arena battles.

    Prompts are encoded exactly as the engine encodes a rollout's prompt (`encode_prompt`), so the
    policy learns to answer in the position it will be sampled from.
    """
    from hpref.arena import generate_battles
    from hpref.rl.policy import encode_prompt

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
    """Fine-tune the tiny model of `model_config` on arena answers; save a transformers folder."""
    import torch

    from hpref.rl.algorithms import sequence_logprobs
    from hpref.rl.policy import build_policy_model, pad_batch

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
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        logp = sequence_logprobs(logits, batch["targets"])
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
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def warmup_checkpoint(model: PolicyModelConfig, warmup: WarmupConfig) -> Path:
    """The warm-up checkpoint of this tiny model: from the cache, or trained now and cached."""
    if model.pretrained:
        raise ValueError("a pretrained policy (model.name or model.path) starts from it; it has no warm-up")
    final = checkpoint_folder(model, warmup)
    if (final / META_FILE).is_file():
        logger.info(f"rl warm-up: using the cached checkpoint {final}")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    logger.info(f"rl warm-up: {warmup.steps} supervised steps on synthetic arena answers -> {final}")
    try:
        meta = train_warmup(model, warmup, tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same warm-up first: theirs is equivalent
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        f"rl warm-up: loss {meta['first_loss']:.2f} -> {meta['final_loss']:.2f} in {meta['seconds']:.0f} s"
    )
    return final
