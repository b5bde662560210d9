"""An export's file names and metadata: what makes a folder an hpref export, and what it says.

Two kinds of folder: a full export (`PreferenceModel.save_pretrained`, `hpref save`): the backbone
(`config.json`, `model.safetensors`), tokenizer files, `head.safetensors` and `hpref_model.json`;
and an adapter export (`hpref save --adapter`): PEFT's `adapter_config.json` and
`adapter_model.safetensors`, tokenizer files, `head.safetensors` and `hpref_adapter.json`, which
names the base model. `hpref save` adds the model card (`README.md`), the resolved `recipe.toml`
and `hpref_checkpoint.json` (formatter, max_length, step, dtype) to either.

No torch here: `hpref --help`, `hpref rl`'s recipe checks and `hpref serve`'s option checks read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpref.errors import UserError
from hpref.recipe import remote_code_keys

#: `hpref_model.json`'s "format"; bump when a full export's layout changes
EXPORT_FORMAT = 1
EXPORT_JSON = "hpref_model.json"
HEAD_FILE = "head.safetensors"
BACKBONE_FILE = "model.safetensors"
#: written by `hpref save` beside the model (`hpref.save.export`, `hpref.save.policy_export`)
CHECKPOINT_JSON = "hpref_checkpoint.json"
MODEL_CARD = "README.md"
#: `hpref_adapter.json`'s "format"; bump when an adapter export's layout changes
ADAPTER_FORMAT = 1
ADAPTER_JSON = "hpref_adapter.json"
#: PEFT's own adapter files (also an rl policy's `adapter/` folder)
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
#: the key `hpref.models.adapters.base_pointer` adds for a QLoRA base (not a `[model]` parameter:
#: readers pop it)
QUANTIZE_KEY = "quantize_base"


def is_export_folder(path: str | Path) -> bool:
    """A full export (`hpref save` without `--adapter`, or `save_pretrained`)."""
    return (Path(path) / EXPORT_JSON).is_file()


def is_adapter_export(path: str | Path) -> bool:
    """An adapter export (`hpref save --adapter`)."""
    return (Path(path) / ADAPTER_JSON).is_file()


def export_problem(path: str | Path) -> str | None:
    """Why `path` is not an `hpref save` export on this machine, or None."""
    folder = Path(path).expanduser()
    if not is_export_folder(folder):
        return (
            f"no exported preference model at {path} (make one with `hpref train` then "
            "`hpref save RUN_DIR --to DIR`)"
        )
    return None


def export_settings(path: str | Path) -> dict[str, Any]:
    """What the export says about itself: `hpref_model.json` (head, pooling, tie parameter, ...)
    merged with `hpref save`'s `hpref_checkpoint.json` (formatter, max_length, step, dtype) when
    present (a folder written by `save_pretrained` alone has only the first)."""
    folder = Path(path).expanduser()
    settings: dict[str, Any] = {}
    for name in (EXPORT_JSON, CHECKPOINT_JSON):
        file = folder / name
        if file.is_file():
            settings.update(json.loads(file.read_text(encoding="utf-8")))
    return settings


def card_metrics(card: str) -> dict[str, Any]:
    """The eval metrics `hpref.save.export.model_card` wrote into a card's "## Eval metrics" table
    (numbers as numbers), for readers of an export (`hpref serve`'s /info); {} when it has none."""
    section = card.partition("## Eval metrics")[2].partition("\n## ")[0]
    out: dict[str, Any] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("metric", "") or set(cells[0]) <= {"-"}:
            continue
        try:
            out[cells[0]] = int(cells[1]) if cells[1].lstrip("-").isdigit() else float(cells[1])
        except ValueError:
            out[cells[0]] = cells[1]
    return out


def read_export_meta(
    folder: Path, *, num_labels: int | None = None, head: str | None = None
) -> dict[str, Any]:
    """A full export's `hpref_model.json`, checked: this hpref's format and, when given, the labels
    and head kind the caller needs (a 3-way head cannot score a 2-way task)."""
    meta_file = folder / EXPORT_JSON
    if not meta_file.is_file():
        raise UserError(f"'{folder}' is not an hpref model export (no {EXPORT_JSON})")
    info = json.loads(meta_file.read_text())
    if info.get("format") != EXPORT_FORMAT:
        raise UserError(
            f"'{folder}' has export format {info.get('format')}; this hpref reads {EXPORT_FORMAT}"
        )

    if num_labels is not None and int(info["num_labels"]) != num_labels:
        raise UserError(
            f"the head saved in '{folder}' has {info['num_labels']} labels, the run needs {num_labels}"
        )

    saved_head = info.get("head", "judge")
    if head is not None and head != saved_head:
        raise UserError(
            f"the head saved in '{folder}' is a {saved_head} head, the recipe asks for head = '{head}'"
        )
    return info


def export_meta(
    *,
    num_labels: int,
    pooling: str,
    head: str,
    head_hidden_size: int | None,
    head_dropout: float,
    seed: int,
    provenance: dict[str, Any],
    tie_log_nu: float | None,
) -> dict[str, Any]:
    """`hpref_model.json`'s content (a reward model's tie parameter `tie_log_nu`, None for a judge)."""
    meta = {
        "format": EXPORT_FORMAT,
        "num_labels": num_labels,
        "pooling": pooling,
        "head": head,
        "head_hidden_size": head_hidden_size,
        "head_dropout": head_dropout,
        "seed": seed,
        "provenance": provenance,
    }
    if tie_log_nu is not None:
        meta["tie_log_nu"] = tie_log_nu
    return meta


def read_adapter_meta(folder: Path) -> dict[str, Any]:
    """An adapter export's `hpref_adapter.json`, checked: this hpref's format, a `base` section, every
    file the export needs, and a base that does not turn on remote code (the section came with the
    folder, as a run folder's recipe does)."""
    try:
        meta = json.loads((folder / ADAPTER_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{folder / ADAPTER_JSON}: unreadable ({exc})") from None
    if (
        not isinstance(meta, dict)
        or meta.get("format") != ADAPTER_FORMAT
        or not isinstance(meta.get("base"), dict)
    ):
        raise UserError(
            f"{folder / ADAPTER_JSON}: not an hpref adapter description (format {ADAPTER_FORMAT})"
        )
    for name in (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, HEAD_FILE):
        if not (folder / name).is_file():
            raise UserError(f"{folder}: no {name}; not a complete adapter export")
    if remote_code_keys(dict(meta["base"])):
        raise UserError(
            f"{folder / ADAPTER_JSON}: base.trust_remote_code = true: a folder being loaded may not enable "
            "remote code"
        )
    return meta


def write_meta(path: Path, meta: dict[str, Any]) -> None:
    """`hpref_model.json` / `hpref_adapter.json`: sorted keys, two-space indent, a final newline."""
    path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
