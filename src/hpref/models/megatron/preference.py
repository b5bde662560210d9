"""`MegatronPreferenceModel`: hpref's `PreferenceModel` over a megatron-core `MegatronBackbone`.

Pooling and heads are `PreferenceModel`'s; what differs is what a tensor-parallel backbone needs
from the trainer, and each is a method the trainer looks for (`hpref.train`):

- parallel state: `init_model_parallel` sets up megatron's groups over the process group hpref
  already created (tensor-parallel groups of consecutive ranks, data parallel over the rest) before
  the backbone is built, because megatron's layers read their tensor-parallel size at construction;
- `parallelize_self`: no FSDP2 (it would turn megatron's tensor-parallel shards into DTensors megatron's
  layers do not expect); gradients are averaged over the data-parallel group by
  `reduce_and_clip_gradients`, one flat all-reduce per step after the last micro-batch (what
  megatron's own `finalize_model_grads` does), which also computes the global gradient norm across
  tensor-parallel shards before clipping;
- `data_parallel`: the rank, size and group the sampler, the loss and evaluation split data over
  (the tensor-parallel ranks of one group see the same micro-batches);
- `checkpoint_view`: the layout a distributed checkpoint stores a tensor in: a tensor-parallel shard
  becomes a DTensor shard of the full tensor (DCP writes each shard once, replicas once), and the
  fused gate/up weight `[2 * ffn / tp, h]` is viewed as `[2, ffn / tp, h]`, so the stored tensor is
  the same whatever the tensor-parallel size (a one-process `hpref save` reads a TP = 2 run);
- `save_pretrained`: converts back to transformers keys (`megatron_to_hf`), so an export is a plain
  transformers folder that `hpref eval` reads through the transformers path.

With `pipeline_parallel` > 1 the model is `hpref.models.megatron.pipeline.MegatronPipelineModel`,
this rank's pipeline stage, which adds its own schedule (`forward_backward`) to these hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from loguru import logger
from torch import nn

from hpref.errors import UserError
from hpref.models.megatron.backbone import MegatronBackbone
from hpref.models.megatron.convert import megatron_to_hf, shape_of
from hpref.models.preference import PreferenceModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

FC1 = "mlp.linear_fc1."


@dataclass(frozen=True)
class DataParallel:
    """Where this rank sits in data parallelism: the data is split over `size` ranks."""

    rank: int
    size: int
    group: Any = None  # None: the default (world) group


@dataclass(frozen=True)
class ModelParallel:
    tp_rank: int
    tp_size: int
    data: DataParallel
    requested_tp: int = 1  # the recipe's; a process alone builds the model unsplit (tp_size 1)
    pp_size: int = 1  # pipeline stages (hpref.models.megatron.pipeline); 1 for a process alone
    requested_pp: int = 1


def init_model_parallel(tensor_parallel: int, pipeline_parallel: int = 1) -> ModelParallel:
    """megatron's parallel state over the existing process group. A process that is alone
    (`hpref save`, `hpref eval`) builds the model unsplit (tensor- and pipeline-parallel size 1), on
    a one-process gloo group on an in-memory store that it creates when there is none and leaves in
    place: megatron's layers hold its tensor-parallel group for as long as the model lives."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    tp, pp = (tensor_parallel, pipeline_parallel) if world > 1 else (1, 1)
    if world % (tp * pp):
        raise UserError(
            f"model.tensor_parallel x model.pipeline_parallel = {tp} x {pp} must divide the number of "
            f"ranks ({world}); data parallel takes the rest"
        )
    initialized = parallel_state.model_parallel_is_initialized()
    if initialized and (
        parallel_state.get_tensor_model_parallel_world_size() != tp
        or parallel_state.get_pipeline_model_parallel_world_size() != pp
    ):
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
    data = DataParallel(
        rank=parallel_state.get_data_parallel_rank(),
        size=parallel_state.get_data_parallel_world_size(),
        group=parallel_state.get_data_parallel_group() if world > 1 else None,
    )
    return ModelParallel(
        parallel_state.get_tensor_model_parallel_rank(),
        tp,
        data,
        requested_tp=tensor_parallel,
        pp_size=pp,
        requested_pp=pipeline_parallel,
    )


class MegatronPreferenceModel(PreferenceModel):
    """A `PreferenceModel` whose backbone is tensor parallel (see the module docstring); what its
    family supports (no LoRA: megatron's fused parallel linears are no PEFT targets) is
    `hpref.builtin.megatron.MEGATRON_FAMILY`'s."""

    def __init__(
        self,
        backbone: MegatronBackbone,
        tokenizer: PreTrainedTokenizerBase,
        *,
        parallel: ModelParallel,
        backbone_items: Callable[[], Iterator[tuple[str, torch.Tensor]]],
        **kwargs: Any,
    ):
        """`backbone_items()`: the backbone's initial weights in its own keys, one at a time
        (`iter_hf_to_megatron`); the generic `backbone_state` is their dict."""
        super().__init__(backbone, tokenizer, backbone_state=lambda: dict(backbone_items()), **kwargs)
        self._backbone_items = backbone_items
        self.parallel = parallel
        self.data_parallel = parallel.data
        self.autocast_dtype: torch.dtype | None = None
        self._tp_mesh: Any = None
        # megatron's vocab-parallel embedding is no nn.Embedding: leave its table out of the FLOPs
        # (a pipeline stage after the first has none)
        embedding = getattr(backbone.gpt, "embedding", None)
        if embedding is not None:
            self._flops_params -= sum(p.numel() for p in embedding.parameters())

    # ------------------------------------------------------------------------------------- forward
    def forward(self, input_ids, cu_seqlens, position_ids, *, max_seqlen=None):
        if self.autocast_dtype is None:
            return super().forward(input_ids, cu_seqlens, position_ids, max_seqlen=max_seqlen)
        with torch.autocast(input_ids.device.type, dtype=self.autocast_dtype):
            return super().forward(input_ids, cu_seqlens, position_ids, max_seqlen=max_seqlen)

    # ------------------------------------------------------------------------------------- weights
    def load_pretrained_weights(
        self, *, device: str | torch.device | None = None, broadcast_from_rank0: bool = False
    ) -> None:
        """Every rank converts the transformers weights and keeps its own tensor-parallel shard
        (a broadcast from rank 0 would give every rank rank 0's shard). Streamed: each converted
        tensor is copied into its parameter as it is made (`pretrained_items`), so a rank holds its
        shard of the model and one source tensor, not a converted copy of the whole model."""
        target = device if device is not None else self.target_device
        if any(p.is_meta for p in self.parameters()):
            self._materialize(target)
        self._fill(self.pretrained_items())
        self.to(target)

    def _fill(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each (key, tensor) into the parameter of that name, where it lives; every parameter
        must be filled and every key used (one `ValueError` naming the first few that are not)."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        unexpected: list[str] = []
        with torch.no_grad():
            for key, value in items:
                if key in params:
                    params[key].copy_(value)
                    filled.add(key)
                else:
                    unexpected.append(key)
        missing = sorted(set(params) - filled)
        if missing or unexpected:
            raise ValueError(
                f"megatron weights do not fit: missing {missing[:4]}, unexpected {unexpected[:4]}"
            )

    def _materialize(self, device: str | torch.device) -> None:
        """Give a meta-built model empty storage on `device`, keeping what megatron marks on its
        parameters (`tensor_model_parallel`, `partition_dim`, `sequence_parallel`, ...): `to_empty`
        makes new parameter objects, and gradient reduction and checkpoints read those marks."""
        marks = {name: dict(vars(param)) for name, param in self.named_parameters()}
        self.to_empty(device=device)
        for name, param in self.named_parameters():
            for key, value in marks[name].items():
                setattr(param, key, value)
        self.__dict__.pop("_param_keys", None)  # `checkpoint_view`'s cache of the old objects

    def pretrained_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The initial weights in this model's keys, one tensor at a time: the converted pretrained
        (or seeded) backbone, then the head."""
        for key, value in self._backbone_items():
            yield f"backbone.{key}", value
        for key, value in self._head_state().items():
            yield f"head.{key}", value

    def load_plain_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict in the transformers layout (`backbone.*` transformers keys,
        `head.*`: what `save_pretrained` and `hpref init` write), this rank's shard of it."""
        self._fill(self._megatron_state(state).items())

    def _megatron_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A transformers-layout state dict (`backbone.*`, `head.*`) in this model's keys and shards."""
        from hpref.models.megatron.convert import hf_to_megatron

        backbone = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
        ours = hf_to_megatron(
            backbone,
            self.backbone.shape,
            tp_rank=self.parallel.tp_rank,
            tp_size=self.parallel.tp_size,
            vocab_multiple=self.backbone.vocab_multiple,
        )
        ours = {f"backbone.{k}": v for k, v in ours.items()}
        ours.update({k: v for k, v in state.items() if k.startswith("head.")})
        return ours

    def save_pretrained(self, folder, state_dict: dict[str, torch.Tensor] | None = None):
        """A plain transformers folder (see `PreferenceModel.save_pretrained`): the backbone's
        megatron state (one unsplit process: `hpref save`) converted back to transformers keys."""
        if self.parallel.tp_size != 1 or self.parallel.pp_size != 1:
            raise ValueError("save_pretrained needs the unsplit model (hpref save builds it on one process)")
        state = state_dict if state_dict is not None else self.state_dict()
        backbone = {
            k.removeprefix("backbone."): v
            for k, v in state.items()
            if k.startswith("backbone.") and not k.endswith("_extra_state")
        }
        hf = megatron_to_hf([backbone], self.backbone.shape)
        plain = {f"backbone.{k}": v for k, v in hf.items()}
        plain.update({k: v for k, v in state.items() if k.startswith("head.")})
        return super().save_pretrained(folder, state_dict=plain)

    # --------------------------------------------------------------------------------- parallelism
    def parallelize_self(self, *, param_dtype: torch.dtype, activation_checkpointing: bool) -> nn.Module:
        """The trainer's parallelise step for this model (see the module docstring): fp32 master
        weights, `param_dtype` by autocast, the data-parallel group for gradients."""
        for name, requested, size in (
            ("tensor_parallel", self.parallel.requested_tp, self.parallel.tp_size),
            ("pipeline_parallel", self.parallel.requested_pp, self.parallel.pp_size),
        ):
            if requested != size:  # training alone with tp > 1 or pp > 1
                raise UserError(
                    f"model.{name} = {requested} needs a multiple of that many ranks to train on; this "
                    "run has 1 (set launch.nproc)"
                )
        if activation_checkpointing:
            self.set_activation_checkpointing(True)
        self.autocast_dtype = None if param_dtype == torch.float32 else param_dtype
        tp, data = self.parallel.tp_size, self.data_parallel
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
            # megatron's rank order: tensor parallel fastest, then data parallel, pipeline slowest
            shape, names = (self.parallel.pp_size, data.size, tp), ("pp", "dp", "tp")
            self._tp_mesh = init_device_mesh(device, shape, mesh_dim_names=names)["tp"]
        logger.info(
            f"megatron-core: tensor parallel {tp}"
            f"{' with sequence parallel' if self.backbone.sequence_parallel else ''} x data parallel "
            f"{data.size}, compute "
            f"{'fp32' if self.autocast_dtype is None else str(param_dtype).removeprefix('torch.')} "
            f"(fp32 weights), gradients all-reduced over data parallel, activation checkpointing "
            f"{'on' if activation_checkpointing else 'off'}"
        )
        return self

    def _sharded(self, param: torch.Tensor) -> bool:
        return self.parallel.tp_size > 1 and bool(getattr(param, "tensor_model_parallel", False))

    def reduce_and_clip_gradients(self, max_norm: float | None) -> torch.Tensor:
        """Sum the sequence-parallel norms' partial gradients over the tensor-parallel group, average
        the gradients over the data-parallel group (one flat all-reduce each), then clip them to
        `max_norm` by their global norm over every tensor-parallel shard; returns that norm."""
        params = [p for p in self.parameters() if p.grad is not None]
        if self.backbone.sequence_parallel:
            from hpref.models.megatron.sequence_parallel import sum_partial_gradients

            sum_partial_gradients(params)
        data = self.data_parallel
        if data.size > 1 and params:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=data.group)
            flat /= data.size
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        device = params[0].grad.device if params else torch.device("cpu")
        sharded = torch.zeros((), device=device, dtype=torch.float32)
        replicated = torch.zeros((), device=device, dtype=torch.float32)
        for p in params:
            square = p.grad.float().pow(2).sum()
            if self._sharded(p):
                sharded += square
            else:
                replicated += square
        if self.parallel.tp_size > 1:
            from megatron.core import parallel_state

            dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        norm = (sharded + replicated).sqrt()
        if max_norm:
            coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in params:
                p.grad.mul_(coefficient.to(p.grad.dtype))
        return norm

    # --------------------------------------------------------------------------------- checkpoints
    def checkpoint_view(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """How a distributed checkpoint stores `key`'s tensor (a parameter, or optimizer state of
        the parameter's shape): a view, so that loading into it in place fills the parameter."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return tensor
        param = self._params_by_key().get(key)
        if param is None or tensor.shape != param.shape:
            return tensor
        dim = getattr(param, "partition_dim", 0)
        if FC1 in key and key.endswith("weight"):
            tensor, dim = tensor.view(2, tensor.shape[0] // 2, *tensor.shape[1:]), 1
        if not self._sharded(param):
            return tensor
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(tensor, self._tp_mesh, [Shard(dim)], run_check=False)

    def _params_by_key(self) -> dict[str, torch.Tensor]:
        cached = getattr(self, "_param_keys", None)
        if cached is None:
            cached = dict(self.named_parameters())
            self._param_keys = cached
        return cached


def build_megatron_model(
    hf_config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    hf_state: Any,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    num_labels: int,
    sequence_parallel: bool = False,
    device: torch.device | str,
    meta: bool,
    head_kwargs: dict[str, Any],
    provenance: dict[str, Any],
    pipeline_class: type[MegatronPreferenceModel] | None = None,
) -> MegatronPreferenceModel:
    """A `MegatronPreferenceModel` over `hf_config`'s architecture; `hf_state()` gives the full
    transformers state dict, read when the weights are loaded (at once unless `meta`: the trainer
    loads them after parallelising). With more than one pipeline stage the model is a
    `pipeline_class` (`hpref.models.megatron.pipeline.MegatronPipelineModel`), this rank's stage."""
    shape = shape_of(hf_config)
    if shape.num_layers % pipeline_parallel:
        raise UserError(
            f"model.pipeline_parallel = {pipeline_parallel} must divide the model's {shape.num_layers} "
            "layers (every stage holds as many)"
        )
    parallel = init_model_parallel(tensor_parallel, pipeline_parallel)
    if parallel.pp_size > 1 and pipeline_class is None:
        raise ValueError("pipeline_parallel > 1 needs the pipeline_class that runs the stages")
    # on the meta device when the trainer loads the weights later: megatron's CPU initialisation
    # (a random full-size master weight per layer, then this rank's slice) would only be overwritten
    with torch.device("meta") if meta else nullcontext():
        backbone = MegatronBackbone(
            shape,
            tp_size=parallel.tp_size,
            hf_config=hf_config,
            vocab_multiple=tensor_parallel,
            sequence_parallel=sequence_parallel,
            pipeline_parallel=parallel.pp_size,
        )

    def backbone_items() -> Iterator[tuple[str, torch.Tensor]]:
        from hpref.models.megatron.convert import iter_hf_to_megatron

        return iter_hf_to_megatron(
            hf_state(),
            shape,
            tp_rank=parallel.tp_rank,
            tp_size=parallel.tp_size,
            vocab_multiple=tensor_parallel,
        )

    model_class = pipeline_class if parallel.pp_size > 1 and pipeline_class else MegatronPreferenceModel
    model = model_class(
        backbone,
        tokenizer,
        parallel=parallel,
        num_labels=num_labels,
        pooling="last",
        backbone_items=backbone_items,
        provenance=provenance,
        **head_kwargs,
    )
    model.eval()
    model.target_device = torch.device(device)
    if not meta:
        model.load_pretrained_weights(device=device)
    return model
