"""A policy of `hpref rl`: its causal LM and tokenizer, its prompts, and the padding maths of a step.

The engine and the trainer of one policy build the same model independently (`build_policy_model`:
a local folder, or a seeded tiny Llama), so version 0 needs no weight transfer. Numbers live in
small functions that tests call directly (`encode_prompt`, `trim_completion`, `pad_batch`).
"""

from __future__ import annotations

import os
from typing import Any

from hpref.errors import UserError
from hpref.recipe_rl import PolicyModelConfig, RLConfig

TOKENIZER_MIN_FREQUENCY = 2
TOKENIZER_SEED = 0
USER, ASSISTANT = "<|user|>", "<|assistant_a|>"


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
    from hpref.models.lm_adapters import apply_lora_to_causal_lm

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
