"""Recipe -> dataset and formatter components -> token cache -> step plan -> packed batches."""

from __future__ import annotations

import pytest

from hpref.data.cache import tokenize_dataset
from hpref.data.packing import FILLER, StepSampler
from hpref.errors import RecipeError
from hpref.plugins import load_plugins
from hpref.recipe import recipe_from_dict

RECIPE = {
    "run": {"seed": 3},
    "dataset": {
        "train": {"name": "synthetic-arena", "num_battles": 120, "folds": 4, "fold": 0, "split": "train"},
        "eval": {"name": "synthetic-arena", "num_battles": 120, "folds": 4, "fold": 0, "split": "eval"},
    },
    "formatter": {"name": "pab", "truncation": "proportional"},
    "train": {"batch_size": 8, "micro_batch_tokens": 256, "max_length": 128, "swap": "full"},
}


def test_recipe_to_packed_batches(tmp_path, monkeypatch, chat_tokenizer):
    monkeypatch.setenv("HPREF_CACHE", str(tmp_path))
    recipe = recipe_from_dict(RECIPE)
    registry = load_plugins()
    seed = recipe.run.seed

    def dataset(split):
        section = getattr(recipe.dataset, split)
        return registry.get("dataset", section.name).build(section.config, seed=seed)

    formatter = registry.get("formatter", recipe.formatter.name).build(
        recipe.formatter.config, chat_tokenizer, max_length=recipe.train.max_length
    )
    train = tokenize_dataset(dataset("train"), formatter, swap=recipe.train.swap)
    evaluation = tokenize_dataset(dataset("eval"), formatter)
    assert len(train) // 2 + len(evaluation) == 120  # complementary folds, two views per train battle
    sampler = StepSampler(
        [len(e) for e in train],
        [e.row for e in train],
        [e.swapped for e in train],
        batch_size=recipe.train.batch_size,
        world_size=2,
        micro_batch_tokens=recipe.train.micro_batch_tokens,
        seed=seed,
        swap=recipe.train.swap,
    )
    seen = 0
    for step in sampler:
        per_rank = [step.batches(rank, train) for rank in range(2)]
        assert len(per_rank[0]) == len(per_rank[1])
        real = sum(int(b.weights.sum()) for batches in per_rank for b in batches)
        assert real == step.num_sequences
        for batches in per_rank:
            for b in batches:
                assert b.input_ids.numel() <= max(recipe.train.micro_batch_tokens, b.max_seqlen)
                assert b.max_seqlen <= recipe.train.max_length
                assert (b.rows[b.weights == 0] == FILLER).all()
        seen += real
    assert seen == len(train)


def test_misspelt_dataset_key_is_a_recipe_error():
    bad = {"dataset": {"train": {"name": "synthetic-arena", "fodls": 5}}}
    with pytest.raises(RecipeError, match=r"dataset\.train\.fodls: unknown key \(did you mean 'folds'\?\)"):
        recipe_from_dict(bad)
