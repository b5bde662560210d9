"""Recipes: typed TOML files that say what to train and how.

Loading is three steps, each with its own error messages:
1. read the TOML file (`RecipeError` naming the file and the TOML error),
2. apply `--set section.key=value` overrides (values parsed as TOML literals, else strings),
3. validate with pydantic (unknown keys forbidden), then validate every component section
   (`name = "..."` plus parameters) against that component's own config class.

Precedence is CLI override > file > defaults. Every error is one line naming the file and the
dotted key, and suggests the nearest valid name for a misspelt key or component.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import Field, PrivateAttr, ValidationError, field_validator

from hpref.errors import RecipeError
from hpref.recipe.dpo import DpoSettings
from hpref.recipe.logging_section import LoggingSection
from hpref.recipe.rl import PolicyModelConfig, RLConfig, parse_rl_section
from hpref.recipe.schema import ComponentSection, LoraSection, Section, describe_error, resolve_component


class RunSection(Section):
    """`name` is one plain folder name, so a run can only ever write inside `output_dir`:
    `run.name = "/etc/cron.d"` or `"../.."` once put the run folder there. `output_dir` is any folder
    the user chooses (absolute, relative to the current folder, `~`): choosing where output goes is
    its whole purpose, so it is taken as given."""

    name: str = Field("run", description="run name, one plain folder name; the run folder is output_dir/name")
    output_dir: Path = Field(
        Path("runs"), description="folder holding run folders (any path you choose; relative = from here)"
    )
    seed: int = Field(0, description="seed for data order, augmentation and init")

    @field_validator("name")
    @classmethod
    def _plain_folder_name(cls, name: str) -> str:
        if not name.strip():
            raise ValueError("must be a folder name, not empty")
        if name in (".", ".."):
            raise ValueError(
                "must be one plain folder name, not '.' or '..' (the run folder is output_dir/name)"
            )
        if "/" in name or "\\" in name:
            raise ValueError(
                "must be one plain folder name, without '/' or '\\' (the run folder is output_dir/name; "
                "to put runs elsewhere set run.output_dir)"
            )
        if any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise ValueError("must not contain control characters")
        if len(name.encode("utf-8", "surrogatepass")) > 255:
            raise ValueError("is longer than 255 bytes, the most a folder name can be")
        return name

    @field_validator("output_dir")
    @classmethod
    def _no_nul(cls, path: Path) -> Path:
        if "\0" in str(path):
            raise ValueError("must not contain a NUL character")
        return path

    @property
    def run_dir(self) -> Path:
        return self.output_dir / self.name


class DatasetSection(Section):
    train: ComponentSection | None = Field(None, description="training data")
    eval: ComponentSection | None = Field(None, description="evaluation data")


class OptimizerSection(ComponentSection):
    """`[optimizer]`: a registered optimizer component (built-in: `adamw`) and its parameters."""

    name: str = Field("adamw", description="registered optimizer name (see `hpref components`)")


class TrainSection(Section):
    epochs: int = Field(1, ge=1, description="passes over the training data")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    batch_size: int = Field(32, ge=1, description="battles per optimizer step, over all ranks")
    micro_batch_tokens: int = Field(
        8192, ge=16, description="token budget of one packed micro-batch on one rank"
    )
    max_length: int = Field(1024, ge=8, description="token budget of one formatted sequence")
    swap: Literal["none", "full", "random"] = Field(
        "full", description="A/B swap augmentation: full = battle and swapped copy in the same step"
    )
    grad_clip: float | None = Field(1.0, gt=0, description="clip the global grad norm (none = off)")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="compute dtype; auto = bf16 on CUDA, on a CPU the one measured faster for the model's "
        "shape (a probe of a second or so, cached per machine: hpref doctor shows it)",
    )
    activation_checkpointing: bool = Field(False, description="recompute each block's activations")
    checkpoint_interval: int = Field(
        0, ge=0, description="checkpoint every N optimizer steps (0 = epoch ends only)"
    )
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept in the run folder")
    eval_interval: int = Field(1, ge=0, description="evaluate every N epochs (0 = never)")
    eval_steps: int = Field(0, ge=0, description="also evaluate every N optimizer steps (0 = off)")
    log_interval: int = Field(10, ge=1, description="log metrics every N optimizer steps")


class LaunchSection(Section):
    nproc: int = Field(1, ge=1, description="processes per node when no GPU is present")
    nnodes: int = Field(1, ge=1, description="number of nodes")
    node_rank: int = Field(0, ge=0, description="this node's rank")
    rdzv_endpoint: str | None = Field(
        None, description="HOST:PORT of the rendezvous (default: a free local port)"
    )
    rdzv_timeout_s: int = Field(
        900,
        ge=1,
        description="several nodes: seconds a node waits for the others at the rendezvous (torchrun's 900)",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="process group: auto = nccl on GPUs, else gloo"
    )
    heartbeat_timeout_s: float = Field(
        60.0,
        ge=0,
        description="end the run when a rank's process has not run for this long (stopped, frozen); 0: off",
    )
    collective_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="how long a rank waits in one collective (all-reduce, barrier) before failing",
    )
    oversubscribe: bool = Field(
        False, description="on CPU, allow more ranks per node than this machine has cores"
    )


class DpoSection(DpoSettings, Section):
    """`[dpo]`: `hpref train` trains a causal-LM policy from pairs with a DPO-family objective
    (`hpref.models.dpo_loss`) instead of a judge; its presence is what makes a recipe a DPO recipe.
    TRL's `DPOTrainer` names: beta, loss_type, label_smoothing. The recipe's `[dataset.*]`, `[optimizer]`,
    `[scheduler]`, `[train]` (batch_size counts pairs), `[lora]` and `[launch]` apply as for a judge;
    `[model]` must be absent, and `[formatter]` and `train.swap` do not apply (a pair's two answers
    are one packed example, laid out by the policy's chat template)."""

    model: PolicyModelConfig = Field(
        default_factory=PolicyModelConfig,
        description="the policy: name = smollm2, a causal-LM folder or .gguf path, or a tiny random init",
    )
    ties: Literal["train", "drop"] = Field(
        "train",
        description="pairs labelled a tie: train = the loss's tie form (equal rewards), drop = leave them "
        "out (counted in the log)",
    )
    differing_history: Literal["error", "skip"] = Field(
        "error",
        description="a pair whose two conversations differ before the final answer (multi-turn arena "
        "rows): error names the row, skip leaves it out (counted in the log)",
    )


class Recipe(Section):
    run: RunSection = Field(default_factory=RunSection)
    model: ComponentSection | None = None
    dataset: DatasetSection = Field(default_factory=DatasetSection)
    formatter: ComponentSection = Field(default_factory=lambda: ComponentSection(name="pab"))
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    scheduler: ComponentSection = Field(default_factory=lambda: ComponentSection(name="constant"))
    train: TrainSection = Field(default_factory=TrainSection)
    launch: LaunchSection = Field(default_factory=LaunchSection)
    lora: LoraSection | None = Field(None, description="LoRA adapters (absent: full fine-tuning)")
    rl: RLConfig | None = Field(None, description="multi-policy RL settings (hpref rl; hpref.recipe.rl)")
    dpo: DpoSection | None = Field(None, description="offline DPO of a causal-LM policy (hpref train)")
    logging: LoggingSection | None = Field(None, description="metric loggers (hpref.builtin.loggers)")

    _source: Path | None = PrivateAttr(default=None)

    def component_sections(self) -> list[tuple[str, str, ComponentSection]]:
        """(dotted key, component kind, section) for every component section present."""
        found: list[tuple[str, str, ComponentSection]] = []
        if self.model is not None:
            found.append(("model", "model", self.model))
        for split in ("train", "eval"):
            sec = getattr(self.dataset, split)
            if sec is not None:
                found.append((f"dataset.{split}", "dataset", sec))
        found.append(("formatter", "formatter", self.formatter))
        found.append(("optimizer", "optimizer", self.optimizer))
        found.append(("scheduler", "scheduler", self.scheduler))
        return found

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved recipe: defaults filled in, component parameters included."""
        data = self.model_dump(mode="json", exclude_none=True)
        for dotted, _kind, sec in self.component_sections():
            resolved = {"name": sec.name}
            if sec._config is not None:
                resolved.update(sec._config.model_dump(mode="json", exclude_none=True))
            else:
                resolved.update(sec.params())
            target = data
            *parents, last = dotted.split(".")
            for p in parents:
                target = target[p]
            target[last] = resolved
        return data

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())

    def write(self, folder: Path) -> Path:
        """Write the resolved recipe as `recipe.toml` into a run folder, atomically: export and eval
        rebuild the model from it, so a crash mid-write must leave the old file, not half of one.
        (The run folder owns the file: `hpref.runfolder.start.write_resolved_recipe`.)"""
        from hpref.runfolder.start import write_resolved_recipe

        return write_resolved_recipe(self, folder)


# --------------------------------------------------------------------------------------------------
# loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """`"train.epochs=3"` -> (["train", "epochs"], 3). Values are TOML literals, else plain strings."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"--set {text!r}: expected section.key=value")
    parts = key.split(".")
    if any(not p for p in parts) or len(parts) < 2:
        raise RecipeError(f"--set {text!r}: the key must be dotted, like train.epochs")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        target = data
        for i, p in enumerate(parts[:-1]):
            node = target.setdefault(p, {})
            if not isinstance(node, dict):
                raise RecipeError(f"--set {text!r}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
            target = node
        target[parts[-1]] = value
    return data


def read_toml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise RecipeError(f"{path}: recipe file not found")
    if path.is_dir():
        raise RecipeError(f"{path}: is a folder, expected a .toml recipe file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        head = path.read_bytes()[:4]
        # TOML is UTF-8 by definition; Windows editors save "Unicode" text as UTF-16 with a mark.
        if head.startswith((b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")):
            raise RecipeError(
                f"{path}: UTF-16 or UTF-32 text, and TOML must be UTF-8; save it as UTF-8"
            ) from None
        raise RecipeError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def load_recipe(path: str | Path, overrides: list[str] | None = None, *, resolve: bool = True) -> Recipe:
    """Read, override, validate and (by default) resolve components against the plugin registry."""
    path = Path(path)
    data = apply_overrides(read_toml(path), list(overrides or []))
    return recipe_from_dict(data, source=path, resolve=resolve)


def recipe_from_dict(data: dict[str, Any], *, source: Path | None = None, resolve: bool = True) -> Recipe:
    """Validate a recipe given as a dict (what `load_recipe` read); see the module docstring.

    `[rl]` is validated after the other sections (`hpref.recipe.rl.parse_rl_section`: its policies
    are merged over `rl.defaults` and the recipe's `[lora]`); `resolve=False` leaves the component
    sections (and `[rl]`'s reward and engine) unchecked against the plugin registry."""
    where = str(source) if source else "recipe"
    rest = {key: value for key, value in data.items() if key != "rl"}
    try:
        recipe = Recipe.model_validate(rest)
    except ValidationError as exc:
        raise RecipeError(f"{where}: {describe_error(exc, Recipe, ())}") from None
    recipe._source = source
    if resolve:
        resolve_components(recipe, where)
    if "rl" in data:
        recipe.rl = parse_rl_section(data["rl"], where, lora=recipe.lora, resolve=resolve)
    return recipe


def resolve_components(recipe: Recipe, where: str = "recipe") -> None:
    """Validate each component section's parameters against its registered config class."""
    for dotted, kind, sec in recipe.component_sections():
        sec._config = resolve_component(kind, sec.name, sec.params(), dotted, where)
    if recipe.logging is not None:
        recipe.logging.resolve(where)


# --------------------------------------------------------------------------------------------------
# writing (tomllib reads only; recipes are small and flat, so a tiny writer is enough)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def dump_toml(data: dict[str, Any], _prefix: str = "") -> str:
    lines: list[str] = []
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    if _prefix and (scalars or not tables):
        lines.append(f"[{_prefix}]")
    for k, v in scalars.items():
        lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    if lines:
        lines.append("")
    for k, v in tables.items():
        lines.append(dump_toml(v, f"{_prefix}.{_toml_key(k)}" if _prefix else _toml_key(k)))
    return "\n".join(lines)


REMOTE_CODE_KEY = "trust_remote_code"


def remote_code_keys(data: Any, prefix: str = "") -> list[str]:
    """Dotted keys under which `data` (a recipe as a dict) turns on `trust_remote_code`, at any depth
    (`model`, a policy's model, a plugin component's table)."""
    found: list[str] = []
    if isinstance(data, dict):
        for key, value in data.items():
            dotted = f"{prefix}{key}"
            if key == REMOTE_CODE_KEY and value not in (False, None, 0, "", "false"):
                found.append(dotted)
            else:
                found += remote_code_keys(value, dotted + ".")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += remote_code_keys(value, f"{prefix}{i}.")
    return found
