"""A mean-pooled reward model's export, also laid out as a sentence-transformers model.

Why this layout. transformers has no class that mean-pools a BERT-family encoder: its sequence
classifier reads the CLS token through BERT's pooler (dense + tanh); the classes that do mean-pool
(ModernBERT's and EuroBERT's `classifier_pooling = "mean"`) are other architectures, with a dense +
activation (+ LayerNorm) before their classifier, so no BERT weights map onto them exactly. Folding
the mean into an extra BERT layer (uniform attention) does not work exactly either: the layer's
residual adds the CLS state back and its LayerNorm rescales the sum. An `AutoModelForSequenceClassification`
folder of a mean-pooled model would therefore score differently from the model hpref trained, and
TRL or OpenRLHF given the plain backbone put a new random head on it.

sentence-transformers composes exactly this model from its own stock modules, loaded with
`trust_remote_code` off: `Transformer` (the backbone: `config.json` + `model.safetensors` at the
export's root, which `PreferenceModel.save_pretrained` writes anyway), `Pooling` (the mean over the
attention mask, special tokens included, as hpref's `pool(..., "mean")`) and `Dense` (one output,
identity activation: the reward head's `score` linear). So `SentenceTransformer(folder).encode(texts)`
gives each text's reward; the files below are what make the folder that model. The module names are
the `sentence_transformers.models.*` aliases every release since 2.x reads (6.3 writes longer paths
and still reads these).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

MODULES_JSON = "modules.json"
POOLING_DIR = "1_Pooling"
DENSE_DIR = "2_Dense"


def write_sentence_transformers_layout(
    folder: Path, score: dict[str, torch.Tensor], *, hidden_size: int, max_seq_length: int
) -> None:
    """Add sentence-transformers' module files to an export whose root holds the backbone.

    `score` is the reward head's linear (`weight` [1, H], optional `bias` [1]); `max_seq_length` is
    where sentence-transformers truncates (from the right end; hpref's `answers` formatter cuts the
    conversation's start instead, so texts longer than that score differently)."""
    from safetensors.torch import save_file

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": POOLING_DIR, "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": DENSE_DIR, "type": "sentence_transformers.models.Dense"},
    ]
    _write_json(folder / MODULES_JSON, modules)
    _write_json(
        folder / "sentence_bert_config.json", {"max_seq_length": max_seq_length, "do_lower_case": False}
    )
    _write_json(
        folder / POOLING_DIR / "config.json",
        {
            "word_embedding_dimension": hidden_size,
            "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
        },
    )
    _write_json(
        folder / DENSE_DIR / "config.json",
        {
            "in_features": hidden_size,
            "out_features": 1,
            "bias": "bias" in score,
            "activation_function": "torch.nn.modules.linear.Identity",
        },
    )
    tensors = {f"linear.{k}": v.detach().to("cpu").contiguous() for k, v in score.items()}
    save_file(tensors, str(folder / DENSE_DIR / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, data: object) -> None:
    # plain writes: the export is assembled in a temporary folder, fsynced and renamed as a whole
    # (`hpref.save.export.save_export`), like every other file of it
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
