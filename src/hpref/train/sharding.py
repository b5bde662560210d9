"""Precision and initial weights of a sharded model (the sharding itself: `hpref.models.parallelize`).

    build on meta  ->  `parallelize` (activation checkpointing, fully_shard per block, root)
    ->  `load_initial_weights` (materialise; rank 0 reads, the others receive)

`hpref.models.precision.resolve_precision` picks the compute dtype from measurements; `hpref init`
writes the weights a run starts from (`hpref.runfolder.layout.INIT`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger

from hpref.exports.layout import BACKBONE_FILE, HEAD_FILE
from hpref.protocols import LoadsPlainState
from hpref.runfolder.layout import INIT


def init_weights_folder(run_dir: Path) -> Path | None:
    """`run_dir/init` when `hpref init` wrote it, else None."""
    folder = Path(run_dir) / INIT
    return folder if (folder / BACKBONE_FILE).is_file() else None


def read_init_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The full state dict (`backbone.*`, `head.*`) of a folder written by `save_pretrained`."""
    from safetensors.torch import load_file

    state = {f"backbone.{k}": v for k, v in load_file(str(folder / BACKBONE_FILE)).items()}
    head = load_file(str(folder / HEAD_FILE))  # keys carry the `head.` prefix already
    state.update({k if k.startswith("head.") else f"head.{k}": v for k, v in head.items()})
    return state


def load_initial_weights(model: torch.nn.Module, *, device: torch.device, init_folder: Path | None) -> None:
    """Materialise the sharded meta model on `device` and fill it: from `init_folder` (an `hpref
    init` output) when given, else the component's pretrained / seeded weights. Rank 0 reads; the
    others receive their shards by broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from hpref.models.quantize import is_quantized

    if is_quantized(model):
        # QLoRA: built materialised (its 4-bit base is quantised from the pretrained weights) with
        # the same seeded head and adapters on every rank, so there is nothing to load or send
        if init_folder is not None:
            from hpref.errors import UserError

            raise UserError(
                f"lora.quantize_base: training from an `hpref init` folder ({init_folder}) is not "
                'supported with a 4-bit base; remove the folder or set lora.quantize_base = "none"'
            )
        return
    broadcast = dist.get_world_size() > 1
    model.load_pretrained_weights(device=device, broadcast_from_rank0=broadcast)
    if init_folder is None:
        return
    if isinstance(model, LoadsPlainState):  # megatron-gpt: every rank converts and keeps its own shard
        model.load_plain_state(read_init_weights(init_folder))
        logger.info(f"initial weights from {init_folder}")
        return
    state = read_init_weights(init_folder) if dist.get_rank() == 0 or not broadcast else {}
    if state:
        from hpref.models.adapters import to_model_layout

        state = to_model_layout(model, state)  # an `hpref init` folder holds the plain layout
    set_model_state_dict(
        model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    )
    logger.info(f"initial weights from {init_folder}")
