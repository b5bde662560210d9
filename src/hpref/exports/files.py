"""Writing and reading an export's tensor files (the names and metadata are `hpref.exports.layout`'s).

A full export (`write_export`, behind `PreferenceModel.save_pretrained`): the backbone's config and
weights at the root, as transformers writes a base model, `head.safetensors` (the head's state
under `head.`) and `hpref_model.json`. A reward model pooled as transformers' sequence classifier
pools that family (last token, or BERT's CLS through its pooler) is written as that classifier with
one label instead (`sequence_classifier`: TRL loads it; OpenRLHF a decoder's); a mean-pooled one
keeps the plain backbone and is also a sentence-transformers model
(`hpref.exports.sentence_transformers`). An adapter export (`write_adapter_export`, behind
`hpref.models.adapters.save_adapter`) is PEFT's adapter folder plus the same head file and
`hpref_adapter.json`.

Plain writes: `hpref save` assembles an export in a temporary folder, fsyncs it and renames it as a
whole (`hpref.save.export.save_export`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from hpref.exports.layout import (
    ADAPTER_FORMAT,
    ADAPTER_JSON,
    BACKBONE_FILE,
    EXPORT_JSON,
    HEAD_FILE,
    export_meta,
    write_meta,
)


def write_export(
    folder: Path,
    backbone: dict[str, torch.Tensor],
    head: dict[str, torch.Tensor],
    *,
    config: Any,
    tokenizer: Any,
    num_labels: int,
    pooling: str,
    head_kind: str,
    head_hidden_size: int | None,
    head_dropout: float,
    seed: int,
    provenance: dict[str, Any],
    reward: bool,
    max_seq_length: int,
) -> Path:
    """A full export in `folder` (created): `backbone` and `config` as they go to disk (already the
    sequence classifier's, see `sequence_classifier`), `head` under `head.*`. `reward`: a reward
    head (its tie parameter goes in `hpref_model.json`; mean-pooled, the sentence-transformers
    modules are added, truncating at `max_seq_length`)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(_plain(backbone), str(folder / BACKBONE_FILE), metadata={"format": "pt"})
    save_file(_plain(head), str(folder / HEAD_FILE), metadata={"format": "pt"})
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    meta = export_meta(
        num_labels=num_labels,
        pooling=pooling,
        head=head_kind,
        head_hidden_size=head_hidden_size,
        head_dropout=head_dropout,
        seed=seed,
        provenance=provenance,
        tie_log_nu=float(head["head.log_tie"].float().reshape(())) if reward else None,
    )
    if reward and pooling == "mean":
        from hpref.exports.sentence_transformers import write_sentence_transformers_layout

        score = {k.removeprefix("head.score."): v for k, v in head.items() if k.startswith("head.score.")}
        write_sentence_transformers_layout(
            folder, score, hidden_size=config.hidden_size, max_seq_length=max_seq_length
        )
    write_meta(folder / EXPORT_JSON, meta)
    return folder


def sequence_classifier(
    backbone: dict[str, torch.Tensor],
    head: dict[str, torch.Tensor],
    *,
    layout: dict[str, Any],
    config: Any,
    tokenizer: Any,
) -> tuple[dict[str, torch.Tensor], Any]:
    """A reward model as transformers' sequence-classification checkpoint with one label: backbone
    keys under the base-model prefix (`layout`: `hpref.models.heads.hf_reward_layout`),
    `head.score.*` as its scoring linear, and a copy of `config` naming that class (`AutoModel`
    still reads the backbone out of it: hpref loads it back)."""
    state = {f"{layout['prefix']}.{k}": v for k, v in backbone.items()}
    for part in ("weight", "bias"):
        if f"head.score.{part}" in head:
            state[f"{layout['name']}.{part}"] = head[f"head.score.{part}"]
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.architectures = [layout["class"]]
    if getattr(config, "pad_token_id", None) is None:
        # a decoder's sequence classifier finds each row's last token by its padding id
        config.pad_token_id = getattr(tokenizer, "pad_token_id", None)
    return state, config


def write_adapter_export(
    folder: Path,
    peft: Any,
    head: dict[str, torch.Tensor],
    *,
    tokenizer: Any,
    dtype: torch.dtype,
    base: dict[str, Any],
    num_labels: int,
    pooling: str,
    head_kind: str,
    lora: dict[str, Any],
) -> None:
    """PEFT's adapter folder of `peft` (cast to `dtype` in place), `head` (the head module's state,
    no prefix) in `dtype`, the tokenizer and `hpref_adapter.json` naming the base model (`base`:
    `hpref.models.adapters.base_pointer`)."""
    from safetensors.torch import save_file

    if dtype != torch.float32:
        peft.to(dtype)
    peft.save_pretrained(str(folder), safe_serialization=True)
    tensors = {f"head.{k}": v.detach().to("cpu", dtype).contiguous() for k, v in head.items()}
    save_file(tensors, str(folder / HEAD_FILE), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    meta = {
        "format": ADAPTER_FORMAT,
        "base": base,
        "num_labels": num_labels,
        "pooling": pooling,
        "head": head_kind,
        "lora": lora,
    }
    if head_kind == "reward":
        meta["tie_log_nu"] = float(head["log_tie"].detach().float().reshape(()))
    write_meta(folder / ADAPTER_JSON, meta)


def read_head_state(folder: Path) -> dict[str, torch.Tensor]:
    """An export's trained head (full or adapter export), keys without the `head.` prefix."""
    from safetensors.torch import load_file

    return {k.removeprefix("head."): v for k, v in load_file(str(folder / HEAD_FILE)).items()}


def _plain(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
