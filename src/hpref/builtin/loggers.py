"""Metric loggers (`[logging] loggers = [...]`, `--log NAME`): where a run's figures go beside its
metrics files. Built-ins: `jsonl` (the run folder's metrics.jsonl files, always written: naming it
changes nothing), `tensorboard` (torch's `SummaryWriter`) and `wandb` (offline by default: a run
folder under the hpref run folder, no network, no account; `mode = "online"` syncs).

A record becomes scalars under stable names: a train record's figures as `train/<key>`, an eval
record's as `eval/<key>` (its `eval_` prefix dropped), an rl row as `<policy>/<key>` (an eval row
as `<policy>/eval/<key>`). Each group has its own step axis (`train/step`, `<policy>/rollout`):
TensorBoard takes the step directly; W&B gets it as the group's `step_metric`, so policies that run
ahead of each other do not fight over W&B's one global step.

A resumed run continues the same curves, each step once: TensorBoard's `purge_step` hides what the
interrupted run logged after the resume point (the resumed run's values are shown). W&B cannot hide
what it already holds, so it resumes the run whose id is kept in the run folder and skips, on each
axis, the steps the interrupted run reached (`wandb_steps.json`, written as it logs): it keeps the
interrupted run's values for the steps redone between the last save and the interruption. W&B's own
`_step` continues from the interrupted run's too (an offline resume would restart it at 0, and a sync
drops history rows below the step the server holds).
"""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from hpref.errors import UserError
from hpref.hookspecs import hookimpl
from hpref.runfolder.layout import TENSORBOARD as TENSORBOARD_DIR
from hpref.runfolder.layout import WANDB_RUN_ID as WANDB_ID_FILE
from hpref.runfolder.layout import WANDB_STEPS as WANDB_STEPS_FILE


class MetricLogger(Protocol):
    """What a logger's `build` returns: scalars at a step, and the end of the run."""

    def log(self, values: dict[str, float], step: int, axis: str) -> None: ...

    def close(self) -> None: ...


class RunInfo(BaseModel):
    """What every logger's `build(config, run)` is given: the run folder, the step a resumed run
    continues after (None: a fresh run), the run's config (resolved recipe and hpref version)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    run_dir: Path
    resume_step: int | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    name: str = "hpref"
    #: every step axis advances together (`hpref train`: train and eval records share the step), so
    #: W&B may use its own step: it then drops what a resumed run logs again at or below it
    one_step: bool = False


class JsonlConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorBoardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    folder: str | None = Field(
        None, description="event-file folder (absent: <run_dir>/tensorboard; relative: to the run folder)"
    )
    flush_secs: int = Field(30, ge=1, description="how often the writer flushes to disk, in seconds")

    def log_dir(self, run_dir: Path) -> Path:
        return run_dir / TENSORBOARD_DIR if self.folder is None else run_dir / Path(self.folder).expanduser()

    def check(self, run_dir: Path) -> None:
        """Refuse, before the run starts, a missing tensorboard package or a folder that cannot be written."""
        if importlib.util.find_spec("tensorboard") is None:
            raise UserError(
                "logging.loggers: 'tensorboard' is selected but the tensorboard package is not installed "
                "(pip install 'hpref[logging]')"
            )
        folder = self.log_dir(run_dir)
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise UserError(f"logging.tensorboard.folder: {folder} is not writable")


class WandbConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    project: str = Field("hpref", description="W&B project")
    entity: str | None = Field(None, description="W&B team or user (absent: the account's default)")
    name: str | None = Field(None, description="run name (absent: the run folder's name)")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="offline: files only, no network or account (`wandb sync` uploads them)"
    )
    tags: list[str] = Field(default_factory=list, description="W&B run tags")

    def check(self, run_dir: Path) -> None:
        if importlib.util.find_spec("wandb") is None:
            raise UserError(
                "logging.loggers: 'wandb' is selected but the wandb package is not installed "
                "(pip install 'hpref[logging]')"
            )


def _scalar(value: Any) -> float | None:
    """A figure a dashboard can plot: numbers and flags; None for text, lists and missing values."""
    return float(value) if isinstance(value, int | float) else None


class TensorBoardLogger:
    def __init__(self, config: TensorBoardConfig, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run's first new step; what the interrupted run logged from there on
        # (after its last save) is hidden by TensorBoard's reader, so no step appears twice
        purge = None if run.resume_step is None else run.resume_step + 1
        folder = str(config.log_dir(run.run_dir))
        self.writer = SummaryWriter(folder, purge_step=purge, flush_secs=config.flush_secs)
        if run.config:
            text = json.dumps(run.config, indent=2, sort_keys=True, default=str)
            self.writer.add_text("config", "```\n" + text + "\n```", global_step=run.resume_step or 0)

    def log(self, values: dict[str, float], step: int, axis: str) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, config: WandbConfig, run: RunInfo) -> None:
        import wandb

        id_file = run.run_dir / WANDB_ID_FILE
        # the same W&B run across resumes: its id is kept in the run folder (a fresh run gets a new one)
        run_id = id_file.read_text().strip() if run.resume_step is not None and id_file.is_file() else None
        run_id = run_id or uuid.uuid4().hex[:8]  # W&B's own ids are 8 lowercase characters too
        id_file.write_text(run_id + "\n")
        self.axes: set[str] = set()
        self.one_step = run.one_step
        # what the interrupted run reached: W&B's own step and each axis's last step (a fresh run: none)
        self.steps_file = run.run_dir / WANDB_STEPS_FILE
        reached = {}
        if run.resume_step is not None and self.steps_file.is_file():
            reached = json.loads(self.steps_file.read_text())
        self.skip_through: dict[str, int] = dict(reached.get("axes", {}))
        self.reached = {"step": int(reached.get("step", -1)), "axes": dict(self.skip_through)}
        self.run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=config.name or run.name,
            tags=config.tags or None,
            dir=str(run.run_dir),  # wandb adds its own `wandb/` folder: <run_dir>/wandb/offline-run-*
            id=run_id,
            resume="allow",
            mode=config.mode,
            config=run.config,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def log(self, values: dict[str, float], step: int, axis: str) -> None:
        if step <= self.skip_through.get(axis, -1):
            return  # the interrupted run logged this step already (see the module docstring)
        group = axis.rsplit("/", 1)[0]
        if axis not in self.axes:  # each group plotted against its own step (see the module docstring)
            self.run.define_metric(axis)
            self.run.define_metric(f"{group}/*", step_metric=axis)
            self.axes.add(axis)
        # W&B's own step: the train step where every axis advances together, else one past the last
        wandb_step = step if self.one_step else self.reached["step"] + 1
        self.run.log({**values, axis: step}, step=wandb_step)
        self.reached["step"] = max(self.reached["step"], wandb_step)
        self.reached["axes"][axis] = max(self.reached["axes"].get(axis, -1), step)
        # replaced whole, not fsynced: W&B's own files are not either, and this runs at every step
        partial = self.steps_file.with_name(self.steps_file.name + ".part")
        partial.write_text(json.dumps(self.reached))
        os.replace(partial, self.steps_file)

    def close(self) -> None:
        self.run.finish()


class MetricLoggers:
    """The run's loggers, fed the records the metrics files get (rank 0 / the leader only)."""

    def __init__(self, loggers: Iterable[MetricLogger] = ()) -> None:
        self.loggers = list(loggers)

    def __bool__(self) -> bool:
        return bool(self.loggers)

    def train_record(self, record: dict[str, Any]) -> None:
        """One metrics.jsonl record of `hpref train`: `train/*` or `eval/*` (its `kind`) at its step."""
        kind = str(record.get("kind", "train"))
        values = {}
        for key, value in record.items():
            number = _scalar(value)
            if key in ("kind", "step") or number is None:
                continue
            values[f"{kind}/{key.removeprefix(kind + '_')}"] = number
        self.emit(values, int(record["step"]), f"{kind}/step")

    def rl_row(self, policy: str, row: dict[str, Any]) -> None:
        """One row of `metrics/<policy>.jsonl`: `<policy>/<key>` (`<policy>/eval/<key>` for an eval)
        at its rollout id."""
        prefix = f"{policy}/eval/" if row.get("eval") else f"{policy}/"
        values = {}
        for key, value in row.items():
            number = _scalar(value)
            if key in ("rollout", "eval") or number is None:
                continue
            values[prefix + (key.removeprefix("eval_") if row.get("eval") else key)] = number
        self.emit(values, int(row["rollout"]), f"{policy}/rollout")

    def emit(self, values: dict[str, float], step: int, axis: str) -> None:
        if values:
            for logger in self.loggers:
                logger.log(values, step, axis)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []


def selected_loggers(recipe: Any) -> list[tuple[str, Any]]:
    """(name, validated config) of each logger the recipe selects beside the always-on `jsonl`."""
    section = getattr(recipe, "logging", None)
    if section is None:
        return []
    if section.loggers and not section.configs():  # a recipe loaded with `resolve=False`
        section.resolve(str(getattr(recipe, "_source", None) or "recipe"))
    return [(name, config) for name, config in section.configs().items() if name != "jsonl"]


def check_loggers(recipe: Any, run_dir: Path) -> None:
    """The refusals a run makes before it starts (wandb missing, TensorBoard folder not writable)."""
    for _name, config in selected_loggers(recipe):
        check = getattr(config, "check", None)
        if callable(check):
            check(run_dir)


def build_loggers(
    recipe: Any, run_dir: Path, resume_step: int | None, *, one_step: bool = False
) -> MetricLoggers:
    """The recipe's loggers for one run (call on rank 0 / the leader only; `one_step`: `RunInfo`)."""
    from hpref import __version__
    from hpref.plugins import load_plugins

    selected = selected_loggers(recipe)
    if not selected:
        return MetricLoggers()
    registry = load_plugins()
    config = {"recipe": recipe.to_dict(), "hpref_version": __version__}
    run = RunInfo(
        run_dir=run_dir, resume_step=resume_step, config=config, name=run_dir.name, one_step=one_step
    )
    return MetricLoggers(registry.get("logger", name).build(cfg, run) for name, cfg in selected)


class _JsonlLogger:
    """Nothing to add: the metrics files are written by the run itself."""

    def log(self, values: dict[str, float], step: int, axis: str) -> None:
        pass

    def close(self) -> None:
        pass


def build_jsonl(config: JsonlConfig, run: RunInfo) -> MetricLogger:
    """metrics.jsonl in the run folder (always on; listed so recipes may name it)"""
    return _JsonlLogger()


def build_tensorboard(config: TensorBoardConfig, run: RunInfo) -> MetricLogger:
    """TensorBoard event files through torch's SummaryWriter (needs the tensorboard package)"""
    return TensorBoardLogger(config, run)


def build_wandb(config: WandbConfig, run: RunInfo) -> MetricLogger:
    """Weights & Biases, offline by default (files in <run_dir>/wandb; `wandb sync` uploads them)"""
    return WandbLogger(config, run)


@hookimpl
def register_loggers(register) -> None:
    register(name="jsonl", config=JsonlConfig, build=build_jsonl)
    register(name="tensorboard", config=TensorBoardConfig, build=build_tensorboard)
    register(name="wandb", config=WandbConfig, build=build_wandb)
