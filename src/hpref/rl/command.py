"""`hpref rl` and `hpref rl-warmup` from the command line: the checks before a run, then the run.

Everything a user can get wrong is refused before the run folder is touched: a recipe without
`[rl]`, an unknown policy id, a fresh start on a folder that holds another run's record. Only then
does the run folder get its resolved recipe and log (`hpref.runfolder.start`), and the driver start.
From the checks on, SIGTERM and Ctrl-C stop the run gracefully (`hpref.rl.control.stop`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RlRequest:
    """`hpref rl`'s options, built once by the CLI."""

    recipe_path: Path
    policies: str
    overrides: Sequence[str] = ()
    ray_address: str | None = None
    resume: str | None = None
    plan: bool = False  # print where every actor would go and its memory; start nothing (rl.plan)
    log: tuple[str, ...] = ()  # `--log`: metric loggers beside the recipe's `[logging] loggers`


@dataclass(frozen=True)
class WarmupRequest:
    """`hpref rl-warmup`'s options, built once by the CLI (`policies`: comma-separated ids, None for
    every policy)."""

    recipe_path: Path
    policies: str | None = None
    overrides: Sequence[str] = ()


def policy_ids(text: str) -> list[str]:
    """`--policies a, b` -> ["a", "b"] (the first leads)."""
    return [p.strip() for p in text.split(",") if p.strip()]


def _rl_recipe(recipe_path: Path, overrides: list[str]) -> Any:
    from hpref.errors import RecipeError
    from hpref.recipe import load_recipe

    loaded = load_recipe(recipe_path, overrides)
    if loaded.rl is None:
        raise RecipeError(f"{recipe_path}: rl: the recipe has no [rl] section")
    return loaded


def rl_command(request: RlRequest) -> int:
    """`hpref rl`: check, start the run folder, run (`hpref.rl.run_rl`); returns the exit code.
    With `plan`, print the plan instead (`hpref.rl.plan.table.run_plan`: 0 when it fits, 2 when not)."""
    import hpref.rl
    from hpref.logs import ACTOR_LOG_DIR_ENV
    from hpref.rl.control.preflight import preflight
    from hpref.rl.launch import resume_source
    from hpref.runfolder.start import start_run_folder

    recipe_path, resume = request.recipe_path, request.resume
    loaded = _rl_recipe(recipe_path, list(request.overrides))
    ids = policy_ids(request.policies)
    loaded.rl.select(ids)  # an unknown policy id is a user error before the run folder is touched
    from hpref.builtin.loggers import check_loggers
    from hpref.recipe.logging_section import add_loggers

    add_loggers(loaded, request.log)  # `--log`: beside the recipe's [logging] loggers
    check_loggers(loaded, loaded.run.run_dir)  # wandb missing, a TensorBoard folder not writable
    if request.plan:  # the plan reads the recipe and the first prompts only: no run folder, no actor
        from hpref.rl.plan.table import run_plan

        return run_plan(loaded, ids, request.ray_address)
    from loguru import logger

    from hpref.memory import cap_onednn_cache
    from hpref.rl.control.stop import StopNow, StopSignals, stopped_line

    # before this process's first matmul: CPU engines may run here (`rl.executor_in_driver`)
    cap_onednn_cache()

    # SIGTERM, Ctrl-C: before the policies' loops, a stop at once; in them, a save first
    with StopSignals(loaded.rl.stop_timeout_s) as signals:
        try:
            # A fresh start on a folder that holds another run's record is refused before anything
            # is written.
            resume_source(loaded.run.run_dir, resume)
            prompts = preflight(loaded, ids)  # models, rewards, the prompt file: before the run folder
            log = start_run_folder(loaded, "rl")
            os.environ[ACTOR_LOG_DIR_ENV] = str(log.parent)  # each actor's libraries' records beside it
            return hpref.rl.run_rl(loaded, ids, request.ray_address, resume, prompts=prompts, signals=signals)
        except StopNow as stop:  # before run_rl started anything (run_rl answers the ones in it)
            logger.warning(stopped_line(loaded.run.run_dir, stop))
            return stop.exit_code


def warmup_lines(request: WarmupRequest) -> Iterator[str]:
    """`hpref rl-warmup`: build (or find in the cache) each policy's warm-up checkpoint; yields one
    line per policy: its id, a tab, the checkpoint folder (or its own `model.path`)."""
    from hpref.errors import RecipeError
    from hpref.models.causal_lm import policy_tokenizer
    from hpref.rl.placement.shared_base import resolve_share_base
    from hpref.rl.warmup.data import check_source
    from hpref.rl.warmup.supervised import warmup_checkpoint, warmup_settings

    loaded = _rl_recipe(request.recipe_path, list(request.overrides))
    config = loaded.rl
    where = str(request.recipe_path)
    if config.warmup is None:
        raise RecipeError(f"{where}: rl.warmup: the recipe has no [rl.warmup] section to build")
    ids = config.select(policy_ids(request.policies) if request.policies else sorted(config.policies))
    check_source(config.warmup, where)
    # decided as `hpref rl --policies` with these ids decides it: a shared base has one warm-up
    settings = warmup_settings(resolve_share_base(config, ids, where), ids)
    for p in ids:
        if p not in settings:
            model = config.policies[p].model
            yield f"{p}\t{model.path or model.name}\t(pretrained: no warm-up)"
            continue
        model, lora = settings[p]
        policy_tokenizer(model)
        yield f"{p}\t{warmup_checkpoint(model, config.warmup, lora=lora)}"
