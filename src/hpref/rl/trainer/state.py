"""An rl trainer's saves: what `TrainerActor.save` writes and `TrainerActor.load` reads back.

A save is the trainer's state (`trainer.pt`, read back only through the run folder's restricted
reader) with the checksums of every file beside it: the model as a transformers folder (`model/`)
or, with LoRA, PEFT's adapter folder and `policy_base.json` naming the base it adapts. A group of
ranks gathers its shards (`TrainerBackend.gathered_state`) and rank 0 writes the same files one rank
would, so a save resumes on any number of ranks (`TrainerBackend.sliced_optimizer_state` and
`hpref.models.parallelize.shard_like` cut them again).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpref.runfolder.layout import POLICY_MODEL, TRAINER_STATE

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hpref.recipe.rl import PolicyConfig
    from hpref.rl.protocols import TrainerBackend


class TrainerActor(Protocol):
    """What a save reads and a load sets of `hpref.rl.trainer.actor.TrainerActor` (named here, not
    imported: the trainer imports this module)."""

    policy: str
    config: PolicyConfig
    backend: TrainerBackend
    model: nn.Module
    tokenizer: Any
    lora: Any  # PEFT's PeftModel, or None
    optimizer: torch.optim.Optimizer
    rank: int
    world_size: int
    rollouts_done: int
    version: int
    shared: bool  # one adapter (named by `policy`) of several on a shared base


def save_trainer(trainer: TrainerActor, folder: str) -> None:
    """The model as a transformers folder (a usable starting checkpoint), optimizer and counters.

    With LoRA only what trains: PEFT's adapter folder (`adapter/`, loadable by `peft`), the
    optimizer state of the adapters, the counters, and `policy_base.json`, which names the frozen
    base (the policy's `model` settings) and the adapter settings that resume must match.
    In a group every rank gathers its shards and rank 0 writes the same files one rank would,
    so a save resumes on any number of ranks."""
    import torch

    from hpref.runfolder import integrity
    from hpref.runfolder.files import write_bytes_atomic, write_json_atomic

    # a group's weights and moments gathered (every rank joins) into the one-rank layout
    weights, optimizer = trainer.backend.gathered_state(
        trainer.model, trainer.lora, trainer.optimizer, trainer.world_size > 1
    )
    adapter = None
    if trainer.shared:  # this policy's adapter alone, whole (every rank joins the gathers)
        from hpref.models.lm_adapters import adapter_items
        from hpref.rl.trainer.sharding import full

        adapter = {k: v.clone() for k, v in adapter_items(trainer.model, trainer.policy, full)}
    if trainer.rank != 0:
        return
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    if trainer.lora is not None:
        from hpref.models.lm_adapters import POLICY_ADAPTER_DIR, POLICY_BASE_FILE, save_adapter_folder

        if adapter is not None:  # the files a policy of its own writes, so either kind resumes either
            save_adapter_folder(trainer.lora, trainer.policy, path / POLICY_ADAPTER_DIR, adapter)
        else:
            trainer.lora.save_pretrained(
                str(path / POLICY_ADAPTER_DIR),
                safe_serialization=True,
                save_embedding_layers=False,
                state_dict=weights,
            )
        write_json_atomic(path / POLICY_BASE_FILE, base_description(trainer), indent=2, sort_keys=True)
    else:  # a megatron model writes the transformers layout too
        if weights is None:
            trainer.model.save_pretrained(path / POLICY_MODEL)
        else:  # a group's gathered weights
            trainer.model.save_pretrained(path / POLICY_MODEL, state_dict=weights)
        trainer.tokenizer.save_pretrained(path / POLICY_MODEL)
    buffer = io.BytesIO()
    torch.save(
        {
            "optimizer": optimizer,
            "rollouts_done": trainer.rollouts_done,
            "version": trainer.version,
            "backend": trainer.config.trainer_backend,
        },
        buffer,
    )
    write_bytes_atomic(path / TRAINER_STATE, buffer.getvalue())
    integrity.write_manifest(path)  # sizes and SHA-256 of every file, verified by `load`


def load_trainer(trainer: TrainerActor, folder: str) -> int:
    """Restore from `folder`; returns the rollout id to start at (0 when there is nothing there)."""
    from safetensors.torch import load_file

    from hpref.models.lm_adapters import POLICY_BASE_FILE
    from hpref.models.parallelize import shard_like
    from hpref.runfolder import integrity
    from hpref.runfolder.safe_load import CheckpointError, load_torch_file

    path = Path(folder)
    if not (path / TRAINER_STATE).is_file():
        return 0
    integrity.require_verified(path)
    state = load_torch_file(path / TRAINER_STATE)
    saved_backend = state.get("backend", "transformers") if isinstance(state, dict) else None
    if saved_backend not in (None, trainer.config.trainer_backend):
        # the optimizer's moments are per parameter, and the two backends' parameters differ
        raise CheckpointError(
            f"{path / TRAINER_STATE}: saved by a {saved_backend} trainer, but policy '{trainer.policy}' "
            f"has trainer_backend = {trainer.config.trainer_backend!r} now; resume with the backend it "
            "was saved with"
        )
    if trainer.lora is not None:
        _load_adapter(trainer, path)
    else:
        weights_file = path / POLICY_MODEL / "model.safetensors"
        if not weights_file.is_file() and (path / POLICY_BASE_FILE).is_file():
            raise CheckpointError(
                f"{path}: holds a LoRA adapter, but policy '{trainer.policy}' has no [lora] now; "
                "resume with the adapter settings it was saved with"
            )
        try:
            weights = shard_like(trainer.model.state_dict(), load_file(str(weights_file)))
            trainer.backend.load_plain_state(trainer.model, weights)
        except Exception as exc:  # safetensors' header errors and shape mismatches
            raise CheckpointError(f"{weights_file}: cannot load ({type(exc).__name__}: {exc})") from None
    try:
        optimizer = trainer.backend.sliced_optimizer_state(
            trainer.model, trainer.optimizer, state["optimizer"], trainer.world_size > 1
        )
        trainer.optimizer.load_state_dict(optimizer)
        trainer.rollouts_done = int(state["rollouts_done"])
        trainer.version = int(state["version"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / TRAINER_STATE}: damaged ({type(exc).__name__}: {exc})") from None
    return trainer.rollouts_done


def base_description(trainer: TrainerActor) -> dict[str, Any]:
    """What a LoRA save leaves out and resume must find again: the base and the adapter shape."""
    assert trainer.config.lora is not None
    return {
        "format": 1,
        "base": trainer.config.model.model_dump(mode="json"),
        "lora": trainer.config.lora.model_dump(mode="json"),
    }


def _load_adapter(trainer: TrainerActor, path: Path) -> None:
    """The adapter of a LoRA save into this trainer, after checking it adapts this very base."""
    from safetensors.torch import load_file

    from hpref.exports.layout import PEFT_WEIGHTS_FILE
    from hpref.models.lm_adapters import (
        POLICY_ADAPTER_DIR,
        POLICY_BASE_FILE,
        load_adapter_tensors,
        load_lm_adapter_state,
    )
    from hpref.runfolder.safe_load import CheckpointError

    described = path / POLICY_BASE_FILE
    if not described.is_file():
        raise CheckpointError(
            f"{path}: holds full weights (no {POLICY_BASE_FILE}), but policy '{trainer.policy}' has "
            "[lora] now; resume without it, or start a new run"
        )
    try:
        saved = json.loads(described.read_text(encoding="utf-8"))
        saved_base, saved_lora = dict(saved["base"]), dict(saved["lora"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{described}: damaged ({type(exc).__name__}: {exc})") from None
    want = base_description(trainer)
    for part, have in (("base", saved_base), ("lora", saved_lora)):
        if have != want[part]:
            diff = sorted(k for k in set(have) | set(want[part]) if have.get(k) != want[part].get(k))
            key = "model" if part == "base" else "lora"
            raise CheckpointError(
                f"{described}: the adapter was trained with other {key} settings than policy "
                f"'{trainer.policy}' has now ({key}.{diff[0]}: saved {have.get(diff[0])!r}, now "
                f"{want[part].get(diff[0])!r}); an adapter only fits the base it was trained on"
            )
    weights_file = path / POLICY_ADAPTER_DIR / PEFT_WEIGHTS_FILE
    try:
        saved_adapter = load_file(str(weights_file))
        if trainer.shared:
            load_adapter_tensors(trainer.model, trainer.policy, saved_adapter, source=str(weights_file))
        else:
            load_lm_adapter_state(trainer.lora, saved_adapter, source=str(weights_file))
    except ValueError as exc:
        raise CheckpointError(str(exc).splitlines()[0]) from None
    except Exception as exc:  # safetensors' header errors
        raise CheckpointError(f"{weights_file}: cannot load ({type(exc).__name__}: {exc})") from None
