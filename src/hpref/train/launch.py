"""`hpref train` and `hpref init`: validate the recipe, then run the workers.

One process runs in-process (no torchrun, same worker code). More start through torchrun's own
parser and launcher (`torch.distributed.run`, the torchtune way), so every torchrun behaviour is
there and a cluster needs nothing new:

- one node: c10d rendezvous on 127.0.0.1 and a free port;
- several nodes: the same `--rdzv-endpoint HOST:PORT` on every node and each node's own
  `--node-rank`: torchrun's static rendezvous (HOST:PORT is rank 0's node, node ranks as given),
  which is what schedulers such as SLURM hand out.

Starting them, watching them (a failed or stalled rank named in one line) and the one-node
loopback rendezvous are `hpref.runtime.torchrun`'s, shared with `hpref eval`.

SIGTERM and Ctrl-C stop a run gracefully (`hpref.runtime.stop_signals`, either way it runs): the
ranks save the step in flight and end, then one line says where `--resume auto` continues, and the
exit code is 128 + the signal; a second signal stops at once.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from hpref.errors import UserError
from hpref.recipe import Recipe, load_recipe
from hpref.runfolder.checkpoints import find_latest, step_of
from hpref.runfolder.heartbeat import HEARTBEAT_STALE_S, run_status
from hpref.runfolder.start import RESOLVED_RECIPE_ENV, write_resolved_recipe
from hpref.runtime.stop_signals import GracefulStop, StopNow, exit_code, signal_name
from hpref.runtime.torchrun import free_port, run_torchrun, set_environment

if TYPE_CHECKING:
    from hpref.train.request import TrainRequest

WORKER_MODULE = "hpref.train.worker"


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
    rdzv_timeout: int | None = None,
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
        raise UserError(
            f"{nodes} nodes need --rdzv-endpoint HOST:PORT (or launch.rdzv_endpoint), the same on every node"
        )
    else:
        rank = node_rank if node_rank is not None else recipe.launch.node_rank
        host, _, port = endpoint.rpartition(":")
        # torchrun's `timeout` of the static rendezvous: how long node 0's store waits for the
        # others to join and how long another node tries to reach it, before the launch fails
        timeout = rdzv_timeout or recipe.launch.rdzv_timeout_s
        args += [
            "--rdzv-backend",
            "static",
            "--node-rank",
            str(rank),
            "--master-addr",
            host,
            "--master-port",
            port,
            "--rdzv-conf",
            f"timeout={timeout}",
        ]
    args += ["--module", WORKER_MODULE, *worker_args]
    return LaunchPlan(nproc, nodes, worker_args, args)


def run_train(recipe_path: str | Path, overrides: list[str] | None = None, **options: Any) -> int:
    """`launch_train` from keywords (Python callers and tests): `TrainRequest`'s fields, and
    `recipe`, an already loaded `Recipe`."""
    from hpref.train.request import TrainRequest

    recipe = options.pop("recipe", None)
    return launch_train(TrainRequest(Path(recipe_path), tuple(overrides or ()), **options), recipe=recipe)


def launch_train(request: TrainRequest, recipe: Recipe | None = None) -> int:
    """Validate the recipe, then train; returns the exit code (0 done, 2 user error, else failure).

    A recipe error raises `UserError` before anything starts. `dry_run` prints the exact command
    and the resolved recipe, and returns 0. `recipe`: the request's recipe and overrides already
    loaded in this process (`hpref.train.command`), so that it is read once.

    The recipe is checked here, once, and its resolved form written to the run folder's
    `recipe.toml`: the in-process worker is handed the same `Recipe`, and torchrun's workers read that
    file (`RESOLVED_RECIPE_ENV`) rather than the recipe and its overrides again.
    """
    from hpref.builtin.loggers import check_loggers
    from hpref.recipe.logging_section import add_loggers
    from hpref.train.checks import check_train

    recipe_path, overrides, resume = request.recipe_path, list(request.overrides), request.resume
    if recipe is None:
        recipe = load_recipe(recipe_path, overrides)
    add_loggers(recipe, request.log)  # `--log`: beside the recipe's [logging] loggers
    check_train(recipe, recipe_path)  # the same checks as `hpref recipes check`, before any process
    check_loggers(recipe, recipe.run.run_dir)  # wandb missing, a TensorBoard folder not writable
    plan = plan_launch(
        recipe_path,
        overrides,
        recipe,
        nproc_per_node=request.nproc_per_node,
        nnodes=request.nnodes,
        node_rank=request.node_rank,
        rdzv_endpoint=request.rdzv_endpoint,
        rdzv_timeout=request.rdzv_timeout,
        resume=resume,
    )
    if request.dry_run:
        print(plan.command())
        print()
        print(recipe.to_toml())
        return 0
    check_cpu_ranks(plan.nproc_per_node, recipe)
    resolved = write_resolved_recipe(recipe, recipe.run.run_dir)
    run_dir = recipe.run.run_dir
    before = _newest(run_dir)
    stop = GracefulStop(STOP_GRACE_S, ready=lambda: run_status(run_dir)[0])
    try:
        with stop.installed():
            if plan.torchrun_args is None:
                from hpref.train.worker import run_worker

                resume_arg = None if resume is None else str(resume)
                restore = set_environment(stop.environment())
                try:
                    code = run_worker(recipe_path, overrides, resume=resume_arg, console=False, recipe=recipe)
                finally:
                    restore()
            else:
                env = {RESOLVED_RECIPE_ENV: str(resolved), **stop.environment()}
                code = run_torchrun(plan.torchrun_args, run_dir, recipe.launch, env=env, handle_stop=True)
    except StopNow as now:
        logger.warning(_stopped_line(run_dir, now.signum, before, now.reason))
        return exit_code(now.signum)
    if stop.signum is None or code != 0:
        return code
    logger.warning(_stopped_line(run_dir, stop.signum, before))
    return exit_code(stop.signum)


#: How long the step in flight (and its checkpoint) has after a SIGTERM or Ctrl-C before the run is
#: stopped without one: the time after which a run's heartbeat reads as hung. A scheduler's own grace
#: (SLURM's KillWait, Kubernetes' terminationGracePeriodSeconds) must cover a step and a checkpoint
#: for the save to happen at all.
STOP_GRACE_S = HEARTBEAT_STALE_S


def _stopped_line(run_dir: Path, signum: int, before: Path | None, at_once: str | None = None) -> str:
    """The one console line of a stopped run: the signal, what was saved, where a resume continues."""
    latest = _newest(run_dir)
    name = signal_name(signum)
    if latest is None:
        where = "nothing saved yet: run again with --resume auto to start from step 0"
    else:
        where = f"run again with --resume auto to continue from step {step_of(latest)} ({latest.name})"
    if at_once is None and latest is not None and latest != before:
        saved = f"after step {step_of(latest)}; saved checkpoint {latest.name}"
        return f"hpref train: stopped by {name} {saved}; {where}"
    when = f" at once ({at_once})" if at_once else ""
    return f"hpref train: stopped by {name}{when}, without a save; {where}"


def _newest(run_dir: Path) -> Path | None:
    """Where `--resume auto` continues (`find_latest`). Its warnings (a save a second signal cut
    short is a partial folder) go to the log file: the resume says them, the stop says one line."""
    with logger.contextualize(file_only=True):
        return find_latest(run_dir)


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's or `taskset`'s limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_cpu_ranks(nproc: int, recipe: Recipe) -> None:
    """On CPU, refuse more ranks per node than cores unless `launch.oversubscribe`.

    Refused rather than warned: each gloo rank is a full training process with its own copy of the
    data and its own threads, so 64 ranks on 2 cores spend a minute starting up silently and then
    train slower than 2 ranks would, and a warning scrolls away before anything visible happens.
    Oversubscribing on purpose (testing 4-way sharding on a laptop) stays one setting away.
    """
    import torch

    on_gpu = torch.cuda.is_available() and recipe.launch.backend != "gloo"
    cores = cpu_cores()
    if on_gpu or recipe.launch.oversubscribe or nproc <= cores:
        return
    raise UserError(
        f"{nproc} ranks per node on a CPU with {cores} cores: use --nproc-per-node {cores} or fewer, "
        "or --set launch.oversubscribe=true to run them anyway"
    )


def run_init(recipe_path: str | Path, overrides: list[str] | None = None) -> Path:
    """Build the recipe's model (backbone + new head) and save it as safetensors in `run_dir/init`.

    `hpref train` with the same run folder starts from these weights. Returns the folder.
    """
    from hpref.components import Components
    from hpref.runfolder.layout import INIT

    recipe = load_recipe(recipe_path, list(overrides or []))
    if recipe.model is None:
        raise UserError(f"{recipe_path}: the recipe has no [model] section")
    # the plain layout, without adapters: a LoRA run applies its own to these weights
    model = Components(recipe).model(device="cpu", adapters=False)
    folder = recipe.run.run_dir / INIT
    model.save_pretrained(folder)
    recipe.write(recipe.run.run_dir)
    params = sum(p.numel() for p in model.parameters())
    logger.info(f"initial weights of {recipe.model.name} ({params:,} parameters) written to {folder}")
    return folder
