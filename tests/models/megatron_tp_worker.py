"""One rank of the tensor-parallel check in test_megatron.py (run by torchrun on two ranks, gloo).

Loads a transformers folder into a `MegatronBackbone` three times in the one process group: TP = 1
(each rank holds the whole model and takes the same steps: the reference), TP = 2, and TP = 2 with
megatron's sequence parallelism (the 17-token row is then padded to an even length). Each runs a few
plain SGD steps on a fixed packed batch; rank 0 writes, per mode, the loss curve and the gathered
weights converted back to transformers keys. One torchrun instead of three: each start of two
interpreters importing torch and megatron costs ~15 s of the suite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

MODES = {"tp1": (1, False), "tp2": (2, False), "tp2-sequence-parallel": (2, True)}


def train(folder: str, tp_size: int, sequence_parallel: bool) -> dict | None:
    """Four SGD steps at this TP size; rank 0 returns the losses and the weights' checksums."""
    from megatron.core import parallel_state
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from hpref.models.attention import CONTEXT_KWARG
    from hpref.models.megatron import MegatronBackbone
    from hpref.models.megatron.convert import megatron_to_hf, shape_of
    from hpref.models.megatron.sequence_parallel import sum_partial_gradients
    from hpref.models.packed_layout import VarlenContext

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    shape = shape_of(AutoConfig.from_pretrained(folder))
    backbone = MegatronBackbone(shape, tp_size=tp_size, sequence_parallel=sequence_parallel)
    backbone.load_hf_state(load_file(str(Path(folder) / "model.safetensors")), tp_rank=tp_rank)
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
    state = {k: v for k, v in backbone.state_dict().items() if isinstance(v, torch.Tensor)}
    shards = [None] * tp_size
    group = parallel_state.get_tensor_model_parallel_group()
    dist.all_gather_object(shards, state, group=group)
    parallel_state.destroy_model_parallel()
    if dist.get_rank() != 0:
        return None
    hf = megatron_to_hf(shards, shape)
    return {"losses": losses, "checksum": {k: float(v.double().sum()) for k, v in hf.items()}}


def main(folder: str, out: str) -> None:
    dist.init_process_group("gloo")
    results = {mode: train(folder, tp, sequence) for mode, (tp, sequence) in MODES.items()}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
