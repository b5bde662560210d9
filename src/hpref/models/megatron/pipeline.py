"""Pipeline parallelism for `megatron-gpt`: one stage of the model per rank, and the schedule.

The stages are megatron-core's: with `pipeline_model_parallel_size` in its parallel state and
config, `GPTModel` builds this rank's share of the decoder layers (the embedding on the first stage
only, `pre_process`), numbered from 0 locally (`layer.layer_number` keeps the global, 1-based number).
hpref's backbone adds the final norm on the last stage, and `MegatronPipelineModel` keeps the
preference head there (pooling, head and loss run on the last stage only).

The schedule is hpref's, not megatron's: megatron-core's pipeline schedules and their p2p
communication allocate on `torch.cuda.current_device()` and autocast for CUDA, so they cannot run
on CPU. `forward_backward` is GPipe-style, per optimizer step: every micro-batch goes forward
through the stages (each stage keeps its graphs), the last stage computes each micro-batch's loss
and backward at once, then the gradients of the activations go back, stage by stage, in the same
order. Every send is matched by a receive posted in the same order on the neighbour, so blocking
`torch.distributed.send` / `recv` over the pipeline group cannot deadlock. Packed rows change length
every micro-batch: an activation goes with a header (its dtype and shape); its gradient has the
activation's shape, which the receiver knows.

What the trainer sees (`hpref.train.loop.train_step`, `hpref.prediction.predict`):

- `forward_backward(batches, loss, scale)` instead of the loop's own per-micro-batch forward and
  backward; it returns the summed loss, broadcast from the last stage so every rank logs the same;
- `forward` (evaluation, no autograd across stages): the logits, computed on the last stage and
  broadcast to the pipeline group, so every rank returns the same predictions;
- `reduce_and_clip_gradients`: the stage's gradient norm (data-parallel average, tensor-parallel
  shards) squared and summed over the pipeline group, so the clip is the one of the whole model;
- `checkpoint_key`: a stage's local layer `i` is stored under its global number, so a checkpoint
  holds each layer once under the key an unsplit model has (a one-process `hpref save`, a resume
  with any split).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from loguru import logger

from hpref.models.attention import CONTEXT_KWARG
from hpref.models.megatron.preference import MegatronPreferenceModel
from hpref.models.packed_layout import VarlenContext

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hpref.models.megatron.backbone import MegatronBackbone

_LOCAL_LAYER = re.compile(r"^(.*\bbackbone\.gpt\.decoder\.layers\.)(\d+)(\..*)$")
#: dtypes an activation may have (under autocast), by their index in the header
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class PipelineStage:
    """Where this rank sits in its pipeline: stage `rank` of `size`, neighbours as global ranks."""

    rank: int
    size: int
    group: Any
    previous: int | None  # global rank of the stage before (None on the first)
    next: int | None  # global rank of the stage after (None on the last)
    last_global: int  # global rank of the last stage: where the loss and the logits are
    layer_offset: int  # global index of this stage's first decoder layer
    num_layers: int  # decoder layers on this stage

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def owns(self, key: str) -> bool:
        """Whether a key of the unsplit model (global layer numbers) belongs to this stage."""
        if ".embedding." in key:
            return self.first
        if key.startswith(("head.", "backbone.norm.")):
            return self.last
        match = _LOCAL_LAYER.match(key)
        return match is None or self.layer_offset <= int(match[2]) < self.layer_offset + self.num_layers

    def to_global(self, key: str) -> str:
        """A stage key (local layer number) as the unsplit model names it."""
        match = _LOCAL_LAYER.match(key)
        return key if match is None else f"{match[1]}{int(match[2]) + self.layer_offset}{match[3]}"

    def to_local(self, key: str) -> str:
        match = _LOCAL_LAYER.match(key)
        return key if match is None else f"{match[1]}{int(match[2]) - self.layer_offset}{match[3]}"

    def select(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This stage's part of an unsplit model's state dict, in the stage's own keys."""
        return {self.to_local(k): v for k, v in state.items() if self.owns(k)}


def pipeline_stage(backbone: MegatronBackbone) -> PipelineStage:
    """The stage megatron's parallel state gives this rank (the backbone is built for it)."""
    from megatron.core import parallel_state

    layers = list(backbone.gpt.decoder.layers)
    return PipelineStage(
        rank=parallel_state.get_pipeline_model_parallel_rank(),
        size=parallel_state.get_pipeline_model_parallel_world_size(),
        group=parallel_state.get_pipeline_model_parallel_group(),
        previous=None if backbone.first_stage else parallel_state.get_pipeline_model_parallel_prev_rank(),
        next=None if backbone.last_stage else parallel_state.get_pipeline_model_parallel_next_rank(),
        last_global=parallel_state.get_pipeline_model_parallel_last_rank(),
        layer_offset=layers[0].layer_number - 1,  # megatron's numbers are global and 1-based
        num_layers=len(layers),
    )


# --------------------------------------------------------------------------------------------------
# point-to-point


def send_activation(tensor: torch.Tensor, dst: int, group: Any) -> None:
    """A header (dtype index, then the shape) and the tensor: the receiver allocates from it. Both
    on the activation's device (NCCL sends device tensors only)."""
    header = torch.tensor(
        [_DTYPES.index(tensor.dtype), *tensor.shape], dtype=torch.int64, device=tensor.device
    )
    dist.send(header, dst, group=group)
    dist.send(tensor.detach().contiguous(), dst, group=group)


def receive_activation(src: int, group: Any, ndim: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(1 + ndim, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    tensor = torch.empty(header[1:].tolist(), dtype=_DTYPES[int(header[0])], device=device)
    dist.recv(tensor, src, group=group)
    return tensor


# --------------------------------------------------------------------------------------------------
# the model


class MegatronPipelineModel(MegatronPreferenceModel):
    """One pipeline stage of a `megatron-gpt` model, and the schedule over the stages (see the
    module docstring). Every rank of a pipeline is given the same micro-batches."""

    def __init__(self, backbone: MegatronBackbone, tokenizer: PreTrainedTokenizerBase, **kwargs: Any):
        super().__init__(backbone, tokenizer, **kwargs)
        self.stage = pipeline_stage(backbone)
        if not self.stage.last:
            self.head = None  # the head lives on the last stage; a copy here would never train
        # MFU counts the whole model's FLOPs: every stage's share (on the GPU under NCCL)
        nccl = dist.get_backend(self.stage.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        params = torch.tensor(self._matmul_params_here(), dtype=torch.float64, device=device)
        dist.all_reduce(params, group=self.stage.group)
        self._flops_params = int(params)

    def _matmul_params_here(self) -> int:
        embedding = getattr(self.backbone.gpt, "embedding", None)
        here = sum(p.numel() for p in self.parameters())
        return here - (sum(p.numel() for p in embedding.parameters()) if embedding is not None else 0)

    def parallelize_self(self, *, param_dtype: torch.dtype, activation_checkpointing: bool) -> Any:
        model = super().parallelize_self(
            param_dtype=param_dtype, activation_checkpointing=activation_checkpointing
        )
        stage = self.stage
        logger.info(
            f"megatron-core: pipeline stage {stage.rank + 1} of {stage.size} (layers {stage.layer_offset}"
            f"-{stage.layer_offset + stage.num_layers - 1}{', embedding' if stage.first else ''}"
            f"{', norm and head' if stage.last else ''}), GPipe schedule over torch.distributed p2p"
        )
        return model

    # ------------------------------------------------------------------------------------- weights
    def pretrained_state_dict(self) -> dict[str, torch.Tensor]:
        return self.stage.select(super().pretrained_state_dict())

    def pretrained_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's part of the initial weights, in its own keys (the others are converted and
        dropped one at a time)."""
        for key, value in super().pretrained_items():
            if self.stage.owns(key):
                yield self.stage.to_local(key), value

    def _megatron_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.stage.select(super()._megatron_state(state))

    def set_output_bias(self, bias: torch.Tensor) -> None:
        if self.head is not None:
            super().set_output_bias(bias)

    def checkpoint_key(self, key: str) -> str:
        """The key a checkpoint stores this stage's `key` under: the unsplit model's."""
        return self.stage.to_global(key)

    # ------------------------------------------------------------------------------------- a stage
    def _run_stage(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_ids: torch.Tensor,
        max_seqlen: int | None,
        hidden: torch.Tensor | None,
    ) -> torch.Tensor:
        """This stage on one micro-batch: `hidden` `[1, T, H]` from the stage before (None on the
        first); returns the hidden states for the next stage, or on the last stage the logits."""
        if hidden is not None:
            self.backbone.gpt.set_input_tensor(hidden.transpose(0, 1))  # megatron's [T, 1, H]
        if self.stage.last:
            return super().forward(input_ids, cu_seqlens, position_ids, max_seqlen=max_seqlen)
        cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        ctx = VarlenContext(backend=self.attention, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        compute = (
            nullcontext()
            if self.autocast_dtype is None
            else torch.autocast(input_ids.device.type, dtype=self.autocast_dtype)
        )
        with compute:
            out = self.backbone(
                input_ids=input_ids[None], position_ids=position_ids[None], **{CONTEXT_KWARG: ctx}
            )
        return out.last_hidden_state  # [1, T, H]: a stage before the last has no norm

    def _receive(self, device: torch.device) -> torch.Tensor | None:
        if self.stage.first:
            return None
        assert self.stage.previous is not None
        return receive_activation(self.stage.previous, self.stage.group, 3, device)

    def forward(self, input_ids, cu_seqlens, position_ids, *, max_seqlen=None):
        """Logits `[n, num_labels]` on every rank of the pipeline: the stages run in turn and the
        last one broadcasts its logits. Without autograd across the stages: evaluation (training
        goes through `forward_backward`)."""
        out = self._run_stage(
            input_ids, cu_seqlens, position_ids, max_seqlen, self._receive(input_ids.device)
        )
        stage = self.stage
        if not stage.last:
            assert stage.next is not None
            send_activation(out, stage.next, stage.group)
        # the logits' shape is the head's: [n, 3] for a judge, one row per pair of a reward model's
        # paired sequences, so the last stage sends it first
        shape = torch.tensor(out.shape if stage.last else (0, 0), dtype=torch.int64, device=input_ids.device)
        dist.broadcast(shape, src=stage.last_global, group=stage.group)
        if not stage.last:
            out = torch.empty(shape.tolist(), dtype=torch.float32, device=input_ids.device)
        out = out.detach().contiguous()
        dist.broadcast(out, src=stage.last_global, group=stage.group)
        return out

    # ------------------------------------------------------------------------------------ training
    def forward_backward(
        self,
        batches: Sequence[Any],
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Forward and backward of one optimizer step's micro-batches through the pipeline (GPipe;
        see the module docstring): the gradient of `sum over micro-batches of sum(loss * weights) *
        scale`, as the loop's own per-micro-batch backward gives it. Returns the summed
        per-sequence loss (detached), the same on every stage."""
        stage = self.stage
        device = batches[0].input_ids.device if batches else torch.device("cpu")
        loss_sum = torch.zeros((), device=device)
        received: list[torch.Tensor | None] = []
        sent: list[torch.Tensor] = []
        for batch in batches:
            hidden = self._receive(device)
            if hidden is not None:
                hidden.requires_grad_(True)
            received.append(hidden)
            out = self._run_stage(
                batch.input_ids, batch.cu_seqlens, batch.position_ids, batch.max_seqlen, hidden
            )
            if stage.last:
                per_sequence = loss(out, batch.labels) * batch.weights
                (per_sequence.sum() * scale).backward()
                loss_sum += per_sequence.detach().sum()
            else:
                assert stage.next is not None
                send_activation(out, stage.next, stage.group)
                sent.append(out)
        for k, hidden in enumerate(received):
            if not stage.last:
                grad = torch.empty_like(sent[k])
                dist.recv(grad, stage.next, group=stage.group)
                sent[k].backward(grad)
            if hidden is not None:
                assert stage.previous is not None and hidden.grad is not None
                dist.send(hidden.grad.contiguous(), stage.previous, group=stage.group)
        self.backbone.gpt.set_input_tensor(None)  # hold no activation past the step
        dist.broadcast(loss_sum, src=stage.last_global, group=stage.group)
        return loss_sum

    def reduce_and_clip_gradients(self, max_norm: float | None) -> torch.Tensor:
        """The stage's gradients averaged over data parallel (`MegatronPreferenceModel`'s), then
        clipped by the norm over every stage; returns that norm."""
        stage_norm = super().reduce_and_clip_gradients(None)
        square = stage_norm.pow(2)
        dist.all_reduce(square, group=self.stage.group)
        norm = square.sqrt()
        if max_norm:
            coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(coefficient.to(p.grad.dtype))
        return norm
