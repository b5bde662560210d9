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
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from hpref.errors import RecipeError, UserError, did_you_mean


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ComponentSection(BaseModel):
    """`name` picks a registered component; every other key is one of its parameters."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(description="registered component name (see `hpref components`)")
    _config: BaseModel | None = PrivateAttr(default=None)

    @property
    def config(self) -> BaseModel:
        if self._config is None:
            raise RuntimeError(f"component section '{self.name}' was not resolved against the registry")
        return self._config

    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


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
        "auto", description="compute dtype; auto = bf16 where the hardware does it well"
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


class LoraSection(Section):
    """LoRA adapters through PEFT (`pip install 'hpref[lora]'`): the backbone's weights stay frozen
    and low-rank updates of its attention and MLP projections train, with the preference head (and a
    reward model's BERT pooler) in full. Without this section the whole model trains."""

    r: int = Field(8, ge=1, description="rank of each low-rank update")
    alpha: int | None = Field(
        None, ge=1, description="scale numerator: an update is scaled by alpha / r (default: 2 r)"
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="dropout on the adapters' input (off, like the backbone's: see model.backbone_dropout)",
    )
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description=(
            "module names (PEFT's suffix match) that get adapters; default: every linear layer inside "
            "the transformer blocks (BERT query/key/value/dense, Llama q/k/v/o/gate/up/down_proj)"
        ),
    )
    quantize_base: Literal["none", "4bit"] = Field(
        "none", description="4bit = QLoRA: the frozen base in 4-bit NF4 (bitsandbytes, a CUDA GPU)"
    )

    @property
    def scale_alpha(self) -> int:
        return self.alpha if self.alpha is not None else 2 * self.r


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
    rl: dict[str, Any] | None = Field(None, description="multi-policy RL settings (hpref rl)")

    _source: Path | None = PrivateAttr(default=None)
    _rl: Any = PrivateAttr(default=None)

    @property
    def rl_config(self):
        """The validated `[rl]` section (`hpref.rl.config.RLConfig`), or None without one."""
        return self._rl

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
        rebuild the model from it, so a crash mid-write must leave the old file, not half of one."""
        from hpref.runfolder.files import write_text_atomic

        folder.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(folder / "recipe.toml", self.to_toml())


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
    where = str(source) if source else "recipe"
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"{where}: {_describe(exc, Recipe, ())}") from None
    recipe._source = source
    if resolve:
        resolve_components(recipe, where)
        if recipe.rl is not None:
            from hpref.rl.config import parse_rl_section

            recipe._rl = parse_rl_section(recipe.rl, where)
    return recipe


def resolve_components(recipe: Recipe, where: str = "recipe") -> None:
    """Validate each component section's parameters against its registered config class."""
    from hpref.plugins import load_plugins

    registry = load_plugins()
    for dotted, kind, sec in recipe.component_sections():
        try:
            component = registry.get(kind, sec.name)
        except UserError as exc:
            raise RecipeError(f"{where}: {dotted}.name: {exc}") from None
        try:
            sec._config = component.config.model_validate(sec.params())
        except ValidationError as exc:
            raise RecipeError(
                f"{where}: {_describe(exc, component.config, tuple(dotted.split('.')))}"
            ) from None


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the last element of `loc` (for key suggestions)."""
    current: type[BaseModel] | None = model
    for part in loc[:-1]:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        current = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return current


def _describe(exc: ValidationError, model: type[BaseModel], prefix: tuple[str, ...]) -> str:
    """One line for the first validation error: dotted key, what was wrong, a suggestion."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in (*prefix, *loc)) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        owner = _model_at(model, loc)
        fields = list(owner.model_fields) if owner else []
        if owner is ComponentSection:
            return f"{key}: unknown key{did_you_mean(str(loc[-1]), fields)}"
        return f"{key}: unknown key{did_you_mean(str(loc[-1]), fields)}; valid keys: {', '.join(fields)}"
    if kind == "missing":
        return f"{key}: required key is missing"
    got = err.get("input")
    if isinstance(got, dict):  # a whole-section check (a model validator): the message says it all
        return f"{key}: {err['msg'].rstrip('.')}"
    got_text = json.dumps(got, default=str)
    if len(got_text) > 60:
        got_text = got_text[:57] + "..."
    return f"{key}: {err['msg'].rstrip('.')}, got {got_text}"


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
