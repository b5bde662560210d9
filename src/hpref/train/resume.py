"""A training run's checkpoints as `fit` sees them: `save` the whole run state after a step,
`restore` it into a fresh setup on resume (the files themselves: `hpref.train.checkpoint`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpref.errors import UserError
from hpref.runfolder.layout import TRAIN_STATE
from hpref.train.checkpoint import load_checkpoint, save_checkpoint


def save(setup: Any, step: int, epoch: int) -> None:
    """Collective: the run's checkpoint after `step` (model, optimizer, sampler, scheduler; the
    base model a LoRA run's adapters belong to), keeping `train.keep_checkpoints` of them."""
    save_checkpoint(
        setup.run_dir,
        step,
        model=setup.model,
        optimizer=setup.optimizer,
        train_state={
            "epoch": epoch,
            "sampler": setup.sampler.state_dict(),
            "scheduler": setup.scheduler.state_dict(),
            "total_steps": setup.total_steps,
            **base_pointer_of(setup),
        },
        keep=setup.recipe.train.keep_checkpoints,
        # the scheduler's groups may differ by rank; an objective's state is its rank's (DPO's
        # reference cache)
        rank_state={
            "scheduler": setup.scheduler.state_dict(),
            **(setup.objective.rank_state() if setup.objective is not None else {}),
        },
    )


def restore(setup: Any, path: Path) -> int:
    """Load a checkpoint into the setup; returns the number of completed steps."""
    expected = base_pointer_of(setup).get("base_model")
    saved = _read_base_pointer(path)
    if expected is not None and saved is not None and saved != expected:
        # the adapters only mean something on the base they were trained on
        raise UserError(
            f"cannot resume from {path}: its adapters were trained on the base model {json.dumps(saved)}, "
            f"and this recipe's [model] is {json.dumps(expected)}"
        )
    restored = load_checkpoint(path, model=setup.model, optimizer=setup.optimizer, run_dir=setup.run_dir)
    try:
        setup.sampler.load_state_dict(restored.train_state["sampler"])
    except ValueError as exc:
        raise UserError(f"cannot resume from {path}: {exc}") from None
    # this rank's own (a pipeline stage's parameter groups differ), else rank 0's (older checkpoints)
    setup.scheduler.load_state_dict(restored.rank_state.get("scheduler", restored.train_state["scheduler"]))
    if setup.objective is not None:
        setup.objective.load_rank_state(restored.rank_state)
    return int(restored.train_state["step"])


def base_pointer_of(setup: Any) -> dict[str, Any]:
    """For a LoRA run, what a checkpoint needs to name the frozen base weights it leaves out."""
    if setup.recipe.lora is None:
        return {}
    if setup.recipe.dpo is not None:  # a DPO policy's base is its [dpo] model
        return {"base_model": setup.recipe.dpo.model.model_dump(mode="json", exclude_none=True)}
    from hpref.models.adapters import base_pointer

    return {"base_model": base_pointer(setup.recipe)}


def _read_base_pointer(path: Path) -> Any:
    try:
        return json.loads((Path(path) / TRAIN_STATE).read_text(encoding="utf-8")).get("base_model")
    except (OSError, ValueError, AttributeError):
        return None  # load_checkpoint names what is wrong with the file
