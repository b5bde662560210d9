"""A tiny trained-looking run folder: recipe.toml + a real DCP checkpoint written by the trainer's code."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY_MODEL = {
    "name": "tiny-llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 400,
    "tokenizer_texts": 300,
    "head_dropout": 0.0,
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))


def write_recipe(run_dir, model=None, max_length=320):
    from hpref.recipe import dump_toml

    run_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "run": {"name": run_dir.name, "output_dir": str(run_dir.parent)},
        "model": dict(model or TINY_MODEL),
        "formatter": {"name": "pab"},
        "train": {"max_length": max_length, "micro_batch_tokens": 2048, "swap": "none"},
    }
    path = run_dir / "recipe.toml"
    path.write_text(dump_toml(data))
    return path


def make_run(run_dir, step=7, seed=1):
    """A run folder with a checkpoint of a model whose weights differ from its seeded init."""
    import torch

    from hpref.plugins import load_plugins
    from hpref.recipe import load_recipe
    from hpref.train.checkpoint import save_checkpoint

    recipe = load_recipe(write_recipe(run_dir))
    model = load_plugins().get("model", "tiny-llama").build(recipe.model.config, num_labels=3)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = save_checkpoint(run_dir, step, model=model, optimizer=optimizer, train_state={"epoch": 0}, keep=3)
    return model.eval(), recipe, path
