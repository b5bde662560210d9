"""A training checkpoint -> the model it holds: the one loader of `hpref eval` and `hpref save`.

The model is rebuilt from the run's resolved `recipe.toml` (`recipe_of_run`: never one that turns on
remote code when it comes with the folder) on one CPU process, and only the `model.*` tensors are read
into it (DCP reshards any world size into one). Finding and checking the checkpoint is the run
folder's job (`hpref.runfolder.checkpoints.validate_checkpoint`: checksums, the DCP index through the
one restricted reader, every model key with the right shape); only then is anything loaded, into a
fresh state dict, and copied into the model in one `load_state_dict`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpref.errors import UserError
from hpref.protocols import PreferenceModel
from hpref.recipe import Recipe, remote_code_keys
from hpref.runfolder.checkpoints import validate_checkpoint
from hpref.runfolder.layout import RECIPE, TRAIN_STATE
from hpref.runfolder.safe_load import CheckpointError, dcp_load


def load_model_state(path: Path, model: PreferenceModel) -> dict[str, Any]:
    """The model's tensors from a (validated) checkpoint, as a fresh CPU state dict: every tensor,
    or with LoRA what trained (adapters, head), the frozen base being the model's own."""
    import torch

    from hpref.models.adapters import frozen_state_keys
    from hpref.models.parallelize import checkpoint_layout

    frozen = frozen_state_keys(model)
    template = {
        k: torch.empty_like(v, device="cpu")
        for k, v in model.state_dict().items()
        if k not in frozen and not k.endswith("_extra_state")
    }
    stored = checkpoint_layout(model, template)  # views of the template, in the checkpoint's layout
    validate_checkpoint(path, stored["model"])
    dcp_load(stored, path, no_dist=True)
    return template


def recipe_of_run(checkpoint_dir: Path, recipe_path: str | Path | None = None):
    """The run's resolved recipe: given, or `recipe.toml` beside `checkpoints/`.

    The folder's own recipe comes with the folder, from whoever made it (a downloaded run, a shared
    checkpoint), so it may not turn on remote code: loading the model would run that folder's Python.
    A recipe the user names explicitly (`--recipe`) is the user's decision and is taken as given.
    """
    from hpref.recipe import load_recipe, read_toml

    if recipe_path is not None:
        return load_recipe(recipe_path)
    candidate = Path(checkpoint_dir).resolve().parent.parent / RECIPE
    if not candidate.is_file():
        raise CheckpointError(
            f"{checkpoint_dir}: no recipe.toml in its run folder ({candidate}); pass the recipe explicitly"
        )
    # The raw file, then the resolved recipe (a component's default could turn it on).
    keys = remote_code_keys(read_toml(candidate))
    recipe = None
    if not keys:
        recipe = load_recipe(candidate)
        keys = remote_code_keys(recipe.to_dict())
    if keys:
        raise UserError(
            f"{candidate}: {keys[0]} = true: a recipe found inside the folder being loaded may not "
            "enable remote code; if you trust that folder's code, pass the recipe explicitly "
            f"(--recipe {candidate})"
        )
    return recipe


def frozen_keys(model: PreferenceModel) -> set[str]:
    from hpref.models.adapters import frozen_state_keys

    return frozen_state_keys(model)


@dataclass
class LoadedCheckpoint:
    model: PreferenceModel
    recipe: Recipe
    path: Path
    train_state: dict[str, Any]


def load_model_from_checkpoint(
    checkpoint_dir: Path, recipe: Recipe | None = None, device: str = "cpu", *, quantize: bool = True
) -> LoadedCheckpoint:
    """Build the recipe's model on one CPU process and fill it from the checkpoint. A QLoRA run's
    base is 4-bit as trained; `quantize=False` puts its adapters on the full-precision base instead."""
    from hpref.components import Components

    checkpoint_dir = Path(checkpoint_dir)
    recipe = recipe if recipe is not None else recipe_of_run(checkpoint_dir)
    # with the recipe's LoRA adapters, as trained
    model = Components(recipe).model(device="cpu", quantize=quantize)
    state = load_model_state(checkpoint_dir, model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]  # megatron's, never stored
    if unexpected or set(missing) - frozen_keys(model):
        raise CheckpointError(
            f"{checkpoint_dir}: does not fit the recipe's model (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    model.to(device)
    model.eval()
    train_state = json.loads((checkpoint_dir / TRAIN_STATE).read_text())
    return LoadedCheckpoint(model, recipe, checkpoint_dir, train_state)
