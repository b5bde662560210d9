"""A causal LM to train or sample from: where its weights come from (a transformers folder, a GGUF
file converted once, or a seeded tiny Llama), its tokenizer, whether a folder can be one, and how a
conversation becomes the prompt it continues.

Shared by `hpref rl` (policies) and `hpref train` (offline DPO), which must not import each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpref.errors import UserError
from hpref.recipe.rl import PolicyModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_MIN_FREQUENCY = 2
TOKENIZER_SEED = 0
# hpref's tiny tokenizers have no chat template; these markers lay a conversation out instead
USER, ASSISTANT = "<|user|>", "<|assistant_a|>"


def policy_folder(model: PolicyModelConfig) -> str | None:
    """The transformers folder a pretrained policy loads: its `path`, or the cached causal-LM folder
    of a GGUF file (`model.name = "smollm2"`, or a `.gguf` path; converted once, under a file lock
    that makes concurrent actors wait for one conversion). None for a tiny random-init policy."""
    if model.name == "smollm2" or (model.path is not None and model.path.lower().endswith(".gguf")):
        from pathlib import Path

        from hpref.models.hf import gguf_folder, smollm2_file

        file = smollm2_file() if model.name == "smollm2" else Path(model.path or "").expanduser()
        if not file.is_file():
            raise UserError(f"model.path: GGUF file '{model.path}' does not exist")
        return str(gguf_folder(file, "causal-lm"))
    return model.path


def policy_tokenizer(model: PolicyModelConfig) -> Any:
    """The tokenizer of a policy: the folder's own, or hpref's cached tiny BPE."""
    folder = policy_folder(model)
    if folder is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
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

    from hpref.logs import route_transformers_logs

    # a load report, or the "Writing model shards" bar of a warm-up's save, goes to the log file
    route_transformers_logs()
    tokenizer = policy_tokenizer(model)
    folder = policy_folder(model)
    if folder is not None:
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
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


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: Any = None) -> list[int]:
    """Token ids that end an answer: the tokenizer's eos and every eos id of the model's generation
    config (an instruct model may stop on its end-of-turn token as well as on eos)."""
    ids = [tokenizer.eos_token_id]
    generation = getattr(model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None)
    ids.extend(extra if isinstance(extra, list) else [extra])
    return sorted({int(i) for i in ids if i is not None})


def causal_lm_problem(folder: str | None) -> str | None:
    """Why `folder` cannot be an `hpref rl` policy, or None: no config, not a causal LM, no tokenizer,
    or no chat template (unless its tokenizer is hpref's own, whose markers stand in for one)."""
    from pathlib import Path

    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if folder is None:
        return None
    if not (Path(folder) / "config.json").is_file():
        return "no config.json (expected a transformers causal-LM folder)"
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        return f"unreadable config.json ({str(exc).splitlines()[0]})"
    architectures = getattr(config, "architectures", None) or []
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
        architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    ):
        shown = ", ".join(architectures) or config.model_type
        return f"not a causal LM ({shown}); a policy needs a model with an LM head, e.g. *ForCausalLM"
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        return f"no tokenizer ({str(exc).splitlines()[0]})"
    if not getattr(tokenizer, "chat_template", None) and USER not in tokenizer.get_vocab():
        return (
            "its tokenizer has no chat template, so prompts cannot be laid out as a conversation; use an "
            "instruct model's folder, or add a chat_template to its tokenizer_config.json"
        )
    return None


def encode_prompt(tokenizer: PreTrainedTokenizerBase, turns: tuple[str, ...]) -> list[int]:
    """Token ids a policy continues: the conversation `turns` (user, assistant, ..., user) ending where
    the assistant's answer begins.

    With a chat template (a pretrained instruct model), the template lays it out with its generation
    prompt. hpref's tiny tokenizers have none: bos, then `<|user|>turn` for a user turn and
    `<|assistant_a|>turn<eos>` for an earlier answer, then the assistant marker.
    """
    if getattr(tokenizer, "chat_template", None):
        from hpref.data.prompts import conversation_messages

        ids = tokenizer.apply_chat_template(
            conversation_messages(turns), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)
    ids = [tokenizer.bos_token_id]
    for i, turn in enumerate(turns):
        ids.append(tokenizer.convert_tokens_to_ids(USER if i % 2 == 0 else ASSISTANT))
        ids.extend(tokenizer.encode(turn, add_special_tokens=False))
        if i % 2:
            ids.append(tokenizer.eos_token_id)
    ids.append(tokenizer.convert_tokens_to_ids(ASSISTANT))
    return ids


def turn_end_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token that closes an assistant turn in the policy's layout (its eos: the tiny layout's, and
    the chat templates' end-of-turn, `<|im_end|>` in SmolLM2's). An episode's turn cut at
    `max_new_tokens` gets it appended as context, so the next message starts where the template
    expects."""
    return int(tokenizer.eos_token_id)


def observation_ids(tokenizer: PreTrainedTokenizerBase, role: str, text: str) -> list[int]:
    """The tokens that follow a closed assistant turn when the next message is `text` from `role`
    ("tool" or "user"), up to where the assistant's next answer begins: what an episode appends to
    the transcript between two of the policy's turns, whose own tokens (its closing eos included)
    stay as it generated them.

    With a chat template: the template's rendering of a probe conversation with the message and its
    generation prompt, less the rendering without them up to the end of the probe answer: after its
    closing token when the template closes answers with the eos the policy generates (ChatML's
    `<|im_end|>`: whatever follows it, a newline, belongs to the observation), else right after its
    text (a template that closes answers with nothing, as hpref's tiny ones). A template that refuses
    a "tool" message renders it as a user message. Without a template: encode_prompt's layout."""
    if not getattr(tokenizer, "chat_template", None):
        ids = [tokenizer.convert_tokens_to_ids(USER)]
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        ids.append(tokenizer.convert_tokens_to_ids(ASSISTANT))
        return ids
    answer = "!"
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": answer}]

    def render(messages: list[dict[str, str]], generation: bool) -> list[int]:
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation, tokenize=True, return_dict=False
            )
        )

    before = render(probe, False)
    end = turn_end_id(tokenizer)
    if end in before:
        cut = len(before) - before[::-1].index(end)
    elif before[-1:] == tokenizer.encode(answer, add_special_tokens=False)[-1:]:
        cut = len(before)
    else:
        raise UserError(
            "the policy's chat template closes an assistant turn with neither its eos token "
            f"({tokenizer.convert_ids_to_tokens(end)!r}) nor nothing: multi-turn episodes cannot tell "
            "where a turn ends"
        )
    try:
        after = render([*probe, {"role": role, "content": text}], True)
    except Exception:  # a template that knows no tool role (jinja raises its own errors)
        if role == "user":
            raise
        after = render([*probe, {"role": "user", "content": text}], True)
    if after[:cut] != before[:cut]:
        raise UserError(
            "the policy's chat template renders earlier messages differently once another follows: "
            "multi-turn episodes need a template whose transcript only grows"
        )
    return after[cut:]
