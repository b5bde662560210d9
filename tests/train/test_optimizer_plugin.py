"""The optimizer is a component kind like the others: a plugin registers one through
`register_optimizers` and a recipe selects it by `[optimizer] name = ...`."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

from hpref.hookspecs import hookimpl
from hpref.plugins import load_plugins, reset_plugins
from tests.train.conftest import train_losses, write_recipe

BUILT: list = []


class CountingSGDConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.0, ge=0)


def build_counting_sgd(config: CountingSGDConfig, model):
    """Plain SGD that counts its steps (a stand-in for, say, a Kahan-summation AdamW)."""
    import torch

    class CountingSGD(torch.optim.SGD):
        steps_taken = 0

        def step(self, closure=None):
            self.steps_taken += 1
            return super().step(closure)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = CountingSGD(params, lr=config.lr, momentum=config.momentum)
    BUILT.append(optimizer)
    return optimizer


class OptimizerPlugin:
    __name__ = "test-optimizers"

    @hookimpl
    def register_optimizers(self, register):
        register(name="counting-sgd", config=CountingSGDConfig, build=build_counting_sgd)


@pytest.fixture
def optimizer_plugin():
    reset_plugins()
    BUILT.clear()
    load_plugins(extra=[OptimizerPlugin()])
    yield
    reset_plugins()
    BUILT.clear()


def test_builtin_adamw_is_registered_through_the_hook():
    reset_plugins()
    component = load_plugins().get("optimizer", "adamw")
    assert component.plugin == "hpref.builtin.optimizers"
    assert {p["name"] for p in component.parameters()} == {"lr", "head_lr", "weight_decay", "betas", "eps"}


def test_unknown_optimizer_name_is_a_recipe_error(tmp_path):
    from hpref.errors import RecipeError
    from hpref.recipe import load_recipe

    reset_plugins()
    with pytest.raises(RecipeError, match=r"optimizer\.name: unknown optimizer 'adamx'.*adamw"):
        load_recipe(write_recipe(tmp_path), ["optimizer.name=adamx"])
    with pytest.raises(RecipeError, match=r"optimizer\.lrr: unknown key"):
        load_recipe(write_recipe(tmp_path), ["optimizer.lrr=0.1"])


def test_plugin_optimizer_selected_by_name_trains(tmp_path, optimizer_plugin):
    """A recipe naming the plugin's optimizer trains with it: built once, over the trainable
    parameters, stepped once per optimizer step, its parameters in the resolved recipe."""
    from hpref.recipe import load_recipe
    from hpref.train import run_train

    recipe = write_recipe(tmp_path)
    overrides = [
        "optimizer.name=counting-sgd",
        "optimizer.lr=0.05",
        # with momentum the optimizer has state after its first step; a stateless one is also stepped
        # (with zero gradients) by DCP's optimizer-state initialisation at every checkpoint
        "optimizer.momentum=0.9",
        "train.max_steps=3",
        "train.eval_interval=0",
    ]
    assert run_train(recipe, overrides, nproc_per_node=1) == 0
    (optimizer,) = BUILT
    assert optimizer.steps_taken == 3
    assert type(optimizer).__name__ == "CountingSGD"
    run_dir = tmp_path / "runs" / "run"
    losses = train_losses(run_dir)
    assert sorted(losses) == [1, 2, 3]
    resolved = load_recipe(run_dir / "recipe.toml")
    assert resolved.optimizer.name == "counting-sgd"
    assert resolved.optimizer.config.lr == 0.05 and resolved.optimizer.config.momentum == 0.9
