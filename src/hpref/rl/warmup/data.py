"""The warm-up on a user's own answers (`[rl.warmup] path = ...`, `hpref.recipe.rl_warmup`): a
supervised fine-tune of any policy, tiny or pretrained, before RL.

    rows --PairwiseReader (the chosen side) | ChatReader (the last assistant message)--> battles
    battle --chosen_conversation--> (prompt turns, answer)
           --encode_example: the prompt as the engine lays it out, the answer, eos--> one sequence
           --unit_hash(prompt) < eval_fraction--> held out (the first eval_rows by hash) | train
    train --plan_steps: batch_size rows a step in token-budget, padding-free micro-batches-->
          PackedLogProbs: the answer tokens' log-probs --> mean answer-token NLL --> one AdamW step

What is learnt. Only the answer's tokens are in the loss. The prompt is `hpref.models.causal_lm.
encode_prompt`'s, the very ids the engine continues for a rollout (the chat template with its
generation prompt), so the policy learns to answer from the position it is sampled from, and to end
with eos, where the engine stops. Rows are held out by a hash of the prompt, as `hpref.data.prompts.
PromptSet` holds out eval prompts: with the same file, `eval_fraction` and `split_seed` as
`[rl.prompts]`, the warm-up never trains on a prompt the rl evals ask. The held-out loss (mean
answer-token negative log-likelihood, nats) is measured before the first step and after the last,
logged and written into the checkpoint's meta file (`hpref.rl.warmup.supervised.META_FILE`).

LoRA. A policy with adapters warms up adapters of its own settings (drawn under the warm-up's seed)
and the checkpoint is the merged model, a plain causal-LM folder: every engine (transformers, vLLM)
and trainer backend (transformers, megatron) starts from it as from any `model.path`, the rl
adapters start fresh on top of it, so version 0 is the warm-up exactly and a LoRA policy's KL
reference (its adapters off) is the warm-up, not the base it came from. Base + adapter would need
each engine and trainer to load an adapter as its start, and "adapters off" would be the un-warmed
base. The cost is a copy of the weights per warm-up.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from hpref.data.base import BattleSource, file_digest
from hpref.data.prompts import Prompt, prompt_of_battle, unit_hash
from hpref.data.readers import ChatConfig, ChatReader, PairwiseConfig, PairwiseReader
from hpref.data.records import Battle
from hpref.data.tables import TableFile
from hpref.errors import DataError, RecipeError
from hpref.recipe.rl import PolicyModelConfig, WarmupConfig
from hpref.recipe.rl_warmup import SYNTHETIC_KEYS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hpref.data.packing import StepPlan, TokenizedExample
    from hpref.recipe.schema import LoraSection

DATA_WARMUP_FORMAT = 1  # bump when this warm-up's data or training changes, so caches are not reused


# --------------------------------------------------------------------------------------------------
# the data


def open_source(warmup: WarmupConfig) -> BattleSource:
    """The reader of `warmup.path`: a pair file when it has the chosen column, else a chat file with
    the messages column; a `DataError` naming the file when it is missing or has neither."""
    assert warmup.path is not None
    file = TableFile(warmup.path, warmup.format)
    common = {
        "path": warmup.path,
        "format": warmup.format,
        "on_error": warmup.on_error,
        "limit": warmup.limit,
    }
    if warmup.chosen_column in file.columns:
        columns = {k: getattr(warmup, k) for k in ("prompt_column", "chosen_column", "rejected_column")}
        return PairwiseReader(PairwiseConfig(**common, **columns), seed=0)
    if warmup.messages_column in file.columns:
        return ChatReader(ChatConfig(**common, messages_column=warmup.messages_column))
    raise DataError(
        f"{file.path}: no '{warmup.chosen_column}' column (a pair file, whose chosen side is learnt) or "
        f"'{warmup.messages_column}' column (a chat file) (found: {', '.join(file.columns) or 'none'})"
    )


def check_source(warmup: WarmupConfig | None, where: str) -> None:
    """Before anything starts: the warm-up's data file exists and has the columns it needs; else a
    `RecipeError` of one line naming `rl.warmup.path` (its rows are read when it trains)."""
    if warmup is None or warmup.path is None:
        return
    try:
        open_source(warmup)
    except DataError as exc:
        raise RecipeError(f"{where}: rl.warmup.path: {exc}") from None


def chosen_conversation(battle: Battle) -> tuple[Prompt, str]:
    """The conversation before the preferred final answer (with the preferred side's earlier
    answers) and that answer; an unlabelled battle's side A (a chat file's only side)."""
    b_wins = battle.label is not None and battle.label[1] > battle.label[0]
    side = battle.response_b if b_wins else battle.response_a
    return prompt_of_battle(replace(battle, response_a=side)), side[-1]


def encode_example(
    tokenizer: Any, prompt: Prompt, answer: str, max_length: int
) -> tuple[list[int], int] | None:
    """(prompt + answer ids, prompt length): the prompt as the engine encodes it, the answer's tokens
    and eos, cut to `max_length` (the start kept); None when the prompt alone leaves no room."""
    from hpref.models.causal_lm import encode_prompt

    prompt_ids = encode_prompt(tokenizer, prompt)
    if len(prompt_ids) >= max_length:
        return None
    answer_ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
    return [*prompt_ids, *answer_ids][:max_length], len(prompt_ids)


@dataclass
class SftData:
    """Tokenized prompt + answer sequences; example i's answer starts at `prompt_lengths[i]`."""

    examples: list[TokenizedExample] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)

    def add(self, ids: list[int], prompt_length: int) -> None:
        import numpy as np

        from hpref.data.packing import TokenizedExample

        self.examples.append(
            TokenizedExample(ids=np.asarray(ids, dtype=np.int32), label=None, row=len(self.examples))
        )
        self.prompt_lengths.append(prompt_length)

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def lengths(self) -> list[int]:
        return [len(e) for e in self.examples]

    def answer_tokens(self, indices: Sequence[int] | None = None) -> int:
        """Answer tokens (eos included) of `indices` (default: every example): a loss's denominator."""
        chosen = range(len(self)) if indices is None else indices
        return sum(len(self.examples[i]) - self.prompt_lengths[i] for i in chosen)


@dataclass
class WarmupData:
    source: str
    train: SftData
    held_out: SftData
    counts: Counter[str]


def read_examples(warmup: WarmupConfig, tokenizer: Any, positions: int | None = None) -> WarmupData:
    """The file's (prompt, answer) rows tokenized and split (see the module docstring), each at most
    `max_length` tokens (and the model's `positions`); rows left out are counted in the log line. A
    `DataError` when no row is left to train on."""
    reader = open_source(warmup)
    max_length = min(warmup.max_length, positions or warmup.max_length)
    counts: Counter[str] = Counter()
    train = SftData()
    held: list[tuple[float, list[int], int]] = []
    for battle in reader.battles():
        counts["read"] += 1
        prompt, answer = chosen_conversation(battle)
        if not prompt or not prompt[-1].strip():
            counts["no user turn to answer"] += 1
            continue
        if not answer.strip():
            counts["empty answer"] += 1
            continue
        encoded = encode_example(tokenizer, prompt, answer, max_length)
        if encoded is None:
            counts[f"prompt of {max_length} tokens or more (max_length)"] += 1
            continue
        position = unit_hash(prompt, warmup.split_seed)
        if position < warmup.eval_fraction:
            held.append((position, *encoded))
        else:
            train.add(*encoded)
    held_out = SftData()
    for _, ids, prompt_length in sorted(held, key=lambda h: h[0])[: warmup.eval_rows]:
        held_out.add(ids, prompt_length)  # the first by hash: the same rows whatever the file's order
    counts["train"], counts["held out"] = len(train), len(held)
    left_out = {k: v for k, v in counts.items() if k not in ("read", "train", "held out")}
    detail = "; ".join(f"{n} {reason}" for reason, n in sorted(left_out.items()))
    if not train.examples:
        raise DataError(
            f"rl.warmup.path: {reader.source}: no usable rows to train on ({counts['read']} read, "
            f"{len(held)} held out{'; left out: ' + detail if detail else ''})"
        )
    logger.info(
        f"rl warm-up data from {reader.source}: {counts['read']} rows, {len(train)} train, {len(held)} "
        f"held out ({len(held_out)} measured)" + (f"; left out: {detail}" if detail else "")
    )
    return WarmupData(reader.source, train, held_out, counts)


# --------------------------------------------------------------------------------------------------
# the loss


def packed_answers(data: SftData, indices: Sequence[int]) -> tuple[Any, ...]:
    """`PackedLogProbs`' inputs for `data.examples[indices]` packed back to back: (input_ids,
    position_ids, cu_seqlens, max_seqlen, predict_at, sequence_of); the token after each `predict_at`
    is an answer token, and every answer token is one (`answer_positions`)."""
    from hpref.data.packing import collate
    from hpref.models.pair_logprobs import answer_positions

    batch = collate([data.examples[i] for i in indices])
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    at, of = answer_positions(lengths, [data.prompt_lengths[i] for i in indices])
    return batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen, at, of


def answer_nll(root: nn.Module, data: SftData, indices: Sequence[int]) -> torch.Tensor:
    """The summed negative log-likelihood of the answer tokens of `data.examples[indices]` under
    `root` (a `PackedLogProbs`), in one packed forward."""
    return -root(*packed_answers(data, indices)).sum()


def heldout_loss(root: nn.Module, data: SftData, micro_batch_tokens: int) -> float | None:
    """The mean answer-token NLL (nats) over every example of `data`, without gradient; None for none."""
    import torch

    from hpref.data.packing import plan_eval

    if not data.examples:
        return None
    plan = plan_eval(data.lengths, world_size=1, micro_batch_tokens=micro_batch_tokens)
    was_training = root.training
    root.eval()
    with torch.no_grad():
        total = sum(float(answer_nll(root, data, mb)) for mb in plan.for_rank(0) if min(mb) >= 0)
    root.train(was_training)
    return total / data.answer_tokens()


def step_plans(data: SftData, warmup: WarmupConfig) -> Iterator[StepPlan]:
    """Endless steps of `batch_size` rows (all rows when fewer), epoch after epoch in an order seeded by
    (seed, epoch), each in micro-batches of at most `micro_batch_tokens` (`hpref.data.packing`)."""
    from hpref.data.packing import plan_steps

    n = len(data)
    epoch = 0
    while True:
        yield from plan_steps(
            data.lengths,
            list(range(n)),
            [False] * n,
            batch_size=min(warmup.batch_size, n),
            world_size=1,
            micro_batch_tokens=warmup.micro_batch_tokens,
            seed=warmup.seed,
            epoch=epoch,
            swap="none",
            drop_last=True,  # steps of equal rows; the rows one pass leaves out, another takes
        )
        epoch += 1


# --------------------------------------------------------------------------------------------------
# the cache key and the run


def model_identity(model: PolicyModelConfig) -> dict[str, Any]:
    """What a warm-up's start is: a tiny model's settings, or a pretrained model's folder with its
    files' sizes and modification times (a folder replaced in place gets a new warm-up; hashing
    gigabytes of weights on every run would cost more than it saves)."""
    if not model.pretrained:
        return model.model_dump(mode="json")
    from hpref.models.causal_lm import policy_folder

    folder = Path(str(policy_folder(model))).expanduser().resolve()
    files = {
        f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(folder.iterdir()) if f.is_file()
    }
    return {"folder": str(folder), "files": files}


def data_key(model: PolicyModelConfig, warmup: WarmupConfig, lora: LoraSection | None) -> dict[str, Any]:
    """What a warm-up on a data file is a function of (`hpref.rl.warmup.supervised.cache_key` hashes it): the
    start, the adapters, the settings that change the result, and the file's bytes."""
    assert warmup.path is not None
    return {
        "format": DATA_WARMUP_FORMAT,
        "model": model_identity(model),
        "lora": None if lora is None else lora.model_dump(mode="json"),
        "warmup": warmup.model_dump(mode="json", exclude={"threads", "path", *SYNTHETIC_KEYS}),
        "data": file_digest(Path(warmup.path).expanduser()),
    }


def train_on_data(
    model_config: PolicyModelConfig,
    warmup: WarmupConfig,
    lora: LoraSection | None,
    folder: Path,
    *,
    schedule: Callable[[int], float],
) -> dict[str, Any]:
    """Fine-tune the policy of `model_config` (its `lora` adapters, or every weight) on the answers
    of `warmup.path`; save the (merged) causal LM and its tokenizer in `folder` and return what the
    meta file records. `schedule(step)`: the learning rate's multiplier at `step`."""
    import torch

    from hpref.models.attention import register_varlen_attention
    from hpref.models.causal_lm import build_policy_model
    from hpref.models.pair_logprobs import PackedLogProbs

    if warmup.threads:
        torch.set_num_threads(warmup.threads)
    start = time.perf_counter()
    lm, tokenizer = build_policy_model(model_config)
    positions = getattr(lm.config, "max_position_embeddings", None)
    data = read_examples(warmup, tokenizer, positions if isinstance(positions, int) else None)
    attention = lm.config._attn_implementation
    lm.set_attn_implementation(register_varlen_attention())  # packed sequences never attend across
    peft_model = None
    if lora is not None:
        from hpref.models.lm_adapters import apply_lora_to_causal_lm

        peft_model = apply_lora_to_causal_lm(lm, lora, seed=warmup.seed)
    root = PackedLogProbs(lm)
    trainable = [p for p in lm.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=warmup.lr, betas=(0.9, 0.95), weight_decay=0.0)
    before = heldout_loss(root, data.held_out, warmup.micro_batch_tokens)
    root.train()
    losses: list[float] = []
    tokens = 0
    for step, plan in enumerate(islice(step_plans(data.train, warmup), warmup.steps)):
        for group in optimizer.param_groups:
            group["lr"] = warmup.lr * schedule(step)
        micro = plan.for_rank(0)
        step_tokens = data.train.answer_tokens([i for mb in micro for i in mb])
        total = 0.0
        for indices in micro:
            nll = answer_nll(root, data.train, indices)
            # the step's mean answer-token loss, whatever the packing: a long answer weighs its tokens
            (nll / step_tokens).backward()
            total += float(nll.detach())
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / step_tokens)
        tokens += step_tokens
        if (step + 1) % max(1, warmup.steps // 10) == 0:  # a pretrained model's warm-up takes minutes
            logger.info(f"rl warm-up: step {step + 1}/{warmup.steps}, loss {losses[-1]:.3f}")
    after = heldout_loss(root, data.held_out, warmup.micro_batch_tokens)
    if peft_model is not None:
        lm = peft_model.merge_and_unload()
    lm.set_attn_implementation(attention)  # the engines load the folder with transformers' attention
    lm.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tail = losses[-min(20, len(losses)) :]
    return {
        "format": DATA_WARMUP_FORMAT,
        "source": data.source,
        "data_digest": file_digest(Path(data.source)),
        "model": model_config.model_dump(mode="json"),
        "lora": None if lora is None else lora.model_dump(mode="json"),
        "checkpoint": "merged LoRA" if lora is not None else "every weight trained",
        "warmup": warmup.model_dump(mode="json"),
        "rows": dict(data.counts),
        "examples": len(data.train),
        "held_out_measured": len(data.held_out),
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "eval_loss_before": before,
        "eval_loss_after": after,
        "answer_tokens": tokens,
        "seconds": time.perf_counter() - start,
    }
