"""One rank of the tensor-parallel check in test_megatron.py (run by torchrun, gloo on CPU).

Loads a transformers folder into a `MegatronBackbone` split over all ranks (TP = world size), runs
a few plain SGD steps on a fixed packed batch and writes the loss curve and the gathered weights
converted back to transformers keys (rank 0). A third argument `sequence-parallel` turns megatron's
sequence parallelism on (the 17-token row is then padded to an even length).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(folder: str, out: str, mode: str = "") -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from megatron.core import parallel_state
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from hpref.models.attention import CONTEXT_KWARG, VarlenContext
    from hpref.models.megatron import MegatronBackbone
    from hpref.models.megatron.convert import megatron_to_hf, shape_of
    from hpref.models.megatron.sequence_parallel import sum_partial_gradients

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    shape = shape_of(AutoConfig.from_pretrained(folder))
    backbone = MegatronBackbone(shape, tp_size=world, sequence_parallel=mode == "sequence-parallel")
    backbone.load_hf_state(load_file(str(Path(folder) / "model.safetensors")), tp_rank=rank)
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3]
    ids = torch.randint(0, shape.vocab_size, (1, sum(lengths)), generator=generator)
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    optimizer = torch.optim.SGD(backbone.parameters(), lr=0.5)
    losses = []
    for _ in range(4):
        ctx = VarlenContext(backend="sdpa_segments", cu_seqlens=cu, max_seqlen=max(lengths))
        hidden = backbone(ids, positions, **{CONTEXT_KWARG: ctx}).last_hidden_state
        loss = hidden[0, cu[1:].long() - 1].pow(2).mean()  # last-token states, as the head reads them
        optimizer.zero_grad()
        loss.backward()
        sum_partial_gradients(list(backbone.parameters()))  # the norms' gradients, under sequence parallel
        optimizer.step()
        losses.append(loss.item())
    shards = [None] * world
    dist.all_gather_object(
        shards, {k: v for k, v in backbone.state_dict().items() if isinstance(v, torch.Tensor)}
    )
    if rank == 0:
        hf = megatron_to_hf(shards, shape)
        Path(out).write_text(
            json.dumps({"losses": losses, "checksum": {k: float(v.double().sum()) for k, v in hf.items()}})
        )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
