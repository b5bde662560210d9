"""Fold selection: grouped by prompt, stratified by label, deterministic, complementary."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from hpref.data.readers import ArenaConfig, ArenaReader, write_arena_file
from hpref.data.records import Battle
from hpref.data.splits import FoldAssigner, label_class, prompt_key

LABELS = [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)]


def battles(n=1200):
    # 300 distinct prompts, each repeated 4 times with different labels (like arena model pairs).
    return [
        Battle(str(i), (f"prompt {i % 300}",), ("a",), ("b",), LABELS[(i * 7) % 3 if i % 5 else 2])
        for i in range(n)
    ]


def test_folds_partition_group_and_stratify():
    data = battles()
    assigner = FoldAssigner(5, seed=3)
    folds = [assigner.fold_of(b) for b in data]
    by_prompt: dict[bytes, set[int]] = {}
    for b, f in zip(data, folds, strict=True):
        by_prompt.setdefault(prompt_key(b.prompt), set()).add(f)
    # The same prompt in two folds would leak eval prompts into training.
    assert all(len(fs) == 1 for fs in by_prompt.values())
    overall = Counter(label_class(b.label) for b in data)
    for k in range(5):
        members = [b for b, f in zip(data, folds, strict=True) if f == k]
        assert 200 <= len(members) <= 280  # sizes balanced
        shares = Counter(label_class(b.label) for b in members)
        for cls, count in overall.items():
            assert abs(shares[cls] / len(members) - count / len(data)) < 0.05, (k, cls)
    again = FoldAssigner(5, seed=3)
    assert [again.fold_of(b) for b in data] == folds  # deterministic


def test_prompt_key_ignores_case_and_whitespace():
    assert prompt_key(("Hello   World",)) == prompt_key(("hello world ",))
    assert prompt_key(("a", "b")) != prompt_key(("a b",))


def test_train_and_eval_readers_are_complementary(tmp_path):
    path = write_arena_file(tmp_path / "d.jsonl", battles(600))
    ids = {}
    for split in ("train", "eval"):
        reader = ArenaReader(ArenaConfig(path=str(path), folds=4, fold=1, split=split), seed=0)
        ids[split] = [b.id for b in reader.battles()]
        assert reader.summary.rows_used + reader.summary.rows_other_split == 600
    assert not set(ids["train"]) & set(ids["eval"])
    assert len(ids["train"]) + len(ids["eval"]) == 600
    assert 120 <= len(ids["eval"]) <= 180


def test_fold_config_is_validated():
    with pytest.raises(ValidationError, match="fold must be below folds"):
        ArenaConfig(path="x", folds=3, fold=3)
    with pytest.raises(ValidationError, match="needs folds >= 2"):
        ArenaConfig(path="x", split="eval")
    with pytest.raises(ValidationError, match="extra"):
        ArenaConfig(path="x", fodls=3)


def test_pairwise_folds_do_not_move_with_the_run_seed(tmp_path):
    """The pairwise reader's A/B labels come from a coin seeded by the run seed. Stratifying by them
    made the folds depend on the run seed (seeds 0 and 1 shared 40% of the HH-RLHF eval fold), so a
    model trained with one seed was evaluated on rows another seed's model had trained on. The eval
    fold must be the same set of prompts for every run seed, and still complementary to train."""
    import json

    from hpref.data.readers import PairwiseConfig, PairwiseReader

    path = tmp_path / "hh.jsonl"
    rows = [
        {"chosen": f"\n\nHuman: q{i}\n\nAssistant: good", "rejected": f"\n\nHuman: q{i}\n\nAssistant: bad"}
        for i in range(300)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def prompts(split, seed):
        config = PairwiseConfig(path=str(path), folds=4, fold=2, split=split)
        return {b.prompt for b in PairwiseReader(config, seed).battles()}

    evals = [prompts("eval", seed) for seed in range(4)]
    assert all(e == evals[0] for e in evals[1:])
    assert 60 <= len(evals[0]) <= 90
    train = prompts("train", 3)
    assert not train & evals[0] and len(train) + len(evals[0]) == 300
