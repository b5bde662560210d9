"""Reading an adapter export back (`hpref save --adapter`): the base model its folder names, PEFT's
adapter loaded into it, hpref's head. `hpref eval --checkpoint FOLDER` and Python callers use it.

The folder is written by `hpref.models.adapters.save_adapter` and read by `hpref.exports` (its
files, `hpref_adapter.json` checked, remote code refused); building the base needs the component
registry (the base is a `[model]` section), so the model is rebuilt here, with evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from loguru import logger

from hpref.errors import UserError
from hpref.exports.files import read_head_state
from hpref.exports.layout import ADAPTER_JSON, HEAD_FILE, QUANTIZE_KEY, read_adapter_meta
from hpref.models.adapters import attach_adapter, quiet_peft, require_peft
from hpref.plugins import load_plugins


def load_adapter_export(folder: str | Path, *, device: str | torch.device = "cpu") -> Any:
    """Rebuild base + adapter + head from a folder written by `save_adapter` (`hpref save --adapter`).

    The base is the `[model]` section recorded in `hpref_adapter.json`, built as training built it;
    PEFT loads the adapter into it (`PeftModel.from_pretrained`, safetensors only); a QLoRA adapter's
    base (`quantize_base = "4bit"` in the pointer) is quantised first, as in training. That section came
    with the folder, so it may not turn on remote code (as for a run folder's recipe)."""
    require_peft()
    from peft import PeftModel

    folder = Path(folder)
    meta = read_adapter_meta(folder)  # the format, the files and no remote code, checked
    base = dict(meta["base"])
    quantize_base = str(base.pop(QUANTIZE_KEY, "none"))
    registry = load_plugins()
    name = base.pop("name", None)
    component = registry.get("model", str(name))
    try:
        config = component.config.model_validate(base)
    except Exception as exc:
        raise UserError(f"{folder / ADAPTER_JSON}: base: {str(exc).splitlines()[0]}") from None
    model = component.build(config, num_labels=int(meta.get("num_labels", 3)), device="cpu", meta=False)
    if quantize_base == "4bit":  # QLoRA: the adapter was trained on the 4-bit base, rebuilt the same way
        _quantize_for_adapter(model, folder)
    elif quantize_base != "none":
        raise UserError(f"{folder / ADAPTER_JSON}: base.{QUANTIZE_KEY} = {quantize_base!r}: unknown")
    try:
        with quiet_peft():
            peft_model = PeftModel.from_pretrained(model.backbone, str(folder), is_trainable=False)
    except (ValueError, RuntimeError, KeyError) as exc:
        raise UserError(
            f"{folder}: the adapter does not fit its base model ({str(exc).splitlines()[0]})"
        ) from None
    attach_adapter(model, peft_model, meta.get("lora", {}))
    head = read_head_state(folder)
    try:
        model.head.load_state_dict({k: v.float() for k, v in head.items()}, strict=True)
    except RuntimeError as exc:
        raise UserError(
            f"{folder / HEAD_FILE}: does not fit the base's head ({str(exc).splitlines()[0]})"
        ) from None
    model.to(torch.float32).to(device)
    model.eval()
    logger.info(f"loaded {component.name} + LoRA adapter from {folder}")
    return model


def _quantize_for_adapter(model: Any, folder: Path) -> None:
    """Quantise the base's block linears that the adapter targets (its `adapter_config.json`) to
    NF4, as `apply_lora` did for training (`hpref.models.quantize`)."""
    from peft import PeftConfig

    from hpref.models.quantize import quantize_block_linears

    targets = PeftConfig.from_pretrained(str(folder)).target_modules
    targets = [targets] if isinstance(targets, str) else sorted(targets)
    quantize_block_linears(model, targets, device="cpu")
