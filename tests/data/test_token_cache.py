"""Tokenize once: the cache hits on a second run and misses whenever anything that changes ids does."""

from __future__ import annotations

import numpy as np
import pytest

from hpref.arena import generate_battles
from hpref.arena.source import SyntheticArena, SyntheticArenaConfig
from hpref.data.cache import cache_root, tokenize_arrays, tokenize_dataset
from hpref.data.formatting import FormatterConfig, JudgeFormatter
from hpref.data.readers import ArenaConfig, ArenaReader, write_arena_file


class CountingFormatter(JudgeFormatter):
    calls = 0

    def encode_many(self, battles):
        CountingFormatter.calls += len(battles)
        return super().encode_many(battles)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HPREF_CACHE", str(tmp_path / "cache"))
    CountingFormatter.calls = 0
    return tmp_path / "cache"


def arena(n=30, **kw):
    return SyntheticArena(SyntheticArenaConfig(num_battles=n, seed=1, **kw), seed=0)


def test_second_run_loads_without_tokenizing(cache, chat_tokenizer):
    assert cache_root() == cache
    formatter = CountingFormatter("pab", FormatterConfig(), chat_tokenizer, 256)
    first = tokenize_dataset(arena(), formatter, swap="full")
    assert CountingFormatter.calls == 60 and len(list(cache.glob("*.npz"))) == 1
    again = tokenize_arrays(arena(), formatter, swap="full")
    assert CountingFormatter.calls == 60, "the second run tokenized again"
    assert again.from_cache and again.summary["rows_used"] == 30  # the read summary survives the cache
    second = again.examples()
    assert [(list(e.ids), e.label, e.row, e.swapped) for e in first] == [
        (list(e.ids), e.label, e.row, e.swapped) for e in second
    ]


def test_views_rows_and_labels(cache, chat_tokenizer):
    formatter = JudgeFormatter("pab", FormatterConfig(), chat_tokenizer, 256)
    battles = list(generate_battles(30, 1))
    examples = tokenize_dataset(arena(), formatter, swap="full")
    assert [e.row for e in examples] == [i // 2 for i in range(60)]
    assert [e.swapped for e in examples] == [False, True] * 30
    assert examples[1].label == battles[0].swapped().label
    assert list(examples[1].ids) == formatter.encode(battles[0].swapped())
    assert examples[0].ids.dtype == np.int32
    assert len(tokenize_dataset(arena(), formatter, swap="none")) == 30


def test_anything_that_changes_ids_misses(cache, chat_tokenizer, plain_tokenizer, tmp_path):
    def run(dataset, tokenizer=chat_tokenizer, max_length=256, **config):
        before = CountingFormatter.calls
        tokenize_dataset(dataset, CountingFormatter("pab", FormatterConfig(**config), tokenizer, max_length))
        return CountingFormatter.calls > before

    assert run(arena()) and not run(arena())
    assert run(arena(), max_length=200)
    assert run(arena(), truncation="left")
    assert run(arena(), tokenizer=plain_tokenizer)
    assert run(arena(folds=3, split="eval"))
    assert run(SyntheticArena(SyntheticArenaConfig(num_battles=30, seed=2), seed=0))
    path = tmp_path / "d.jsonl"
    write_arena_file(path, generate_battles(5, 0))
    assert run(ArenaReader(ArenaConfig(path=str(path)), 0)) and not run(
        ArenaReader(ArenaConfig(path=str(path)), 0)
    )
    write_arena_file(path, generate_battles(6, 0))  # same name, new bytes
    assert run(ArenaReader(ArenaConfig(path=str(path)), 0))


def test_damaged_entry_is_rebuilt(cache, chat_tokenizer):
    formatter = CountingFormatter("pab", FormatterConfig(), chat_tokenizer, 256)
    tokenize_dataset(arena(), formatter)
    (entry,) = cache.glob("*.npz")
    entry.write_bytes(b"not a zip file")
    assert len(tokenize_dataset(arena(), formatter)) == 30 and CountingFormatter.calls == 60


def test_several_formats_per_battle_share_the_row(cache, chat_tokenizer):
    pab = JudgeFormatter("pab", FormatterConfig(), chat_tokenizer, 256)
    papb = JudgeFormatter("papb", FormatterConfig(), chat_tokenizer, 256)
    examples = tokenize_dataset(arena(5), [pab, papb], swap="full")
    battle = next(generate_battles(1, 1))
    assert [e.row for e in examples[:4]] == [0, 0, 0, 0] and len(examples) == 20
    assert [list(e.ids) for e in examples[:4]] == [
        pab.encode(battle),
        pab.encode(battle.swapped()),
        papb.encode(battle),
        papb.encode(battle.swapped()),
    ]
    assert len(tokenize_dataset(arena(5), [pab, papb])) == 10  # swap none: one view per format
