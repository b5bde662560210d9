"""The seams between hpref and its components, as `typing.Protocol`s (structural: no base class to
inherit, a plugin only has to have the members).

Each Protocol is what one component kind's `build(...)` returns (`hpref.hookspecs` says how each is
built). They are `runtime_checkable`, so `isinstance(obj, Formatter)` checks that the members exist;
`tests/test_protocols.py` checks every built-in component against its Protocol, signatures included.

    model      [model]          PreferenceModel   scores packed micro-batches
    dataset    [dataset.*]      BattleSource      streams `Battle` records
    formatter  [formatter]      Formatter         one battle (one view) -> token ids
    optimizer  [optimizer]      Optimizer         steps the trainable parameters

What a model family can do beyond `PreferenceModel` is a Protocol of its own, one per capability,
and the code that uses a capability asks `isinstance(model, <Protocol>)` (never a name probe):

    ParallelizesItself     `Components.parallelize`: the model's own parallelism instead of FSDP2
    ReducesOwnGradients    the train step: the model reduces and clips its gradients
    RunsOwnSchedule        the train step: the model runs a step's micro-batches (a pipeline stage)
    ViewsCheckpoint        train checkpoints and `hpref save`: tensors as views of the stored ones
    KeysCheckpoint         ... stored under the model's own keys (a pipeline stage's layer numbers)
    LoadsPlainState        `hpref init` weights: the model converts and loads the plain layout itself

The megatron-core family (`hpref.models.megatron`) has them all; a transformers backbone none.
Reward and engine components (`hpref rl`) have theirs beside the RL code that calls them.
This module imports nothing of hpref's, so any layer may name these types.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class PreferenceModel(Protocol):
    """What a model component builds (`hpref.models.PreferenceModel` for every built-in): a
    `torch.nn.Module` that scores one packed, padding-free micro-batch.

    Attributes: `tokenizer` (a Hugging Face fast tokenizer), `backbone_config` (its HF config, with
    `hidden_size`), `max_position_embeddings`, and what this model is, which commands read rather
    than probe for (`hpref.families.ModelFamilySpec` says what its family allows):

        head_kind       'judge' (one sequence, 3 logits) or 'reward' (a scalar per answer)
        paired          True for a reward model, which reads two sequences per battle
        pooling         the token(s) the head reads: 'last', 'first' or 'mean'
        fresh_head      a new (seeded) head, not a trained one: the trainer may set its output
                        bias to the labels' prior (`set_output_bias`, called only then)
        exports_sequence_classifier  `save_pretrained` writes transformers' one-label sequence
                        classifier (a reward model pooled as that class pools)
        head            the head module the FSDP2 path keeps in fp32 (None: none on this rank)
        data_parallel   how the data is split when not over every rank (`DataParallelSplit`, a
                        tensor-parallel model's data-parallel group); None: every rank

    A `register_models` plugin's model that lacks one is given the judge's value when it is built
    (`hpref.plugins`), so these are always there."""

    tokenizer: Any
    backbone_config: Any
    head_kind: str
    paired: bool
    pooling: str
    fresh_head: bool
    head: Any
    data_parallel: DataParallelSplit | None

    @property
    def exports_sequence_classifier(self) -> bool: ...

    @property
    def max_position_embeddings(self) -> int: ...

    def forward(
        self, input_ids: Any, cu_seqlens: Any, position_ids: Any, *, max_seqlen: int | None = None
    ) -> Any:
        """Logits `[n, num_labels]` (float32) for the n sequences (or pairs) packed in one row;
        positions restart at 0 per sequence."""
        ...

    def blocks(self) -> Sequence[Any]:
        """The transformer blocks: FSDP2 and activation checkpointing wrap each one."""
        ...

    def set_activation_checkpointing(self, enabled: bool = True) -> None: ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of a sequence of `seq_len` tokens (for MFU)."""
        ...

    def pretrained_state_dict(self) -> dict[str, Any]:
        """The full initial state dict on CPU (`backbone.<HF key>`, `head.*`)."""
        ...

    def load_pretrained_weights(self, *, device: Any = None, broadcast_from_rank0: bool = False) -> None:
        """Materialise a meta-built (possibly sharded) model and fill its initial weights."""
        ...

    def save_pretrained(self, folder: str | Path, state_dict: dict[str, Any] | None = None) -> Path:
        """An HF-style folder that `PreferenceModel.from_pretrained` reads back."""
        ...

    def set_output_bias(self, bias: Any) -> None:
        """Set the head's output bias (logits of the labels' prior); called only on a `fresh_head`."""
        ...


@runtime_checkable
class DataParallelSplit(Protocol):
    """Where a rank sits when the data is split over fewer ranks than the world (tensor parallel:
    the ranks of one model copy see the same micro-batches): this rank's index among `size`, and
    the process group they form (None: the world's)."""

    rank: int
    size: int
    group: Any


@runtime_checkable
class BattleSource(Protocol):
    """What a dataset component builds: a re-iterable stream of battles in a fixed order.

    `summary` counts rows read / used / skipped once `battles()` is exhausted. Optional:
    `fingerprint() -> str`, the stream's identity, which the token cache keys on (a source without
    one is tokenized every time)."""

    summary: Any

    def battles(self) -> Iterator[Any]:
        """Stream the selected `hpref.data.Battle` records."""
        ...


@runtime_checkable
class Formatter(Protocol):
    """What a formatter component builds: one view of a battle -> at most `max_length` token ids,
    ending where a judge gives its verdict. Callers encode `battle.swapped()` for the B/A view.

    Optional, used when present: `encode_many(battles)` (batched; objects with `ids`, `truncated`,
    `full_length`, `split`), `fingerprint() -> str` (the token cache key) and `paired = True` (a
    reward model's formatter: `split` cuts each battle into A's and B's sequence)."""

    tokenizer: Any
    max_length: int

    def encode(self, battle: Any) -> list[int]: ...


@runtime_checkable
class Optimizer(Protocol):
    """What an optimizer component builds: a `torch.optim.Optimizer` (or anything with its members)
    over the model's trainable parameters. `param_groups[i]["lr"]` is the base rate the scheduler
    multiplies; the state dict goes into every checkpoint."""

    param_groups: list[dict[str, Any]]

    def step(self, closure: Any = None) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


#: component kind -> the Protocol of what its `build` returns (the kinds of `hpref.plugins.KINDS`
#: that this module covers).
PROTOCOLS: dict[str, type] = {
    "model": PreferenceModel,
    "dataset": BattleSource,
    "formatter": Formatter,
    "optimizer": Optimizer,
}


# --------------------------------------------------------------------------------------------------
# what a model family can do beyond PreferenceModel (each checked with isinstance where it is used)


@runtime_checkable
class ParallelizesItself(Protocol):
    """Parallelises itself (megatron-gpt: tensor parallel inside, data parallel by a gradient
    all-reduce) rather than through hpref's FSDP2 (`hpref.models.parallelize`)."""

    def parallelize_self(self, *, param_dtype: Any, activation_checkpointing: bool) -> Any: ...


@runtime_checkable
class ReducesOwnGradients(Protocol):
    """Reduces its gradients over its own groups and clips them by the global norm; returns it."""

    def reduce_and_clip_gradients(self, max_norm: float | None) -> Any: ...


@runtime_checkable
class RunsOwnSchedule(Protocol):
    """Runs forward and backward of a step's micro-batches itself (a pipeline stage); returns the
    summed per-sequence loss."""

    def forward_backward(self, batches: Sequence[Any], loss: Any, scale: float) -> Any: ...


@runtime_checkable
class ViewsCheckpoint(Protocol):
    """Gives each state tensor as a view of the full tensor a checkpoint stores (its shards)."""

    def checkpoint_view(self, key: str, tensor: Any) -> Any: ...


@runtime_checkable
class KeysCheckpoint(Protocol):
    """Stores each tensor under its own key (a pipeline stage: local layer numbers made global)."""

    def checkpoint_key(self, key: str) -> str: ...


@runtime_checkable
class LoadsPlainState(Protocol):
    """Loads a plain (transformers-layout, unsharded) state dict itself, each rank its own shard."""

    def load_plain_state(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class SyncsGradientsOnDemand(Protocol):
    """FSDP2's switch for reducing gradients in this backward or not (on all but the last
    micro-batch of a step it is off)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None: ...
