"""Shared fixtures for the model tests: offline, a private cache, tiny backbones built from configs."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in these tests may reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

torch = pytest.importorskip("torch")

#: Packed lengths used throughout: a 1-token sequence and sequences longer than the Gemma window.
LENGTHS = (5, 1, 9, 3, 7)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Every test trains/reads tokenizers in a session-private cache, never ~/.cache/hpref."""
    monkeypatch.setenv("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))


def packed_batch(lengths=LENGTHS, vocab=90, seed=0):
    """(input_ids, cu_seqlens, position_ids, per-sequence ids) for one packed row."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return torch.cat(seqs), cu, positions, seqs


def reference_backbone(backbone):
    """A copy of the backbone with transformers' stock eager attention, to run sequences one by one."""
    ref = copy.deepcopy(backbone)
    ref.set_attn_implementation("eager")
    return ref.eval()


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    values = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: the CPU paths must expand k/v
        max_position_embeddings=64,
        use_cache=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_bert_config(**overrides):
    from transformers import BertConfig

    values = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    values.update(overrides)
    return BertConfig(**values)


def tiny_roberta_config(**overrides):
    """RoBERTa numbers positions from padding_idx + 1: packed position ids must be shifted to match."""
    from transformers import RobertaConfig

    values = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=66,
        pad_token_id=1,
    )
    values.update(overrides)
    return RobertaConfig(**values)


def tiny_gemma2_config(**overrides):
    from transformers import Gemma2Config

    values = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,  # layer 0 sliding, layer 1 global
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=4,  # shorter than the 9- and 7-token sequences
        attn_logit_softcapping=5.0,  # forces the explicit-maths CPU path
        final_logit_softcapping=None,
        use_cache=False,
    )
    values.update(overrides)
    return Gemma2Config(**values)


def model_from_config(
    config, *, attention="sdpa_segments", pooling="auto", meta=False, seed=0, num_labels=3, head="judge"
):
    from hpref.models.hf import build_from_config

    return build_from_config(
        config,
        None,
        init_seed=seed,
        num_labels=num_labels,
        device="cpu",
        meta=meta,
        pooling=pooling,
        attention=attention,
        head_hidden_size=16,
        head_dropout=0.1,
        seed=seed,
        provenance={"test": True},
        head=head,
    )
