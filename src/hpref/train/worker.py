"""One training process: `python -m hpref.train.worker --recipe R [--set k=v ...] [--resume auto|PATH]`.

torchrun starts one per rank (RANK / WORLD_SIZE / LOCAL_RANK in the environment); `hpref train`
with one process calls `run_worker` directly, with a one-rank gloo (or nccl) group on a HashStore,
so both paths run exactly the same code. The recipe is read once per process: the in-process worker
is handed the launcher's `Recipe`; a rank under hpref's launcher reads the resolved `recipe.toml`
the launcher checked and wrote (`hpref.runfolder.start.RESOLVED_RECIPE_ENV`); a worker started by hand
(the `--dry-run` command) reads `--recipe` with its `--set`s, checks it and writes the resolved copy.

setup -> (resume) -> fit -> cleanup. Exit codes: 0 done, 2 a user error (bad recipe, data, resume
folder), 1 anything else; a failing rank writes torchelastic's error file so the launcher can name it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch.distributed as dist
from loguru import logger

from hpref.errors import UserError
from hpref.recipe import Recipe, load_recipe
from hpref.runfolder.start import RESOLVED_RECIPE_ENV, write_resolved_recipe
from hpref.runfolder.start import log_file as run_log_file
from hpref.runtime.distributed import DistInfo, init_distributed, seed_everything
from hpref.runtime.watchdog import LAUNCHER_PID_ENV, die_with_parent, start_heartbeat


def _console_sink(message) -> None:
    sys.stderr.write(str(message))  # looked up per call, so rich's progress bar can redirect it


def setup_worker_logging(run_dir: Path, rank: int, *, console: bool) -> tuple[Path, list[int]]:
    """A full DEBUG log per rank in the run folder; with `console`, INFO on stderr from rank 0.
    Returns the log file and the handler ids, which the worker removes when it ends."""
    from hpref.logs import CONSOLE_FORMAT, add_log_file, route_library_logs

    log_file = run_log_file(run_dir, f"rank{rank}")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    logger.configure(extra={"rank": rank})
    handlers = [add_log_file(log_file)]
    route_library_logs()  # torch's, transformers' and bitsandbytes' records to the rank's log file
    if console and rank == 0:
        # under hpref's launcher a failure reaches the console once, as the launcher's line naming
        # the rank and its log; rank 0 printing it too would say it twice
        launched = LAUNCHER_PID_ENV in os.environ
        handlers.append(
            logger.add(
                _console_sink,
                level="INFO",
                format=CONSOLE_FORMAT,
                colorize=sys.stderr.isatty(),
                filter=lambda record: (
                    not record["extra"].get("file_only")
                    and not (launched and record["level"].no >= logger.level("ERROR").no)
                ),
            )
        )
    return log_file, handlers


def build_setup(recipe: Recipe, info: DistInfo):
    """The recipe's parts (`hpref.components.Components`): model (+ LoRA adapters) -> formatter ->
    tokenized data -> sharded model -> optimizer (what trains), sampler, scheduler, loss."""
    from hpref.components import Components
    from hpref.data.formatting import check_pairing
    from hpref.data.packing import StepSampler
    from hpref.models.precision import ProbeShape, resolve_precision
    from hpref.runtime.peak import peak_flops
    from hpref.train.data import require_labels, tokenize, tokenize_cached
    from hpref.train.loop import TrainSetup
    from hpref.train.sharding import init_weights_folder, load_initial_weights

    parts = Components(recipe)
    train_cfg = recipe.train
    model = parts.model(device=info.device, meta=True)
    if train_cfg.max_length > model.max_position_embeddings:
        raise UserError(
            f"train.max_length {train_cfg.max_length} exceeds the model's "
            f"{model.max_position_embeddings} positions"
        )
    formatter = parts.formatter(model.tokenizer)
    check_pairing(formatter, model)

    train_source = parts.source("train")
    train_data = tokenize_cached(train_source, formatter, swap=train_cfg.swap, name="dataset.train")
    require_labels(train_data, "dataset.train")
    eval_source = parts.source("eval")
    eval_data = None
    if eval_source is not None:
        eval_data = tokenize(eval_source.battles(), formatter, both_views=False, name="dataset.eval")
        require_labels(eval_data, "dataset.eval")
    logger.info(
        f"data: {train_data.num_battles} train battles "
        f"({sum(2 if e.split else 1 for e in train_data.examples)} sequences, "
        f"{sum(train_data.lengths):,} tokens)"
        + (f", {len(eval_data.battles)} eval battles" if eval_data is not None else ", no eval set")
    )

    dtype = resolve_precision(train_cfg.precision, info.device, ProbeShape.of(model.backbone_config))
    parts.parallelize(model, param_dtype=dtype, activation_checkpointing=train_cfg.activation_checkpointing)
    load_initial_weights(model, device=info.device, init_folder=init_weights_folder(recipe.run.run_dir))
    optimizer = parts.optimizer(model)
    # a tensor-parallel model's ranks share micro-batches: data is split over its data-parallel group
    data_parallel = model.data_parallel

    sampler = StepSampler(
        lengths=train_data.lengths,
        rows=[e.row for e in train_data.examples],
        swapped=[e.swapped for e in train_data.examples],
        batch_size=train_cfg.batch_size,
        world_size=data_parallel.size if data_parallel is not None else info.world_size,
        micro_batch_tokens=train_cfg.micro_batch_tokens,
        seed=recipe.run.seed,
        swap=train_cfg.swap,
    )
    total_steps = sampler.steps_per_epoch() * train_cfg.epochs
    if train_cfg.max_steps is not None:
        total_steps = min(total_steps, train_cfg.max_steps)
    scheduler = parts.scheduler(optimizer, total_steps)
    peak = peak_flops(info.device, dtype)
    logger.info(
        f"{total_steps} steps ({sampler.steps_per_epoch()} per epoch x {train_cfg.epochs}), "
        f"{train_cfg.batch_size} battles per step; MFU against {peak}"
    )
    pad = model.tokenizer.pad_token_id
    return TrainSetup(
        recipe=recipe,
        run_dir=recipe.run.run_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        train_data=train_data,
        eval_data=eval_data,
        device=info.device,
        rank=info.rank,
        world_size=info.world_size,
        total_steps=total_steps,
        filler_token_id=int(pad) if pad is not None else 0,
        peak=peak,
        eval_source=eval_source,
        train_source=train_source,
        backbone_flops=model.flops_per_token,
        loss=parts.loss,
        data_parallel=data_parallel,
    )


def _record_failure(exc: BaseException) -> None:
    """torchelastic's error file (when torchrun set one): the launcher reads the message back."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


def run_worker(
    recipe_path: str | Path,
    overrides: list[str] | None = None,
    *,
    resume: str | None = None,
    console: bool = True,
    recipe: Recipe | None = None,
) -> int:
    """Train on this process's rank; returns the exit code (see the module docstring).

    `console=False` leaves console logging to the caller (an in-process run from the CLI, which has
    its own console handler); the per-rank log file is always written. `recipe`: the launcher's,
    already checked and written to the run folder (then `recipe_path` and `overrides` are not read)."""
    from hpref.memory import cap_onednn_cache
    from hpref.train.checkpoint import resolve_resume
    from hpref.train.loop import fit

    cap_onednn_cache()  # before the first matmul builds oneDNN's cache (hpref.memory)
    rank = int(os.environ.get("RANK", "0"))
    by_hand = recipe is None and RESOLVED_RECIPE_ENV not in os.environ
    try:
        if recipe is None:
            resolved = os.environ.get(RESOLVED_RECIPE_ENV)
            recipe = load_recipe(resolved) if resolved else load_recipe(recipe_path, overrides)
    except UserError as exc:
        _record_failure(exc)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    run_dir = recipe.run.run_dir
    log_file, handlers = setup_worker_logging(run_dir, rank, console=console)
    # under hpref's launcher, a failed rank's error reaches the user through the launcher's one line
    launched = LAUNCHER_PID_ENV in os.environ
    failed = False
    try:
        info = init_distributed(recipe.launch.backend, recipe.launch.collective_timeout_s)
        seed_everything(recipe.run.seed, info.rank)
        if by_hand and info.rank == 0:
            write_resolved_recipe(recipe, run_dir)
        logger.info(
            f"rank {info.rank}/{info.world_size} on {info.device} ({info.backend}); run folder {run_dir}"
        )
        if by_hand:  # a worker started without the launcher gets the launcher's recipe checks
            from hpref.train.checks import check_train

            check_train(recipe, machine=False)
        if recipe.dpo is not None:  # offline DPO of a causal-LM policy (hpref.train.dpo)
            from hpref.train.dpo import build_dpo_setup

            setup = build_dpo_setup(recipe, info)
        else:
            setup = build_setup(recipe, info)
        resume_from = resolve_resume(run_dir, resume)
        fit(setup, resume_from)
        dist.barrier()  # rank 0 prints the summary last; no rank tears the group down under it
        return 0
    except UserError as exc:
        failed = True
        _record_failure(exc)
        logger.error(str(exc))
        if rank != 0 and not launched:
            print(f"rank {rank}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        failed = True
        _record_failure(exc)
        logger.opt(exception=exc).debug("traceback")
        message = f"rank {rank}: {type(exc).__name__}: {exc} (traceback in {log_file})"
        logger.error(message)
        if rank != 0 and not launched:
            print(message, file=sys.stderr)
        return 1
    finally:
        # After a failure the peers may be anywhere (in a collective, or tearing down too): gloo
        # aborted the process (SIGABRT, exit 1 instead of the error's own code) when two ranks
        # destroyed the group at once, so a failed rank under the launcher leaves the group to
        # process exit. An in-process run (one rank, no launcher) must destroy it: the process
        # goes on, and the next run in it would find a group already initialised.
        if dist.is_initialized() and not (failed and launched):
            dist.destroy_process_group()
        for handler in handlers:
            logger.remove(handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpref.train.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="recipe TOML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value")
    parser.add_argument("--resume", default=None, help="auto, a checkpoint folder, or a run folder")
    args = parser.parse_args(argv)
    die_with_parent()
    start_heartbeat(int(os.environ.get("RANK", "0")))
    logger.remove()  # loguru's default stderr handler would print on every rank
    code = run_worker(args.recipe, args.overrides, resume=args.resume)
    if code != 0 and dist.is_initialized():
        # A failed rank under the launcher keeps its process group (see run_worker's finally):
        # interpreter teardown then destroys gloo's objects while its threads still run, and
        # std::terminate turns the error's exit code into SIGABRT. Leave without teardown: the logs
        # are closed and torchelastic's error file is written by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
