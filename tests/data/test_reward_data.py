"""A reward model's input: each battle is two sequences (A's conversation, B's), packed side by side.

The `answers` formatter makes them, `collate` gives each its own boundary, the planner keeps a pair
in one micro-batch, fillers are pairs, and the token cache remembers where B's sequence starts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpref.arena.source import SyntheticArena, SyntheticArenaConfig
from hpref.data.cache import tokenize_dataset
from hpref.data.formatting import DEFAULT_INSTRUCTION, AnswersConfig, AnswersFormatter
from hpref.data.packing import FILLER, TokenizedExample, collate, filler, plan_eval, plan_steps
from hpref.data.records import Battle

TWO_TURNS = Battle(
    "x",
    ("What is 12 + 30 ?", "Reverse the word apple ."),
    ("The answer is 42 .", "elppa"),
    ("41", "elpap I hope this helps !"),
    (1.0, 0.0, 0.0),
)


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def contains(seq, sub):
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_answers_formatter_renders_each_side_as_its_own_chat(chat_tokenizer):
    """Each side is the user turns with that side's own answers, as the tokenizer's chat; if not,
    a reward model would score text that mixes both answers or carries a judge instruction."""
    f = AnswersFormatter(AnswersConfig(), chat_tokenizer, 256)
    e = f.encode_many([TWO_TURNS])[0]
    a, b = e.ids[: e.split], e.ids[e.split :]
    assert e.split > 0 and not e.truncated and e.full_length == len(e.ids)
    expected_a = chat_tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "What is 12 + 30 ?"},
            {"role": "assistant", "content": "The answer is 42 ."},
            {"role": "user", "content": "Reverse the word apple ."},
            {"role": "assistant", "content": "elppa"},
        ],
        tokenize=False,
    )
    assert a == ids_of(chat_tokenizer, expected_a)
    assert contains(b, ids_of(chat_tokenizer, "elpap I hope this helps !"))
    assert not contains(b, ids_of(chat_tokenizer, "elppa")) and not contains(a, ids_of(chat_tokenizer, "41"))
    assert not contains(a, ids_of(chat_tokenizer, DEFAULT_INSTRUCTION)[:4])
    assert f.paired and f.encode(TWO_TURNS) == e.ids


def test_answers_formatter_plain_text_uses_the_tokenizers_own_specials(plain_tokenizer):
    """Without a chat template each side is 'User: ... Assistant: ...' with the tokenizer's BOS;
    a missing BOS on B's side would make the two sequences look different to the model."""
    f = AnswersFormatter(AnswersConfig(), plain_tokenizer, 256)
    e = f.encode_many([TWO_TURNS])[0]
    bos = plain_tokenizer.bos_token_id
    assert e.ids[0] == bos and e.ids[e.split] == bos
    assert plain_tokenizer.decode(e.ids[e.split :]).endswith("elpap I hope this helps !")


@pytest.mark.parametrize("max_length", [14, 20, 30])
def test_truncation_keeps_each_side_within_budget_and_the_answer_first(chat_tokenizer, max_length):
    """Each side fits max_length on its own, the scored answer keeps its beginning, the context
    keeps its end and old turns go first: otherwise truncation would eat what is being scored."""
    long_answer = "apple " * 30
    battle = Battle("t", ("hi", "What is 12 + 30 ?"), ("Good question", long_answer), ("Sure", "42"))
    f = AnswersFormatter(AnswersConfig(), chat_tokenizer, max_length)
    e = f.encode_many([battle])[0]
    a, b = e.ids[: e.split], e.ids[e.split :]
    assert e.truncated and len(a) <= max_length and len(b) <= max_length
    apple = ids_of(chat_tokenizer, "apple")[0]
    assert apple in a  # the long answer survives (its start)
    assert contains(b, ids_of(chat_tokenizer, "42"))  # B's short answer whole
    assert not contains(b, ids_of(chat_tokenizer, "Good question"))  # A's old turn is never in B


def test_collate_gives_each_sequence_of_a_pair_its_own_boundary():
    """cu_seqlens/positions are per sequence (2 per example), labels/rows/weights per example; a
    wrong boundary would let B's tokens attend to A's or read the wrong last token."""
    examples = [
        TokenizedExample(np.array([5, 6, 7, 8, 9], dtype=np.int32), (1.0, 0.0, 0.0), row=4, split=3),
        filler(1, paired=True),
        TokenizedExample([10, 11, 12], (0.0, 1.0, 0.0), row=2, swapped=True, split=1),
    ]
    b = collate(examples)
    assert b.input_ids.tolist() == [5, 6, 7, 8, 9, 1, 1, 10, 11, 12]
    assert b.cu_seqlens.tolist() == [0, 3, 5, 6, 7, 8, 10]
    assert b.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 0, 0, 0, 1]
    assert b.last_token_index.tolist() == [2, 4, 5, 6, 7, 9]
    assert b.labels.tolist() == [[1, 0, 0], [0, 0, 0], [0, 1, 0]]
    assert b.rows.tolist() == [4, FILLER, 2] and b.weights.tolist() == [1.0, 0.0, 1.0]
    assert b.sequences_per_example == 2
    assert (b.num_sequences, b.num_real_sequences, b.num_tokens, b.max_seqlen) == (3, 2, 8, 3)
    with pytest.raises(ValueError, match="paired"):
        collate([examples[0], TokenizedExample([1, 2], None, row=0)])


def test_plans_keep_pairs_whole_and_fill_with_pairs():
    """A rank with nothing to do runs a filler PAIR when the data is paired: a single 1-token filler
    would give the reward model an odd number of sequences."""
    examples = [
        TokenizedExample(list(range(1, 1 + n)), (1.0, 0.0, 0.0), row=i, split=2) for i, n in enumerate([6, 4])
    ]
    plan = plan_eval([len(e) for e in examples], world_size=3, micro_batch_tokens=8)
    for rank in range(3):
        for batch in plan.batches(rank, examples):
            assert (batch.cu_seqlens.numel() - 1) == 2 * batch.rows.numel()
    steps = plan_steps(
        [6, 4], [0, 1], [False, False], batch_size=2, world_size=2, micro_batch_tokens=4, seed=0, epoch=0
    )
    seen = sorted(i for mbs in steps[0].micro_batches for mb in mbs for i in mb if i >= 0)
    assert seen == [0, 1]


def test_token_cache_stores_the_splits(chat_tokenizer, tmp_path, monkeypatch):
    """A cache hit must bring back where B's sequence starts; without it the second run would train
    a reward model on single sequences that hold both answers."""
    monkeypatch.setenv("HPREF_CACHE", str(tmp_path / "cache"))
    f = AnswersFormatter(AnswersConfig(), chat_tokenizer, 64)
    source = SyntheticArena(SyntheticArenaConfig(num_battles=12, seed=1), seed=0)
    first = tokenize_dataset(source, f, swap="none")
    again = tokenize_dataset(
        SyntheticArena(SyntheticArenaConfig(num_battles=12, seed=1), seed=0), f, swap="none"
    )
    assert all(e.split > 0 for e in first)
    assert [(list(e.ids), e.split) for e in first] == [(list(e.ids), e.split) for e in again]
    for e in again:
        assert len(e.ids) - e.split <= 64 and e.split <= 64
    assert collate(again[:3]).cu_seqlens.numel() == 7
    assert isinstance(collate(again[:3]).input_ids, torch.Tensor)
