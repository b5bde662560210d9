"""The nodes a run would be placed on, as `hpref rl --plan` sees them, and Ray's PACK placement
simulated over them (`pack`): the plan must not create a placement group on the cluster it
describes. The nodes are this machine (`local_node`) or the live nodes of a cluster the plan joins
read-only (`ray_nodes`), each GPU's memory as torch or Ray's accelerator type says (`gpu_memory_of`,
`GPU_MEMORY_GB`), or unknown. The asks and bundles packed are `hpref.rl.placement.resources`'.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hpref.rl.placement.resources import HOSTED, ActorAsk, bundles

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


# --------------------------------------------------------------------------------------------------
# simulated placement, for the plan


@dataclass
class Node:
    """A node as the plan sees it: Ray's resources, its memory, and each GPU's memory when known
    (`gpu_memory_of` below)."""

    name: str
    cpus: float
    gpus: int
    memory: int
    gpu_memory: int | None = None
    gpu_note: str = ""  # where `gpu_memory` came from, or why it is unknown
    free_cpus: float = field(init=False)
    free_gpus: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.free_cpus = self.cpus
        self.free_gpus = [1.0] * self.gpus

    def take(self, cpus: float, gpus: float, *, dry: bool = False) -> list[int] | None:
        """The GPU ids a bundle of `cpus` and `gpus` gets here (whole GPUs for 1 or more, a share of
        one otherwise), or None when it does not fit; `dry` only checks."""
        if cpus > self.free_cpus + 1e-9:
            return None
        if gpus >= 1:
            ids = [i for i, f in enumerate(self.free_gpus) if f >= 1 - 1e-9][: math.ceil(gpus)]
            if len(ids) < math.ceil(gpus):
                return None
        elif gpus > 0:
            ids = [i for i, f in enumerate(self.free_gpus) if f + 1e-9 >= gpus][:1]
            if not ids:
                return None
        else:
            ids = []
        if not dry:
            self.free_cpus -= cpus
            for i in ids:
                self.free_gpus[i] -= min(gpus, 1.0)
        return ids


def pack(
    nodes: Sequence[Node], asks: dict[str, list[ActorAsk]]
) -> dict[ActorAsk, tuple[Node, list[int]] | None]:
    """Where Ray's PACK would put each actor: a policy's bundles all on the first node that holds
    them together, else each bundle on the first node with room (first fit, in `nodes` order);
    None for an actor whose bundle fits nowhere. Policies are placed in order, as `reserve` asks. An
    engine in the rollout executor's process (`HOSTED`) is not here: it goes where the executor goes."""
    out: dict[ActorAsk, tuple[Node, list[int]] | None] = {}
    for policy_asks in asks.values():
        wanted = bundles(policy_asks)
        together = next((n for n in nodes if _holds_all(n, wanted)), None)
        placed: list[tuple[Node, list[int]] | None] = []
        for b in wanted:
            cpus, gpus = b.get("CPU", 0.0), b.get("GPU", 0.0)
            candidates = [together] if together is not None else list(nodes)
            spot = None
            for node in candidates:
                ids = node.take(cpus, gpus)
                if ids is not None:
                    spot = (node, ids)
                    break
            placed.append(spot)
        for ask in policy_asks:
            if ask.bundle != HOSTED:
                out[ask] = placed[ask.bundle]
    return out


def _holds_all(node: Node, wanted: Sequence[Mapping[str, float]]) -> bool:
    """Whether every bundle fits on `node` at once (tried on a copy of its free resources)."""
    trial = Node(node.name, node.cpus, node.gpus, node.memory)
    trial.free_cpus, trial.free_gpus = node.free_cpus, list(node.free_gpus)
    return all(trial.take(b.get("CPU", 0.0), b.get("GPU", 0.0)) is not None for b in wanted)


# --------------------------------------------------------------------------------------------------
# the nodes, as the plan sees them

#: Each GPU's memory by the accelerator type a Ray node reports (its `accelerator_type:<kind>`
#: resource, its `ray.io/accelerator-type` label: the kind, never the size; Ray 2.60's nodes report no
#: GPU memory), in the vendors' GB as sold, read as 10^9 bytes: at most what CUDA sees (an H100's
#: 80 GB is 74.5 GiB of its 79.6; an L4's 24 GB 22.4 of 22.5), so "fits" errs on the safe side.
#: Kinds sold in several sizes list each; Ray's own names for one size (`A100-80G`, which a node
#: declares with `ray start --resources '{"accelerator_type:A100-80G": 1}'`) say which.
GPU_MEMORY_GB: dict[str, tuple[int, ...]] = {
    "A100": (40, 80),
    "A100-40G": (40,),
    "A100-80G": (80,),
    "H100": (80,),
    "H200": (141,),
    "L4": (24,),
    "L40S": (48,),
    "A10G": (24,),
    "T4": (16,),
    "V100": (16, 32),
    "V100-16G": (16,),  # no Ray name for a V100's size: named as Ray names the A100's
    "V100-32G": (32,),
    "AMD-Instinct-MI300X-OAM": (192,),
    "AMD-Instinct-MI300X-HF": (192,),
}
#: The node label Ray sets to a node's accelerator type (beside its `accelerator_type:` resource)
ACCELERATOR_LABEL = "ray.io/accelerator-type"


def local_node() -> Node:
    """This machine as a local run's one node: its CPUs, its GPUs torch sees, its memory."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if gpus else None
    note = f"{torch.cuda.get_device_name(0)}, as torch reports it" if gpus else ""
    return Node("this machine", float(os.cpu_count() or 1), gpus, _total_memory(), gpu_memory, note)


def gpu_memory_of(resources: dict[str, float], labels: dict[str, str]) -> tuple[int | None, str]:
    """(bytes of each GPU, where that came from) for a Ray node's resources and labels, by the
    accelerator type it reports (`GPU_MEMORY_GB`); None with the reason when it is not known."""
    kinds = {k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")}
    kinds |= {labels[ACCELERATOR_LABEL]} if labels.get(ACCELERATOR_LABEL) else set()
    if not kinds:
        return None, "Ray reports no accelerator type for it"
    sized = sorted(k for k in kinds if len(GPU_MEMORY_GB.get(k, ())) == 1)
    if sized:  # the smallest, should a node declare two that disagree
        kind = min(sized, key=lambda k: GPU_MEMORY_GB[k][0])
        gb = GPU_MEMORY_GB[kind][0]
        return gb * 10**9, f"{kind}: {gb} GB as sold"
    several = sorted(k for k in kinds if k in GPU_MEMORY_GB)
    if several:
        kind = several[0]
        sizes = " or ".join(f"{g}" for g in GPU_MEMORY_GB[kind])
        return None, (
            f"Ray reports {kind}, sold with {sizes} GB; declare which with "
            f"ray start --resources '{{\"accelerator_type:{kind}-{GPU_MEMORY_GB[kind][-1]}G\": 1}}'"
        )
    return None, f"Ray reports {', '.join(sorted(kinds))}, not in hpref.rl.placement.nodes.GPU_MEMORY_GB"


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: no memory check
        return 0


def ray_nodes(address: str) -> list[Node]:
    """The live nodes of the Ray cluster at `address`, joined read-only and left again."""
    import ray

    from hpref.runtime.ray_cluster import connect_ray

    connected = connect_ray(address)
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
    finally:
        if connected:
            ray.shutdown()
    out = []
    for n in nodes:
        res = n["Resources"]
        gpu_memory, note = gpu_memory_of(res, n.get("Labels") or {})
        memory = int(res.get("memory", 0) + res.get("object_store_memory", 0))
        name = n.get("NodeName") or n.get("NodeManagerAddress") or n["NodeID"][:8]
        out.append(Node(name, float(res.get("CPU", 0)), int(res.get("GPU", 0)), memory, gpu_memory, note))
    return out
