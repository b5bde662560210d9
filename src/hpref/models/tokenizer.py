"""A small byte-level BPE tokenizer the project trains itself, cached on disk by its settings.

The tiny models must run with no download at all, so their tokenizer is trained here with the
`tokenizers` library on the synthetic arena's text (`hpref.arena.corpus_texts`) when the
data layer provides it, else on a small built-in corpus. Byte-level BPE never produces an unknown
token, so any text — including the real arena's — is encodable, just less compactly.

Training takes seconds, and every rank of a run needs the same tokenizer, so the result is saved
under `<cache>/tokenizers/<hash of the settings and text source>`; the folder is written under a
temporary name and renamed into place, so concurrent ranks never read a half-written one, and every
caller loads from the final folder (the winner of a race), never from its own in-memory copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from hpref.cache_root import cache_root

TOKENIZER_FORMAT = 3  # bump when training or the saved chat template changes: old caches must not be reused

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_ROLES = ("user", "assistant_a", "assistant_b", "verdict")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in CHAT_ROLES)
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)  # pad is id 0

#: `apply_chat_template` for a battle: bos, then `<|role|>content` per message; the generation prompt
#: is the verdict marker, the token whose last hidden state a decoder's head reads. The plain chat
#: role "assistant" (a reward model's `answers` formatter, an RL policy's answer) is written as
#: `<|assistant_a|>`: there is no `<|assistant|>` token, and rendering one would spell it out as
#: nine text pieces in every sequence, about a third of a short single-turn one.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant_a|>{% else %}<|{{ message['role'] }}|>{% endif %}"
    "{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|verdict|>{% endif %}"
)

TextSource = Callable[[int, int], Iterable[str]]  # (n, seed) -> texts


def default_text_source() -> tuple[str, TextSource]:
    """The synthetic arena's text if the data layer has it, else the built-in corpus.

    The name returned goes into the cache key, so the two sources never share a cache entry; the
    data layer may expose `CORPUS_VERSION` to invalidate caches when its text generator changes.
    """
    try:
        from hpref import arena as synthetic
    except ImportError:
        return "builtin", builtin_corpus_texts
    corpus = getattr(synthetic, "corpus_texts", None)
    if corpus is None:
        return "builtin", builtin_corpus_texts
    return f"hpref.data.synthetic:{getattr(synthetic, 'CORPUS_VERSION', 0)}", corpus


_TOPICS = (
    "python lists",
    "sourdough bread",
    "the french revolution",
    "black holes",
    "tax returns",
    "a job interview",
    "climate change",
    "chess openings",
    "sql joins",
    "a birthday poem",
    "marathon training",
    "the roman empire",
    "photosynthesis",
    "a cover letter",
    "git rebase",
    "quantum computing",
    "a wedding toast",
    "houseplants",
    "machine learning",
    "the stock market",
    "a haiku about autumn",
    "linear algebra",
    "a vegan lasagna",
)
_ASKS = (
    "Explain {t} to a beginner.",
    "Write a short story about {t}.",
    "What are common mistakes with {t}?",
    "Give me three tips about {t}.",
    "Summarise {t} in one paragraph.",
    "Why do people find {t} hard?",
    "Compare two approaches to {t}.",
    "Can you help me with {t}? I am stuck.",
)
_OPENERS = (
    "Sure! Here is an overview.",
    "Great question.",
    "I cannot help with that.",
    "Let me explain step by step.",
    "Here are a few ideas:",
    "In short:",
    "As an AI language model, I think",
    "Of course.",
)
_BODY = (
    "First, start with the basics and practise a little every day.",
    "The key idea is to break the problem into smaller parts.",
    "Many experts recommend checking your assumptions before you begin.",
    "For example, 1, 2, 3 and 42 are numbers; 3.14 is not an integer.",
    "This works because each step builds on the previous one.",
    "Be careful: the details matter more than they seem.",
    "You can read more in the official documentation.",
    "Finally, review what you learned and try again tomorrow.",
    "It depends on your goals and your budget.",
)


def builtin_corpus_texts(n: int, seed: int) -> Iterator[str]:
    """`n` arena-like texts (questions and answers) from a fixed seed: the fallback training text."""
    rng = random.Random(seed)
    for _ in range(n):
        topic = rng.choice(_TOPICS)
        if rng.random() < 0.4:
            yield rng.choice(_ASKS).format(t=topic)
        else:
            body = " ".join(rng.sample(_BODY, k=rng.randint(1, 4)))
            yield f"{rng.choice(_OPENERS)} About {topic}: {body}"


def train_tokenizer(texts: Iterable[str], *, vocab_size: int, min_frequency: int) -> Any:
    """Train a byte-level BPE and wrap it as a transformers fast tokenizer with our special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits are split one by one (as Llama 3 and GPT-4 tokenizers do, in groups): the synthetic arena
    # asks arithmetic and "which is larger" questions, and a tiny model can only learn to compare
    # numbers whose digits it sees, not opaque merged tokens like "Ġ95".
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
    )


def cache_key(settings: dict[str, Any], source: str) -> str:
    payload = {"format": TOKENIZER_FORMAT, "special": SPECIAL_TOKENS, "source": source, **settings}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def load_or_train_tokenizer(
    *,
    vocab_size: int,
    min_frequency: int,
    num_texts: int,
    seed: int,
    texts: TextSource | None = None,
    source: str | None = None,
) -> Any:
    """The cached tokenizer for these settings, training and caching it on first use.

    `texts` injects a text source (tests); give it a `source` name, which keys the cache entry.
    """
    if texts is None:
        source, texts = default_text_source()
    elif source is None:
        raise ValueError("an injected text source needs a `source` name for the cache key")
    from transformers import PreTrainedTokenizerFast

    settings = {
        "vocab_size": vocab_size,
        "min_frequency": min_frequency,
        "num_texts": num_texts,
        "seed": seed,
    }
    final = cache_root() / "tokenizers" / cache_key(settings, source)
    if not (final / "tokenizer.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tokenizer = train_tokenizer(
            texts(num_texts, seed), vocab_size=vocab_size, min_frequency=min_frequency
        )
        tokenizer.save_pretrained(tmp)
        (tmp / "hpref_tokenizer.json").write_text(json.dumps({"source": source, **settings}, indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:  # another process got there first; theirs is identical in settings
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(final)
