"""A tiny tokenizer built in-process (never downloaded), with and without a chat template."""

from __future__ import annotations

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(chat_template: bool = True, texts: list[str] | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from hpref import arena as synthetic
    from hpref.data import formatting

    corpus = list(texts or []) + list(synthetic.corpus_texts(200, seed=0))
    corpus.append(formatting.DEFAULT_INSTRUCTION)
    corpus.append(
        "What is 12 + 30 ? Reverse the word apple . The answer is 42 41 . elppa elpap I hope this helps ! "
        "Sure Repeat after me : banana capital of France Good question Paris Rome zebra hi system a b"
    )
    corpus += ["Turn User Assistant A B Conversation Which answered better? Answer or tie. Verdict: ###"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    if not chat_template:  # plain mode: the tokenizer adds BOS itself
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat_template:
        wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


@pytest.fixture(scope="session")
def chat_tokenizer():
    return make_tokenizer(chat_template=True)


@pytest.fixture(scope="session")
def plain_tokenizer():
    return make_tokenizer(chat_template=False)
