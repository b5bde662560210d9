"""`hpref train` and `hpref init`: validate the recipe, then run the workers.

One process runs in-process (no torchrun, same worker code). More start through torchrun's own
parser and launcher (`torch.distributed.run`, the torchtune way), so every torchrun behaviour is
there and a cluster needs nothing new:

- one node: c10d rendezvous on 127.0.0.1 and a free port;
- several nodes: the same `--rdzv-endpoint HOST:PORT` on every node and each node's own
  `--node-rank`: torchrun's static rendezvous (HOST:PORT is rank 0's node, node ranks as given),
  which is what schedulers such as SLURM hand out.

A rank that fails stops the others (torchrun's agent watches them every 0.1 s) and the launcher
reports which rank died, with what, and where its log is; its exit code becomes `hpref`'s.
"""

from __future__ import annotations

import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from hpref.recipe import Recipe, load_recipe

WORKER_MODULE = "hpref.train.worker"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_nproc(recipe: Recipe) -> int:
    """The number of visible GPUs, else the recipe's `launch.nproc`."""
    import torch

    if torch.cuda.is_available() and recipe.launch.backend != "gloo":
        return torch.cuda.device_count()
    return recipe.launch.nproc


@dataclass(frozen=True)
class LaunchPlan:
    nproc_per_node: int
    nnodes: int
    worker_args: list[str]
    torchrun_args: list[str] | None  # None: one process, in-process

    def command(self) -> str:
        """The exact command this launch runs (or, in-process, its stand-alone equivalent)."""
        if self.torchrun_args is None:
            return shlex.join([sys.executable, "-m", WORKER_MODULE, *self.worker_args])
        return shlex.join(["torchrun", *self.torchrun_args])


def plan_launch(
    recipe_path: str | Path,
    overrides: list[str],
    recipe: Recipe,
    *,
    nproc_per_node: int | None = None,
    nnodes: int | None = None,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    resume: str | Path | None = None,
) -> LaunchPlan:
    nproc = nproc_per_node or default_nproc(recipe)
    nodes = nnodes or recipe.launch.nnodes
    worker_args = ["--recipe", str(recipe_path)]
    for text in overrides:
        worker_args += ["--set", text]
    if resume is not None:
        worker_args += ["--resume", str(resume)]
    if nproc * nodes == 1:
        return LaunchPlan(nproc, nodes, worker_args, None)
    endpoint = rdzv_endpoint or recipe.launch.rdzv_endpoint
    args = ["--nproc-per-node", str(nproc), "--nnodes", str(nodes), "--max-restarts", "0"]
    if nodes == 1 and endpoint is None:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    elif nodes == 1:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    elif endpoint is None:
        from hpref.errors import UserError

        raise UserError(
            f"{nodes} nodes need --rdzv-endpoint HOST:PORT (or launch.rdzv_endpoint), the same on every node"
        )
    else:
        rank = node_rank if node_rank is not None else recipe.launch.node_rank
        host, _, port = endpoint.rpartition(":")
        args += [
            "--rdzv-backend",
            "static",
            "--node-rank",
            str(rank),
            "--master-addr",
            host,
            "--master-port",
            port,
        ]
    args += ["--module", WORKER_MODULE, *worker_args]
    return LaunchPlan(nproc, nodes, worker_args, args)


def run_train(
    recipe_path: str | Path,
    overrides: list[str] | None = None,
    *,
    nproc_per_node: int | None = None,
    nnodes: int | None = None,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    resume: str | Path | None = None,
    dry_run: bool = False,
) -> int:
    """Validate the recipe, then train; returns the exit code (0 done, 2 user error, else failure).

    A recipe error raises `UserError` before anything starts. `dry_run` prints the exact command
    and the resolved recipe, and returns 0.
    """
    overrides = list(overrides or [])
    recipe = load_recipe(recipe_path, overrides)
    plan = plan_launch(
        recipe_path,
        overrides,
        recipe,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        resume=resume,
    )
    if dry_run:
        print(plan.command())
        print()
        print(recipe.to_toml())
        return 0
    if plan.torchrun_args is None:
        from hpref.train.worker import run_worker

        return run_worker(
            recipe_path, overrides, resume=None if resume is None else str(resume), console=False
        )
    return run_torchrun(plan.torchrun_args, recipe.run.run_dir)


def run_torchrun(argv: list[str], run_dir: Path) -> int:
    """torchrun in this process; a failed rank becomes one log line and its exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logger.info(f"launching: torchrun {shlex.join(argv)}")
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", message)
        what = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else failure.signal_name()
        logger.error(
            f"rank {rank} failed ({what}): {message}; log: {Path(run_dir) / 'logs' / f'rank{rank}.log'}"
        )
        others = sorted(r for r in exc.failures if r != rank)
        if others:
            logger.error(f"stopped with it: rank(s) {', '.join(map(str, others))}")
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def run_init(recipe_path: str | Path, overrides: list[str] | None = None) -> Path:
    """Build the recipe's model (backbone + new head) and save it as safetensors in `run_dir/init`.

    `hpref train` with the same run folder starts from these weights. Returns the folder.
    """
    from hpref.errors import UserError
    from hpref.plugins import load_plugins
    from hpref.train.sharding import INIT_FOLDER

    recipe = load_recipe(recipe_path, list(overrides or []))
    if recipe.model is None:
        raise UserError(f"{recipe_path}: the recipe has no [model] section")
    model = (
        load_plugins().get("model", recipe.model.name).build(recipe.model.config, num_labels=3, device="cpu")
    )
    folder = recipe.run.run_dir / INIT_FOLDER
    model.save_pretrained(folder)
    recipe.write(recipe.run.run_dir)
    params = sum(p.numel() for p in model.parameters())
    logger.info(f"initial weights of {recipe.model.name} ({params:,} parameters) written to {folder}")
    return folder
