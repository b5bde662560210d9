"""Model side of hpref: backbones + pooling + a fresh head over packed, padding-free rows.

- `preference.PreferenceModel`: the module every model component builds (forward, blocks,
  flops_per_token, meta-device weight loading, HF-style export and `from_pretrained`).
- `attention`: the packed varlen attention function registered with transformers, and its backends.
- `hf`: building from a local / cached HF folder, from an HF config, or from an export.
- `tokenizer`: the self-trained, cached BPE tokenizer of the tiny models.
"""

from hpref.models.attention import ATTENTION_NAME, BACKENDS, register_varlen_attention
from hpref.models.hf import load_exported
from hpref.models.preference import PreferenceModel, set_export_loader

set_export_loader(load_exported)  # PreferenceModel.from_pretrained reads exports through hf.py

__all__ = ["ATTENTION_NAME", "BACKENDS", "PreferenceModel", "register_varlen_attention"]
