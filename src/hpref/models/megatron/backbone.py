"""megatron-core GPT backbones for Llama-family transformers folders (issue #15).

A `MegatronBackbone` is a megatron-core `GPTModel` (RMSNorm, SwiGLU, RoPE, grouped-query attention;
tensor parallel over megatron's model-parallel group) that takes the place of a transformers
backbone inside hpref's `PreferenceModel`: it is called the same way (one packed row of token ids,
restarting position ids, hpref's `VarlenContext`) and returns `last_hidden_state`, so pooling and
heads are unchanged. Weights come from, and go back to, a plain transformers folder:
`hpref.models.megatron.convert` fuses Q/K/V per query group and gate/up into megatron's layouts
and cuts this rank's tensor-parallel shard, and undoes it from the gathered shards.

What megatron-core needs CUDA for, and the seams that keep it off this CPU-only path:

- Packed (THD) sequences: megatron-core's own `DotProductAttention` refuses `packed_seq_params`
  ("use TEDotProductAttention", i.e. Transformer Engine, GPU-only). The layer spec's
  `core_attention` is hpref's `VarlenCoreAttention` instead, which runs hpref's varlen attention
  backends (per-sequence SDPA on CPU; flash-attn / torch varlen on CUDA where installed).
- RoPE: `RotaryEmbedding.get_emb` moves its frequencies to `torch.cuda.current_device()` on every
  forward. `_CpuRotaryEmbedding` computes the same table where it is (only when CUDA is absent).
- Weights are created on the CPU (`use_cpu_initialization`; on the meta device when the trainer
  builds the model, `hpref.models.megatron.preference`) and then overwritten by the converted
  checkpoint, so megatron's CUDA RNG tracker is never used; dropout inside the backbone is off
  (preference-model fine-tuning runs without it; a recipe asking for it is refused).

megatron-core is an optional extra (`pip install 'hpref[megatron]'`); importing this module without
it raises one line that says so.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpref.errors import UserError
from hpref.models.attention import CONTEXT_KWARG, varlen_attention_forward
from hpref.models.megatron.convert import MegatronShape
from hpref.models.packed_layout import VarlenContext


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


def transformer_config(
    shape: MegatronShape,
    *,
    tp_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    pipeline_parallel: int = 1,
):
    """megatron-core's `TransformerConfig` for `shape`, with every fused CUDA kernel off;
    `sequence_parallel` applies only where `tp_size` > 1 (`hpref.models.megatron.sequence_parallel`);
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


def no_cuda_stream_advice() -> None:
    """On a host without CUDA, megatron's once-per-process advice on the first tensor- or
    sequence-parallel matmul (set CUDA_DEVICE_MAX_CONNECTIONS=1, about CUDA streams) is marked as
    given, so it stays off the console."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import layers

    layers.linear_with_grad_accumulation_and_async_allreduce.warned = True


def varlen_layer_spec() -> Any:
    """megatron's local (no Transformer Engine) Llama layer spec: RMSNorm, with hpref's varlen
    attention in its `core_attention` slot (the packed THD path on CPU and CUDA), and torch's RMSNorm
    in the norm slots marked for sequence parallelism when it is on (`SequenceParallelRMSNorm`: the
    same module megatron's spec builds without Apex, which refuses sequence parallelism)."""
    from hpref.models.megatron.sequence_parallel import SequenceParallelRMSNorm

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
        tensor-parallel regions (`hpref.models.megatron.sequence_parallel`); `pipeline_parallel` > 1
        builds this rank's stage only (megatron's pipeline rank picks the layers; the embedding on
        the first stage, the final norm on the last, `hpref.models.megatron.pipeline`)."""
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
            from hpref.models.megatron.sequence_parallel import (
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
        no_cuda_stream_advice()
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
            from hpref.models.megatron.sequence_parallel import pad_packed_row

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
            from hpref.models.megatron.sequence_parallel import gather_tokens

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
        from hpref.models.megatron.convert import hf_to_megatron

        ours = hf_to_megatron(
            hf_state, self.shape, tp_rank=tp_rank, tp_size=self.tp_size, vocab_multiple=self.vocab_multiple
        )
        missing, unexpected = self.load_state_dict(ours, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(
                f"megatron conversion left keys out: missing {missing[:4]}, unexpected {unexpected[:4]}"
            )
