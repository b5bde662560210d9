"""A policy of `hpref rl`: its causal LM and tokenizer, its prompts, and the padding maths of a step.

The engine and the trainer of one policy build the same model independently
(`hpref.models.causal_lm.build_policy_model`: a local folder, or a seeded tiny Llama), so version 0
needs no weight transfer; the causal-LM helpers (the prompt layout `encode_prompt`, the tokenizer,
the folder checks) are that module's, imported from it. Numbers live in small functions that tests
call directly (`trim_completion`, `stop_string_cut`, `pad_batch`, `group_batch`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hpref.errors import UserError
from hpref.recipe.rl import PolicyModelConfig, RLConfig

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase


def apply_env(env: dict[str, str] | None) -> None:
    """Set the driver's cache and offline variables in an actor's process, and bound oneDNN's
    per-shape cache before the actor's first matmul (`hpref.memory`: rollouts change shape every
    step, and uncapped that cache held ~0.6 GiB of a SmolLM2 trainer after five updates).

    Passed as an argument rather than a Ray `runtime_env`: a runtime env forces fresh worker
    processes, while plain arguments let Ray reuse its pre-started workers (seconds per actor).
    """
    from hpref.logs import quiet_actor_logs
    from hpref.memory import cap_onednn_cache

    os.environ.update(env or {})
    quiet_actor_logs()  # libraries' records to the run's actor log, not the driver's console
    cap_onednn_cache()


# --------------------------------------------------------------------------------------------------
# models and prompts


def policy_skeleton(model: PolicyModelConfig) -> Any:
    """The policy's causal LM on the meta device: its module tree without weights or a tokenizer
    (seconds less than a build), for checks of settings that depend on the architecture."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpref.models.causal_lm import policy_folder, tiny_policy_config

    folder = policy_folder(model)
    if folder is not None:
        config = AutoConfig.from_pretrained(folder)
    else:  # the vocabulary size is the target's; only the embedding's shape depends on it
        config = tiny_policy_config(model, vocab_size=model.vocab_size)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_policy_lora(config: RLConfig, policies: list[str], where: str, *, skip_paths: bool = False) -> None:
    """Before any actor starts: every LoRA policy's adapters can be injected into its LM (their
    `target_modules` name linear layers it has). A `RecipeError` of one line naming the policy.
    `skip_paths`: leave out policies whose model is a local folder (a check for another machine)."""
    from hpref.errors import RecipeError
    from hpref.models.lm_adapters import apply_lora_to_causal_lm

    for p in policies:
        policy = config.policies[p]
        if policy.lora is None or (skip_paths and policy.model.pretrained):
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


def check_policy_models(config: RLConfig, policies: list[str], where: str) -> None:
    """Before any actor starts: every pretrained policy's folder holds a causal LM (a class with an LM
    head that transformers can generate from) and a tokenizer with a chat template (its prompts are
    conversations). A `RecipeError` of one line naming the policy and the folder."""
    from hpref.errors import RecipeError
    from hpref.models.causal_lm import causal_lm_problem, policy_folder

    for p in policies:
        model = config.policies[p].model
        if not model.pretrained:
            continue
        key = f"{where}: rl.policies.{p}.model.{'name' if model.name else 'path'}"
        try:
            folder = policy_folder(model)
            reason = causal_lm_problem(folder)
        except UserError as exc:
            raise RecipeError(f"{key}: {exc}") from None
        if reason:
            raise RecipeError(f"{key}: {folder}: {reason}")


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: nn.Module | None = None) -> list[int]:
    """`hpref.models.causal_lm.stop_token_ids` (which an export writes into its generation config),
    kept importable here without importing torch: the engines' plugin module imports this name."""
    from hpref.models.causal_lm import stop_token_ids as stop_ids

    return stop_ids(tokenizer, model)


def trim_completion(tokens: list[int], stop_ids: int | list[int], pad_id: int) -> list[int]:
    """A sampled continuation up to and including the first stop token (the policy must learn to
    stop, so the stop token is trained on); padding after it is dropped."""
    stops = {stop_ids} if isinstance(stop_ids, int) else set(stop_ids)
    out = []
    for t in tokens:
        if t in stops:
            out.append(t)
            break
        if t == pad_id:
            break
        out.append(t)
    return out


def stop_string_cut(tokenizer: PreTrainedTokenizerBase, tokens: list[int], stop: Sequence[str]) -> int:
    """How many of an answer's `tokens` stay when it ends at a stop string (`[rl.rollout] stop`).

    The answer ends where a stop string first completes in its text (the earliest end, ties in the
    list's order: vLLM's rule), without the stop string; the tokens kept are those whose text lies
    wholly before it, so the answer's text is exactly its tokens' text and the trainer trains on
    those tokens, with their engine log-probs. A token holding text before the stop string and its
    first characters goes with the stop string (vLLM's text keeps those characters, its tokens the
    whole token). All of them when no stop string appears."""
    if not stop:
        return len(tokens)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    ends = [(text.find(s) + len(s), i) for i, s in enumerate(stop) if s in text]
    if not ends:
        return len(tokens)
    end, first = min(ends)
    start = end - len(stop[first])
    keep = len(tokens) - 1  # the whole answer holds the stop string
    while keep > 0:
        head = tokenizer.decode(tokens[:keep], skip_special_tokens=True)
        if len(head) <= start and text.startswith(head):
            break
        keep -= 1
    return keep


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices grouped into micro-batches of at most `budget` padded tokens (rows x the longest
    row), rows sorted by length so each batch pads little; a row longer than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks: list[list[int]] = []
    for i in order:
        if chunks and (len(chunks[-1]) + 1) * lengths[i] <= budget:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def left_padded(rows: list[list[int]], width: int, pad: int) -> tuple[Any, Any]:
    """`[B, width]` ids and attention mask with every row's tokens at the right end, so every row's
    continuation starts at column `width`."""
    import torch

    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r)
        attention[i, width - len(r) :] = 1
    return input_ids, attention


def pad_batch(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    masks: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Right-padded `[B, L]` tensors of prompt + completion, for one teacher-forced forward pass.

    `targets[:, t]` is the token at t + 1 and `mask[:, t]` is 1 where that token is a completion token
    (with `masks`, one of the completion's 1s: an episode's own tokens, not its observations): logits
    at position t predict it. Prompt tokens and padding never count.
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
        mask[i, len(p) - 1 : len(row) - 1] = (
            1.0 if masks is None else torch.tensor(masks[i], dtype=torch.float32)
        )
    return {"input_ids": input_ids, "attention_mask": attention, "targets": input_ids[:, 1:], "mask": mask}


def completion_logprobs(
    model: nn.Module, batch: dict[str, Any], temperature: float, *, entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the batch's answer tokens under `model` at `temperature` (the
    sampling distribution the engine drew from), shaped like the batch's `mask` and zero where it is
    0: `[B, L-1]` for a `pad_batch`, `[B, Wc]` for a `group_batch` or a `packed_batch`
    (`shares_prefix` models only).

    With `entropy`: (log-probs, entropy), the second the entropy of that distribution at each
    answer position, shaped the same, from the logits the log-probs come from (no second forward
    pass; without gradient, chunk by chunk with the log-probs: `hpref.models.head_logprobs`). A second value
    returned rather than an output argument: FSDP2's root copies the containers it is called with
    when it moves them to the GPU (`hpref.rl.trainer.sharding`'s `LogProbsRoot`).

    A transformers causal LM runs its decoder over every position (the answer attends to the
    prompt) but its LM head only where a completion token is predicted: with a 49k-token vocabulary
    the logits of a few hundred prompt tokens per row would otherwise be most of the step's memory
    and a fifth of its FLOPs, for values the loss never reads; and the head runs in chunks of tokens
    whose logits are recomputed in the backward (`hpref.models.head_logprobs`), so not even the
    answers' `[N, V]` logits are held. Other models (the megatron trainer) give full logits."""
    from transformers import PreTrainedModel

    from hpref.models.pair_logprobs import prefix_packed_hidden, use_varlen_attention
    from hpref.rl.logprobs import sequence_logprobs, token_entropy

    if isinstance(model, PreTrainedModel):  # a padded layout's mask needs the attention it was built with
        use_varlen_attention(model, "predict_at" in batch)
    if "group_size" in batch:  # a `group_batch`: each prompt once, its answers on its KV cache
        return _grouped_logprobs(model, batch, temperature, entropy)
    mask = batch["mask"].bool()
    if "predict_at" in batch:  # a `packed_batch`: padding-free, each prompt once before its answers
        hidden = prefix_packed_hidden(model, batch)[batch["predict_at"]]
        return _answer_logprobs(
            hidden, model.get_output_embeddings(), batch["targets"], mask, temperature, entropy
        )
    # a transformers causal LM (LoRA injected in place included); a PEFT wrapper or megatron: full logits
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    decoder = model.get_decoder() if head is not None else None
    if decoder is None or head is None:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        logprobs = sequence_logprobs(logits / temperature, batch["targets"]) * batch["mask"]
        if not entropy:
            return logprobs
        return logprobs, on_mask(mask, token_entropy(logits.detach()[mask], temperature))
    hidden = decoder(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).last_hidden_state[:, :-1]
    return _answer_logprobs(hidden[mask], head, batch["targets"][mask], mask, temperature, entropy)


def _answer_logprobs(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
    entropy: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The log-probs of `targets` under `head` over the answer positions' `hidden [N, H]` at
    `temperature`, placed where `mask` is true, zero elsewhere; with `entropy` their entropies too.
    A plain linear head goes through `hpref.models.head_logprobs` (chunked over tokens, the `[N, V]`
    logits never held, forward or backward); another head (a LoRA'd one) gives its logits."""
    from hpref.models.head_logprobs import fusable_head, head_logprobs
    from hpref.rl.logprobs import sequence_logprobs, token_entropy

    if fusable_head(head):
        logprobs, entropies = head_logprobs(hidden, head, targets, temperature, entropy=entropy)
        return (on_mask(mask, logprobs), on_mask(mask, entropies)) if entropy else on_mask(mask, logprobs)
    logits = head(hidden) / temperature
    logprobs = on_mask(mask, sequence_logprobs(logits, targets))
    return (logprobs, on_mask(mask, token_entropy(logits))) if entropy else logprobs


def on_mask(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` (one per true entry of `mask`, in order) in a zero tensor of `mask`'s shape."""
    import torch

    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def shares_prefix(model: nn.Module) -> bool:
    """Whether `completion_logprobs` can run `model` on a `group_batch` (a transformers causal LM:
    it takes a KV cache; the megatron trainer's model does not and gets `pad_batch`es)."""
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel) and model.get_output_embeddings() is not None


def whole_groups(prompts: list[list[int]], group_size: int) -> bool:
    """Whether the rows are consecutive groups of `group_size` answers to one prompt each (what a
    `group_batch` needs; GRPO rollouts are laid out so)."""
    if group_size < 1 or len(prompts) % group_size:
        return False
    return all(prompts[i] == prompts[i - i % group_size] for i in range(len(prompts)))


def group_batch(
    prompts: list[list[int]],
    completions: list[list[int]],
    group_size: int,
    pad_id: int,
    masks: list[list[int]] | None = None,
) -> dict[str, Any] | None:
    """A rollout's rows as prompt groups: each of the `G` distinct prompts once, left-padded
    (`prompt_ids`, `prompt_attention` `[G, Wp]`), and its `group_size` answers right-padded
    (`completion_ids`, `mask` `[G * group_size, Wc]`); `mask[i, t]` is 1 where column t is one of
    row i's answer tokens (with `masks`, one of its 1s: an episode's own tokens; its observations
    are in `completion_ids` as context). None when the rows are not whole groups of one prompt each.

    GRPO samples `group_size` answers per prompt, and HH-RLHF prompts with a chat template are
    several times longer than 64-token answers: a `pad_batch` runs every prompt `group_size` times
    through the decoder, forward and backward. Here the prompt runs once and its answers attend to
    its KV cache, so a rollout costs about a quarter of the decoder tokens at group size 4."""
    import torch

    if not whole_groups(prompts, group_size):
        return None
    heads = prompts[::group_size]
    prompt_ids, prompt_attention = left_padded(heads, max(len(p) for p in heads), pad_id)
    width = max(max(len(c) for c in completions), 1)
    completion_ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(completions), width), dtype=torch.float32)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, : len(c)] = 1.0 if masks is None else torch.tensor(masks[i], dtype=torch.float32)
    return {
        "prompt_ids": prompt_ids,
        "prompt_attention": prompt_attention,
        "completion_ids": completion_ids,
        "mask": mask,
        "group_size": group_size,
    }


def packed_batch(
    prompts: list[list[int]],
    completions: list[list[int]],
    group_size: int,
    masks: list[list[int]] | None = None,
) -> dict[str, Any]:
    """A rollout's rows without padding (`hpref.models.pair_logprobs.pack_prefix_groups`): whole
    groups of `group_size` answers to one prompt as one packed sequence each, the prompt once and
    every answer (an episode: its transcript) attending to it and to itself only; other rows one
    sequence each. `mask [B, Wc]` is a `group_batch`'s (1 on row i's answer tokens, or its `masks`'
    1s: an episode's own tokens), and what `completion_logprobs` returns is shaped like it;
    `predict_at` and `targets` `[M]` are the packed positions predicting those tokens and the tokens."""
    import torch

    from hpref.models.pair_logprobs import pack_prefix_groups

    size = group_size if group_size > 1 and whole_groups(prompts, group_size) else 1
    groups = [completions[g : g + size] for g in range(0, len(completions), size)]
    batch = pack_prefix_groups(prompts[::size], groups)
    width = max(max(len(c) for c in completions), 1)
    mask = torch.zeros((len(completions), width), dtype=torch.float32)
    answer = torch.zeros((len(completions), width), dtype=torch.bool)
    for i, c in enumerate(completions):
        mask[i, : len(c)] = 1.0 if masks is None else torch.tensor(masks[i], dtype=torch.float32)
        answer[i, : len(c)] = True
    keep = mask.bool()[answer]  # predict_at's entries (every answer token, row by row) that count
    batch["predict_at"] = batch["predict_at"][keep]
    batch["targets"] = torch.tensor([t for c in completions for t in c], dtype=torch.long)[keep]
    batch["mask"] = mask
    return batch


def cache_keyword(module: nn.Module) -> str:
    """The name `module.forward` (and `generate`) takes a KV cache under: transformers renamed
    `past_key_values` to `cache` in 5.2x (the old name deprecated, not gone), and vLLM's CPU build
    pins transformers below 5.20, so both must work."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _grouped_logprobs(
    model: nn.Module, batch: dict[str, Any], temperature: float, entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`completion_logprobs` of a `group_batch`: the prompts' forward keeps its KV cache (with its
    autograd graph, so the prompt positions' weights still get the answers' gradients), the cache is
    repeated per answer, and the answers run against it. The first answer token is predicted by
    the prompt's last hidden state, each later one by the answer position before it."""
    import torch

    group = batch["group_size"]
    prompt_attention = batch["prompt_attention"]
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    positions = (prompt_attention.cumsum(-1) - 1).clamp(min=0)
    prompt = decoder(
        input_ids=batch["prompt_ids"],
        attention_mask=prompt_attention,
        position_ids=positions,
        use_cache=True,
    )
    last = prompt.last_hidden_state[:, -1:].repeat_interleave(group, dim=0)  # [B, 1, H]
    answers = batch["completion_ids"]
    if answers.shape[1] > 1:
        cache = prompt.past_key_values
        cache.batch_repeat_interleave(group)
        lengths = prompt_attention.sum(-1, keepdim=True).repeat_interleave(group, dim=0)
        inputs = answers[:, :-1]
        attention = torch.cat(
            [prompt_attention.repeat_interleave(group, dim=0), torch.ones_like(inputs)], dim=1
        )
        steps = torch.arange(inputs.shape[1], device=inputs.device)
        hidden = decoder(
            input_ids=inputs,
            attention_mask=attention,
            position_ids=lengths + steps,
            use_cache=True,
            **{cache_keyword(decoder): cache},
        ).last_hidden_state
        last = torch.cat([last, hidden], dim=1)
    mask = batch["mask"].bool()
    return _answer_logprobs(last[mask], head, answers[mask], mask, temperature, entropy)
