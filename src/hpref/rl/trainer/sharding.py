"""A policy's trainer over several ranks: its device, its process group, FSDP2, the rollout's split.

    rank 0:      host, port = open_rendezvous(world_size)      # serves the group's TCPStore
    every rank:  join_group(host, port, rank, world_size, device)  # (`hpref.rl.transport.rendezvous`)
                 root = shard_policy(lm, device)               # FSDP2 per decoder block + a root
                 mine = split_groups(costs, world_size)[rank]  # whole prompt groups, by tokens

Each rank of a policy is one Ray actor (`hpref.rl.trainer.actor.TrainerActor` with `world_size > 1`;
`hpref.rl.trainer.group.TrainerGroup` drives them as one trainer). A rank builds the whole policy, then
`fully_shard` keeps its 1/N of every parameter, and the AdamW moments it creates afterwards are
1/N too. Every rank sees the whole rollout and computes the same split, so the split needs no
messages; each micro-batch's loss is weighted by its share of the whole rollout's tokens, and the
loss is scaled by the world size because FSDP2's reduce-scatter averages over ranks (as
`hpref.train.loop` does): the summed gradient is the one-rank gradient of the same rollout.

FSDP2's collectives need every rank to run the same number of forward and backward passes, so a
rank with fewer micro-batches runs padding ones whose loss has weight 0 (the trainer's
`_micro_batches`).

Full weights leave the shards one tensor at a time (`full_tensor`, a collective every rank joins in
the same order): a weight sync streams them in buckets (`hpref.rl.transport.weight_channel`), a save gathers
what it writes, and a load puts full tensors back into shards (`hpref.models.parallelize.shard_like`), so a
save has the same files whatever the number of ranks and resumes on any other number.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from hpref.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hpref.rl.algorithms.objectives import StatsReduce


def trainer_device(policy: str, rank: int, gpus: float) -> torch.device:
    """The device a trainer rank computes on: the CUDA device Ray assigned (`gpus` > 0), else the CPU.

    A rank that was given a GPU and cannot see one through torch (a CPU build of torch, or a driver
    the build does not support) is refused in one line: training it on the CPU would look like a
    working run hundreds of times slower."""
    import torch

    if gpus <= 0:
        return torch.device("cpu")
    assigned = _ray_gpu_ids()
    if not torch.cuda.is_available():
        raise UserError(
            f"policy '{policy}' trainer rank {rank}: Ray assigned it GPU {', '.join(assigned) or '?'} "
            f"(gpus_per_rank = {gpus:g}) but torch {torch.__version__} sees no CUDA device; install a CUDA "
            "build of torch on the node, or set gpus_per_rank = 0 to train on the CPU"
        )
    # Ray sets CUDA_VISIBLE_DEVICES to the rank's own GPU(s): the first visible one is the rank's
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def _ray_gpu_ids() -> list[str]:
    try:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # outside a Ray worker (an in-process trainer in tests)
        return []


def _log_probs_module() -> type:
    """`LogProbsRoot`: the FSDP2 root around a causal LM whose `forward` is `completion_logprobs`.

    `completion_logprobs` calls the LM's decoder and its head separately (the head only where an
    answer token is predicted), never the LM's own `forward`; FSDP2 gathers a unit's weights in
    the unit's forward hooks, so the root must be a module whose forward is that whole computation,
    or the embeddings, final norm and head would be used sharded."""
    from torch import nn

    from hpref.rl.policy import completion_logprobs

    class LogProbsRoot(nn.Module):
        def __init__(self, lm: nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(
            self, batch: dict[str, Any], temperature: float, entropy: bool = False
        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
            return completion_logprobs(self.lm, batch, temperature, entropy=entropy)

    return LogProbsRoot


def shard_policy(lm: nn.Module, device: torch.device, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 over the group: each decoder block its own unit, the rest (embeddings, norm, head) in
    the root; returns the root, which computes `completion_logprobs(lm, batch, temperature)`. The
    weights stay fp32 masters; the trainer's autocast gives the compute dtype.
    `reshard_after_forward` False keeps a block's weights gathered from its forward to its
    backward: one gather per micro-batch instead of three (the prompt's forward, the answers'
    forward on its cache, the backward), for the whole weights held during the step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpref.models.lm_adapters import decoder_blocks

    lm.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in decoder_blocks(lm):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    root = _log_probs_module()(lm)
    fully_shard(root, mesh=mesh)
    return root


# --------------------------------------------------------------------------------------------------
# the rollout's split


def split_groups(costs: list[int], ranks: int) -> list[list[int]]:
    """Item indices (prompt groups) per rank, balanced by cost (padded tokens): the costliest first,
    each to the rank with the least so far; ties to the lower rank, so every rank computes the same
    split. Each rank's indices come back sorted."""
    loads = [0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += costs[i]
    return [sorted(x) for x in out]


def reduce_stats(
    sums: dict[str, float], maxes: dict[str, float]
) -> tuple[dict[str, float], dict[str, float]]:
    """Sums and maxima of per-rank statistics over the group (every rank gets the same).

    The ranks first agree on the statistics' names: a rank whose share of a rollout was only padding
    (fewer prompt groups than ranks) ran no loss and has none of the algorithm's keys, and tensors of
    different lengths would fail the all-reduce (or hang it); its missing sums count 0, maxima nothing."""
    import torch
    import torch.distributed as dist

    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, (sorted(sums), sorted(maxes)))
    keys_s = sorted({k for theirs, _ in names for k in theirs})
    keys_m = sorted({k for _, theirs in names for k in theirs})
    s = torch.tensor([sums.get(k, 0.0) for k in keys_s], dtype=torch.float64)
    m = torch.tensor([maxes.get(k, float("-inf")) for k in keys_m], dtype=torch.float64)
    dist.all_reduce(s, op=dist.ReduceOp.SUM)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return dict(zip(keys_s, s.tolist(), strict=True)), dict(zip(keys_m, m.tolist(), strict=True))


def reduce_over(data_ranks: int) -> StatsReduce:
    """How a trainer reduces its statistics: `reduce_stats` when a rollout is split over `data_ranks`
    > 1, else the statistics as they are (one rank, or megatron's tensor-parallel ranks, which each
    run the whole rollout)."""
    return reduce_stats if data_ranks > 1 else _as_they_are


def _as_they_are(
    sums: dict[str, float], maxes: dict[str, float]
) -> tuple[dict[str, float], dict[str, float]]:
    return sums, maxes


def max_over_group(value: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# --------------------------------------------------------------------------------------------------
# full weights out of the shards


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (a collective: every rank calls it), a plain one as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def plain_items(lm: nn.Module, lora: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The LM's weights under the plain transformers keys, one at a time, in one order on every
    rank: with LoRA merged in and whole (`hpref.models.lm_adapters.merged_lm_items`, the adapted
    weights gathered here), else the model's own tensors, shards of a group still shards (a
    consumer gathers them: `hpref.rl.transport.weight_channel.pack_buckets` straight into its buffer, or
    `full`). Nothing is copied: what a caller keeps past the next step, it must copy."""
    if lora:
        from hpref.models.lm_adapters import merged_lm_items

        yield from merged_lm_items(lm, full)
        return
    for key, tensor in lm.state_dict().items():
        yield key, tensor.detach()


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with every sharded moment gathered: the one-rank layout."""
    state = optimizer.state_dict()
    return {
        "state": {i: {k: full(v) for k, v in s.items()} for i, s in state["state"].items()},
        "param_groups": state["param_groups"],
    }


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A one-rank optimizer state dict with each moment cut like its parameter (for `load_state_dict`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    out: dict[int, dict[str, Any]] = {}
    for i, per_param in state["state"].items():
        param = params[int(i)]
        out[i] = {
            k: distribute_tensor(v.to(param.dtype), param.device_mesh, param.placements)
            if isinstance(param, DTensor) and hasattr(v, "shape") and tuple(v.shape) == tuple(param.shape)
            else v
            for k, v in per_param.items()
        }
    return {"state": out, "param_groups": state["param_groups"]}
