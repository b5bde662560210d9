"""megatron-core GPT backbones for Llama-family transformers folders (issue #15).

A `MegatronBackbone` is a megatron-core `GPTModel` (RMSNorm, SwiGLU, RoPE, grouped-query attention;
tensor parallel over megatron's model-parallel group) that takes the place of a transformers
backbone inside hpref's `PreferenceModel`: it is called the same way (one packed row of token ids,
restarting position ids, hpref's `VarlenContext`) and returns `last_hidden_state`, so pooling and
heads are unchanged. Weights come from, and go back to, a plain transformers folder:
`hf_to_megatron` fuses Q/K/V per query group and gate/up into megatron's layouts and cuts this
rank's tensor-parallel shard; `megatron_to_hf` undoes it from the gathered shards.

What megatron-core needs CUDA for, and the seams that keep it off this CPU-only path:

- Packed (THD) sequences: megatron-core's own `DotProductAttention` refuses `packed_seq_params`
  ("use TEDotProductAttention", i.e. Transformer Engine, GPU-only). The layer spec's
  `core_attention` is hpref's `VarlenCoreAttention` instead, which runs hpref's varlen attention
  backends (per-sequence SDPA on CPU; flash-attn / torch varlen on CUDA where installed).
- RoPE: `RotaryEmbedding.get_emb` moves its frequencies to `torch.cuda.current_device()` on every
  forward. `_CpuRotaryEmbedding` computes the same table where it is (only when CUDA is absent).
- Weights are created on the CPU (`use_cpu_initialization`) and then overwritten by the converted
  checkpoint, so megatron's CUDA RNG tracker is never used; dropout inside the backbone is off
  (preference-model fine-tuning runs without it; a recipe asking for it is refused).

megatron-core is an optional extra (`pip install 'hpref[megatron]'`); importing this module without
it raises one line that says so.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpref.errors import UserError
from hpref.models.attention import CONTEXT_KWARG, VarlenContext, varlen_attention_forward

#: transformers `model_type`s whose architecture maps onto megatron-core's GPT layer one to one
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def require_megatron() -> None:
    """Import megatron-core (quietly: without Transformer Engine and Apex it warns at import that
    it falls back to torch implementations, which is what this CPU path wants)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
            from megatron.core.models.gpt import GPTModel  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"the megatron backend needs megatron-core ({exc}); install it with pip install 'hpref[megatron]'"
        ) from None


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


def transformer_config(
    shape: MegatronShape,
    *,
    tp_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    pipeline_parallel: int = 1,
):
    """megatron-core's `TransformerConfig` for `shape`, with every fused CUDA kernel off;
    `sequence_parallel` applies only where `tp_size` > 1 (`hpref.models.megatron_sequence_parallel`);
    `pipeline_parallel` stages: megatron builds this rank's share of the layers."""
    require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    if shape.num_kv_heads % tp_size:
        raise UserError(
            f"tensor-parallel size {tp_size} must divide the {shape.num_kv_heads} key/value heads "
            "(megatron splits whole query groups)"
        )
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        pipeline_model_parallel_size=pipeline_parallel,
        pipeline_dtype=params_dtype if pipeline_parallel > 1 else None,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


# --------------------------------------------------------------------------------------------------
# the CUDA seams


def _core_attention_class():
    from megatron.core.transformer.module import MegatronModule

    class VarlenCoreAttention(MegatronModule):
        """megatron's `core_attention` slot filled by hpref's varlen attention: query `[t, np, hn]`,
        key/value `[t, ng, hn]` (THD, this rank's heads) in, `[t, 1, np * hn]` out."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):  # fmt: skip
            super().__init__(config=config)
            self.softmax_scale = softmax_scale or config.kv_channels**-0.5
            self.is_causal = True

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):  # fmt: skip
            if attention_bias is not None:
                raise ValueError("hpref's megatron attention takes no attention bias")
            ctx = getattr(packed_seq_params, CONTEXT_KWARG, None)
            if query.dim() == 4:  # [s, b=1, heads, hn]: a row megatron did not pack
                query, key, value = query[:, 0], key[:, 0], value[:, 0]
            out, _ = varlen_attention_forward(
                self,
                query.transpose(0, 1)[None],
                key.transpose(0, 1)[None],
                value.transpose(0, 1)[None],
                None,
                scaling=self.softmax_scale,
                is_causal=True,
                **({CONTEXT_KWARG: ctx} if ctx is not None else {}),
            )
            return out[0].reshape(out.shape[1], 1, -1)

    return VarlenCoreAttention


def cpu_rotary(model: nn.Module, *, even_with_cuda: bool = False) -> None:
    """Keep RoPE's frequency table on the CPU when there is no CUDA (see the module docstring).

    megatron's `get_emb` moves the table to `torch.cuda.current_device()`. The preference model
    moves to the GPU when there is one, so it keeps megatron's class then; `even_with_cuda` swaps it
    anyway, for a model whose weights stay on the CPU on a machine with CUDA (an rl trainer)."""
    if torch.cuda.is_available() and not even_with_cuda:
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class _CpuRotaryEmbedding(RotaryEmbedding):
        def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            freqs = self.get_freqs_non_repeated(max_seq_len, offset)
            return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # not interleaved: HF's rotate_half

    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is not None:
        rotary.__class__ = _CpuRotaryEmbedding


def varlen_layer_spec() -> Any:
    """megatron's local (no Transformer Engine) Llama layer spec: RMSNorm, with hpref's varlen
    attention in its `core_attention` slot (the packed THD path on CPU and CUDA), and torch's RMSNorm
    in the norm slots marked for sequence parallelism when it is on (`SequenceParallelRMSNorm`: the
    same module megatron's spec builds without Apex, which refuses sequence parallelism)."""
    from hpref.models.megatron_sequence_parallel import SequenceParallelRMSNorm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's import-time deprecation notes
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = _core_attention_class()
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return spec


# --------------------------------------------------------------------------------------------------
# the backbone


@dataclass
class BackboneOutput:
    last_hidden_state: torch.Tensor  # [1, T, hidden]


class MegatronBackbone(nn.Module):
    """A megatron-core `GPTModel` without its output layer, plus the final RMSNorm, called like a
    transformers backbone by `PreferenceModel` (see the module docstring)."""

    #: attention goes through hpref's varlen kernels, so packed sequences never attend to each other
    _supports_attention_backend = True

    def __init__(
        self,
        shape: MegatronShape,
        *,
        tp_size: int = 1,
        params_dtype: torch.dtype = torch.float32,
        hf_config: Any = None,
        vocab_multiple: int | None = None,
        sequence_parallel: bool = False,
        pipeline_parallel: int = 1,
    ):
        """`hf_config` (the transformers config the shape was read from) becomes `config`, which
        `PreferenceModel` reads; `vocab_multiple` pads the vocabulary to a multiple other than
        `tp_size` (a one-process model that loads a tensor-parallel run's checkpoint);
        `sequence_parallel` (only with `tp_size` > 1) splits the row's tokens between the
        tensor-parallel regions (`hpref.models.megatron_sequence_parallel`); `pipeline_parallel` > 1
        builds this rank's stage only (megatron's pipeline rank picks the layers; the embedding on
        the first stage, the final norm on the last, `hpref.models.megatron_pipeline`)."""
        super().__init__()
        require_megatron()
        spec = varlen_layer_spec()  # first: it imports megatron's gpt package with its notes silenced
        from megatron.core.models.gpt import GPTModel

        self.shape = shape
        self.tp_size = tp_size
        self.vocab_multiple = vocab_multiple or tp_size
        if self.vocab_multiple % tp_size:
            raise ValueError(f"vocab_multiple {self.vocab_multiple} is not a multiple of tp_size {tp_size}")
        self.config = hf_config
        self.transformer_config = transformer_config(
            shape,
            tp_size=tp_size,
            params_dtype=params_dtype,
            sequence_parallel=sequence_parallel,
            pipeline_parallel=pipeline_parallel,
        )
        self.sequence_parallel = self.transformer_config.sequence_parallel
        if self.sequence_parallel:
            from hpref.models.megatron_sequence_parallel import (
                no_op_rng_tracker,
                place_collective_buffers_on_cpu,
            )

            place_collective_buffers_on_cpu()
            no_op_rng_tracker()
        stage = 0
        if pipeline_parallel > 1:
            from megatron.core import parallel_state

            stage = parallel_state.get_pipeline_model_parallel_rank()
        self.first_stage, self.last_stage = stage == 0, stage == pipeline_parallel - 1
        # post_process=False: no vocabulary projection (the preference head reads hidden states);
        # megatron then also leaves out the final norm, which `norm` below is
        self.gpt = GPTModel(
            config=self.transformer_config,
            transformer_layer_spec=spec,
            vocab_size=shape.padded_vocab(self.vocab_multiple),
            max_sequence_length=shape.max_position_embeddings,
            pre_process=self.first_stage,
            post_process=False,
            position_embedding_type="rope",
            rotary_base=shape.rope_theta,
        )
        cpu_rotary(self.gpt)
        # a stage before the last passes its hidden states on as they are
        self.norm: nn.Module = (
            nn.RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps, dtype=params_dtype)
            if self.last_stage
            else nn.Identity()
        )

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs: Any):
        """`input_ids` `[1, T]`: one packed row; the sequences' bounds come from hpref's
        `VarlenContext` (`kwargs[CONTEXT_KWARG]`), or the row is one sequence."""
        from megatron.core.packed_seq_params import PackedSeqParams

        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"expected one packed row [1, T], got {tuple(input_ids.shape)}")
        total = input_ids.shape[1]
        ctx: VarlenContext | None = kwargs.get(CONTEXT_KWARG)
        if ctx is None:
            cu = torch.tensor([0, total], dtype=torch.int32, device=input_ids.device)
            ctx = VarlenContext(backend="auto", cu_seqlens=cu, max_seqlen=total)
        if self.sequence_parallel:
            from hpref.models.megatron_sequence_parallel import pad_packed_row

            input_ids, cu, longest = pad_packed_row(input_ids, ctx.cu_seqlens, ctx.max_seqlen, self.tp_size)
            ctx = VarlenContext(backend=ctx.backend, cu_seqlens=cu, max_seqlen=longest)
            position_ids = None  # megatron reads THD positions from cu_seqlens
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=ctx.cu_seqlens,
            cu_seqlens_kv=ctx.cu_seqlens,
            max_seqlen_q=ctx.max_seqlen,
            max_seqlen_kv=ctx.max_seqlen,
        )
        setattr(packed, CONTEXT_KWARG, ctx)  # read by VarlenCoreAttention: one context per forward
        # RoPE positions restart per sequence from cu_seqlens; megatron ignores position_ids here
        hidden = self.gpt(
            input_ids=input_ids, position_ids=position_ids, attention_mask=None, packed_seq_params=packed
        )
        if self.sequence_parallel:
            from hpref.models.megatron_sequence_parallel import gather_tokens

            hidden = gather_tokens(hidden)[:total]
        return BackboneOutput(last_hidden_state=self.norm(hidden.transpose(0, 1)))

    def blocks(self) -> list[nn.Module]:
        return list(self.gpt.decoder.layers)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each decoder layer in backward (torch's non-reentrant checkpoint; megatron's own
        recompute forks its CUDA RNG tracker, see the module docstring)."""
        from torch.utils.checkpoint import checkpoint

        kwargs = {"use_reentrant": False, **(activation_checkpointing_kwargs or {})}
        for layer in self.blocks():
            if "forward" in layer.__dict__:
                continue
            plain = layer.forward
            layer.forward = lambda *a, _f=plain, **kw: checkpoint(_f, *a, **kwargs, **kw)

    def activation_checkpointing_disable(self) -> None:
        for layer in self.blocks():
            layer.__dict__.pop("forward", None)

    def load_hf_state(self, hf_state: dict[str, torch.Tensor], tp_rank: int = 0) -> None:
        """Load a transformers state dict (this rank's tensor-parallel shard of it); strict."""
        ours = hf_to_megatron(
            hf_state, self.shape, tp_rank=tp_rank, tp_size=self.tp_size, vocab_multiple=self.vocab_multiple
        )
        missing, unexpected = self.load_state_dict(ours, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(
                f"megatron conversion left keys out: missing {missing[:4]}, unexpected {unexpected[:4]}"
            )


# --------------------------------------------------------------------------------------------------
# weight conversion (pure functions on state dicts)

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
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
    hf = _BackboneKeys(hf_state)
    out: dict[str, torch.Tensor] = {}
    embed = hf["embed_tokens.weight"]
    pad = shape.padded_vocab(vocab_multiple or tp_size) - embed.shape[0]
    if pad:  # rows no token id reaches, so the vocab splits evenly over the ranks
        embed = torch.cat([embed, embed.new_zeros(pad, embed.shape[1])])
    out["gpt.embedding.word_embeddings.weight"] = _rows(embed, tp_rank, tp_size)
    out["norm.weight"] = hf["norm.weight"]
    for i in range(shape.num_layers):
        src = f"layers.{i}."
        dst = f"gpt.decoder.layers.{i}."
        for hf_name, mc_name in _HF_PER_LAYER.items():
            value = hf[src + hf_name]
            if mc_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                value = _rows(value, tp_rank, tp_size, dim=1)  # row-parallel: split the input dim
            out[dst + mc_name] = value
        attn = src + "self_attn."
        for part in ("weight", "bias"):
            if attn + f"q_proj.{part}" not in hf:
                continue
            fused = _fuse_qkv(
                hf[attn + f"q_proj.{part}"], hf[attn + f"k_proj.{part}"], hf[attn + f"v_proj.{part}"], shape
            )
            out[dst + f"self_attention.linear_qkv.{part}"] = _rows(fused, tp_rank, tp_size)
        gate = _rows(hf[src + "mlp.gate_proj.weight"], tp_rank, tp_size)
        up = _rows(hf[src + "mlp.up_proj.weight"], tp_rank, tp_size)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up])  # megatron's GLU: chunk(2) per rank
    return out


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
