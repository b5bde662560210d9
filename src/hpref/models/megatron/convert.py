"""What maps a transformers Llama-family model onto megatron-core's GPT, and back.

Used by the megatron backbone (`hpref.models.megatron`), the preference model built on it
(`hpref.models.megatron.preference`, `hpref save`) and the rl trainer (`hpref.models.megatron.causal_lm`):

- `shape_of`: a transformers config's architecture numbers (`MegatronShape`), checked to map onto
  megatron-core's GPT layer (one line naming what does not);
- `hf_to_megatron` (and `iter_hf_to_megatron`, the same one tensor at a time): fuse Q/K/V per
  query group and gate/up into megatron's layouts, pad the vocabulary to a multiple of the
  tensor-parallel size, and cut this rank's tensor-parallel shard; it reads the source mapping key
  by key, so a lazily read folder (`SafetensorsFolder`) is never held whole in memory;
- `megatron_to_hf`: undo it from every rank's shards (rank order), padding rows dropped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hpref.errors import UserError

#: transformers `model_type`s whose architecture maps onto megatron-core's GPT layer one to one
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


# --------------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class MegatronShape:
    """The architecture numbers of one transformers config, checked to map onto megatron-core."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    max_position_embeddings: int

    def padded_vocab(self, tp_size: int) -> int:
        """megatron's vocab-parallel embedding splits rows evenly over the tensor-parallel ranks."""
        return -(-self.vocab_size // tp_size) * tp_size


def shape_of(hf_config: Any) -> MegatronShape:
    """Read a Llama / Mistral / Qwen2 transformers config; one line naming what does not map."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"the megatron backend builds {', '.join(SUPPORTED_MODEL_TYPES)} models; this config's "
            f"model_type is {model_type!r}"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UserError(f"the megatron backend maps SwiGLU (hidden_act 'silu'); this config has {act!r}")
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise UserError(
            f"the megatron backend maps plain RoPE; this config's rope_type is {rope_type!r} (scaled RoPE "
            "is not converted)"
        )
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise UserError("the transformers config names no rope_theta")
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True):
        window = hf_config.sliding_window
        if window < getattr(hf_config, "max_position_embeddings", window + 1):
            raise UserError(f"the megatron backend has no sliding-window attention (this config: {window})")
    if getattr(hf_config, "mlp_bias", False):
        raise UserError("the megatron backend maps bias-free MLPs; this config has mlp_bias = true")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    # Qwen2 always has Q/K/V biases; Llama and Mistral have them when attention_bias is set
    qkv_bias = model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return MegatronShape(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=float(theta),
        qkv_bias=qkv_bias,
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 4096)),
    )


# --------------------------------------------------------------------------------------------------
# weights


_HF_PER_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}


class _BackboneKeys(Mapping[str, torch.Tensor]):
    """A transformers state's backbone keys without a causal-LM folder's `model.` prefix (the LM
    head is not a backbone part); a view, so a lazily read state (`SafetensorsFolder`) is read
    tensor by tensor as the conversion asks for each."""

    def __init__(self, hf_state: Mapping[str, torch.Tensor]):
        self._state = hf_state
        self._source = {k.removeprefix("model."): k for k in hf_state if not k.startswith("lm_head.")}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._state[self._source[key]]

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self._source

    def __iter__(self) -> Iterator[str]:
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)


def _rows(tensor: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    return tensor.chunk(size, dim=dim)[rank]


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: MegatronShape) -> torch.Tensor:
    """[q heads of group g, k_g, v_g] for each query group g, along dim 0 (megatron's layout)."""
    per_group = shape.num_heads // shape.num_kv_heads
    tail = q.shape[1:]
    q = q.reshape(shape.num_kv_heads, per_group * shape.head_dim, *tail)
    k = k.reshape(shape.num_kv_heads, shape.head_dim, *tail)
    v = v.reshape(shape.num_kv_heads, shape.head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _split_qkv(fused: torch.Tensor, shape: MegatronShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group = shape.num_heads // shape.num_kv_heads
    tail = fused.shape[1:]
    grouped = fused.reshape(shape.num_kv_heads, (per_group + 2) * shape.head_dim, *tail)
    q, k, v = grouped.split([per_group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    shape: MegatronShape,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    vocab_multiple: int | None = None,
) -> dict[str, torch.Tensor]:
    """transformers keys -> this tensor-parallel rank's `MegatronBackbone` state dict (the vocabulary
    padded to a multiple of `vocab_multiple`, by default `tp_size`)."""
    split = dict(tp_rank=tp_rank, tp_size=tp_size, vocab_multiple=vocab_multiple)
    return dict(iter_hf_to_megatron(hf_state, shape, **split))


def iter_hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    shape: MegatronShape,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    vocab_multiple: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`hf_to_megatron`'s (key, tensor) pairs one at a time, each read from `hf_state` only when it is
    made: a consumer that copies each into its parameter and drops it holds one source tensor at a
    time (a yielded shard may be a view of the whole source tensor)."""
    hf = _BackboneKeys(hf_state)
    embed = hf["embed_tokens.weight"]
    pad = shape.padded_vocab(vocab_multiple or tp_size) - embed.shape[0]
    if pad:  # rows no token id reaches, so the vocab splits evenly over the ranks
        embed = torch.cat([embed, embed.new_zeros(pad, embed.shape[1])])
    yield "gpt.embedding.word_embeddings.weight", _rows(embed, tp_rank, tp_size)
    del embed
    yield "norm.weight", hf["norm.weight"]
    for i in range(shape.num_layers):
        src = f"layers.{i}."
        dst = f"gpt.decoder.layers.{i}."
        for hf_name, mc_name in _HF_PER_LAYER.items():
            value = hf[src + hf_name]
            if mc_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                value = _rows(value, tp_rank, tp_size, dim=1)  # row-parallel: split the input dim
            yield dst + mc_name, value
        attn = src + "self_attn."
        for part in ("weight", "bias"):
            if attn + f"q_proj.{part}" not in hf:
                continue
            fused = _fuse_qkv(
                hf[attn + f"q_proj.{part}"], hf[attn + f"k_proj.{part}"], hf[attn + f"v_proj.{part}"], shape
            )
            yield dst + f"self_attention.linear_qkv.{part}", _rows(fused, tp_rank, tp_size)
        gate = _rows(hf[src + "mlp.gate_proj.weight"], tp_rank, tp_size)
        up = _rows(hf[src + "mlp.up_proj.weight"], tp_rank, tp_size)
        yield dst + "mlp.linear_fc1.weight", torch.cat([gate, up])  # megatron's GLU: chunk(2) per rank


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], shape: MegatronShape) -> dict[str, torch.Tensor]:
    """Every tensor-parallel rank's `MegatronBackbone` state dict (rank order) -> transformers keys
    (`LlamaModel` / `Qwen2Model` naming, no `model.` prefix), padding rows dropped."""
    first = shards[0]
    size = len(shards)

    def cat(key: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([s[key] for s in shards], dim=dim) if size > 1 else first[key]

    hf: dict[str, torch.Tensor] = {
        "embed_tokens.weight": cat("gpt.embedding.word_embeddings.weight")[: shape.vocab_size],
        "norm.weight": first["norm.weight"],
    }
    for i in range(shape.num_layers):
        src = f"gpt.decoder.layers.{i}."
        dst = f"layers.{i}."
        for hf_name, mc_name in _HF_PER_LAYER.items():
            row_parallel = mc_name.endswith(("linear_proj.weight", "linear_fc2.weight"))
            hf[dst + hf_name] = cat(src + mc_name, dim=1) if row_parallel else first[src + mc_name]
        for part in ("weight", "bias"):
            key = src + f"self_attention.linear_qkv.{part}"
            if key not in first:
                continue
            q, k, v = _split_qkv(cat(key), shape)
            for name, value in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                hf[dst + f"self_attn.{name}.{part}"] = value
        halves = [s[src + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        hf[dst + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves])
        hf[dst + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves])
    return {k: v.contiguous() for k, v in hf.items()}
