"""`hpref.components.Components`: the one place a recipe becomes its parts."""

from __future__ import annotations

import pytest

from hpref.recipe import recipe_from_dict

TINY = {
    "name": "tiny-llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 400,
    "tokenizer_texts": 300,
}


def _recipe(**sections):
    data = {
        "run": {"seed": 3},
        "model": dict(TINY),
        "dataset": {"train": {"name": "synthetic-arena", "num_battles": 8}},
        "train": {"max_length": 300},
        "optimizer": {"lr": 2e-3, "head_lr": 1e-2},
        "scheduler": {"name": "linear"},
    }
    data.update(sections)
    return recipe_from_dict(data)


def test_parts_follow_the_recipe():
    import torch

    from hpref.components import NUM_LABELS, Components
    from hpref.data.packing import TokenizedExample, collate

    parts = Components(_recipe())
    model = parts.model()
    assert NUM_LABELS == 3
    batch = collate([TokenizedExample(ids=[5, 6, 7], label=None, row=0)])
    assert model(batch.input_ids, batch.cu_seqlens, batch.position_ids).shape == (1, NUM_LABELS)
    assert parts.formatter(model.tokenizer).max_length == 300
    assert parts.formatter(model.tokenizer, 256).max_length == 256
    assert parts.source("eval") is None
    assert len(list(parts.source("train").battles())) > 0
    optimizer = parts.optimizer(model)
    assert {g["lr"] for g in optimizer.param_groups} == {2e-3, 1e-2}
    scheduler = parts.scheduler(optimizer, total_steps=10)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    logits = torch.tensor([[2.0, 0.0, 0.0]])
    labels = torch.tensor([[1.0, 0.0, 0.0]])
    torch.testing.assert_close(
        parts.loss(logits, labels), torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    )


def test_a_recipe_without_a_model_is_a_user_error():
    from hpref.components import Components
    from hpref.errors import UserError

    recipe = _recipe()
    recipe.model = None
    with pytest.raises(UserError, match=r"no \[model\] section"):
        Components(recipe).model()
