"""The causal LM the rl trainer trains on megatron-core (issue #15: `trainer_backend = "megatron"` in
a policy's table; `hpref.rl.trainer.backends.MegatronBackend` builds it, the trainer sees the backend only).

The trainer's causal LM is then a megatron-core `GPTModel` with its output layer (logits over the
vocabulary; tied to the input embedding when the transformers config ties them), built from the same
transformers weights the engine loads (`from_transformers`: the backend hands it the transformers LM
it built, a folder or the seeded tiny Llama), so version 0 still needs no transfer. Everything GRPO
needs goes through the transformers-shaped seams:

- `MegatronCausalLM.forward(input_ids, attention_mask)` returns `.logits` `[B, L, V]` for a
  right-padded batch, so `hpref.rl.policy.completion_logprobs` (temperature, targets, masks) is the
  same function for both backends. The rows are packed into one THD row (their real lengths), which
  is the path hpref's megatron attention takes on CPU (`hpref.models.megatron.VarlenCoreAttention`);
  padding positions get zero logits, and the completion mask never reads them.
- `hf_state_dict()` converts back to the transformers layout: the names and shapes of the
  transformers model's `state_dict()` (`model.` prefix, Q/K/V and gate/up un-fused, `lm_head.weight`
  also when it is tied), which is what `update_weights` sends the engine and what a save writes.
- `load_hf_state(state)` is the way in, from a save or a transformers folder.

Parallel state (`init_trainer_parallel`): a trainer alone (one rank) runs at tensor-parallel size 1
on a one-rank gloo group, created when the actor has no process group; a trainer group's ranks
(`ranks` = `trainer_tensor_parallel`, `hpref.rl.transport.rendezvous.join_group` made their process group) are
its tensor-parallel ranks. Then each rank holds its slice of every split weight (`hf_to_megatron`
with its `tp_rank`), runs every micro-batch of the rollout, and gets the logits over the whole
vocabulary (`parallel_output=False`: megatron gathers the vocabulary-parallel logits, and its
backward hands each rank its part); `clip_grad_norm` clips by the global norm (split weights
summed over the ranks, replicated ones once), and the optimizer steps each rank's own slices. What
leaves the trainer is the one-rank layout, gathered on rank 0 of the group: the transformers state
(`hf_state_dict`, for syncs and saves) and the optimizer state (`one_rank_optimizer_state`), which
`sliced_optimizer_state` cuts again, so a save resumes on any tensor-parallel size.
`release_model_parallel` destroys megatron's state and what this module created (`TrainerActor.close`).

Refused in one line each: LoRA (PEFT wraps transformers linears, not megatron's fused ones) and a
`trainer_tensor_parallel` other than `ranks` when the recipe is read (`PolicyConfig`); an
architecture megatron does not map (`hpref.models.megatron.convert.shape_of`), a tensor-parallel
size that does not divide the heads, key/value heads and MLP width, and megatron-core missing
before any actor starts (`MegatronBackend.check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PretrainedConfig, PreTrainedModel

#: the megatron-core keys of the final norm and the LM output layer (the rest are the backbone's)
FINAL_NORM = "gpt.decoder.final_layernorm.weight"
OUTPUT_LAYER = "gpt.output_layer.weight"


# --------------------------------------------------------------------------------------------------
# parallel state


def init_trainer_parallel() -> tuple[bool, int]:
    """megatron's parallel state for an rl trainer: tensor parallel over the whole process group a
    trainer group made, else size 1 (a one-rank gloo group on an in-memory store when the process
    has none). Returns (whether this call created the process group, the tensor-parallel size)."""
    import torch.distributed as dist

    from hpref.models.megatron.preference import init_model_parallel

    created = not dist.is_initialized()
    size = 1 if created else dist.get_world_size()
    init_model_parallel(size)
    return created, size


def release_model_parallel(created_group: bool) -> None:
    """Undo `init_trainer_parallel`: megatron's groups, and the process group if it made it
    (after this, megatron models built on them must not run again)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if created_group and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# weight conversion


def hf_causal_to_megatron(
    hf_state: dict[str, Any], shape: Any, *, tied: bool, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, Any]:
    """A transformers causal LM's state dict -> tensor-parallel rank `tp_rank`'s `MegatronCausalLM`
    state (the vocabulary padded to a multiple of `tp_size`, the output layer split like it)."""
    from hpref.models.megatron.convert import hf_to_megatron

    out = hf_to_megatron(hf_state, shape, tp_rank=tp_rank, tp_size=tp_size)
    out[FINAL_NORM] = out.pop("norm.weight")
    if not tied:
        head = hf_state["lm_head.weight"]
        pad = shape.padded_vocab(tp_size) - head.shape[0]
        if pad:
            head = torch.cat([head, head.new_zeros(pad, head.shape[1])])
        out[OUTPUT_LAYER] = head.chunk(tp_size)[tp_rank] if tp_size > 1 else head
    return out


def megatron_causal_to_hf(shards: list[dict[str, Any]], shape: Any, *, tied: bool) -> dict[str, Any]:
    """Every tensor-parallel rank's `MegatronCausalLM` state (rank order; one for size 1) -> the
    transformers causal LM's keys and shapes (`model.*` and `lm_head.weight`, which is a copy of
    the embedding when the two are tied), padding rows dropped."""
    from hpref.models.megatron.convert import megatron_to_hf

    backbones = []
    for state in shards:
        backbone = {k: v for k, v in state.items() if not k.endswith("_extra_state") and k != OUTPUT_LAYER}
        backbone["norm.weight"] = backbone.pop(FINAL_NORM)
        backbones.append(backbone)
    hf = {f"model.{k}": v for k, v in megatron_to_hf(backbones, shape).items()}
    if tied:
        head = hf["model.embed_tokens.weight"]
    else:
        heads = [state[OUTPUT_LAYER] for state in shards]
        head = (torch.cat(heads) if len(heads) > 1 else heads[0])[: shape.vocab_size]
    hf["lm_head.weight"] = head.clone().contiguous()
    return hf


def relayout(state: dict[str, Any], shape: Any, *, tied: bool, tp_rank: int, tp_size: int) -> dict[str, Any]:
    """A one-rank `MegatronCausalLM`-keyed state (weights, or an optimizer moment of each) -> the
    same cut for tensor-parallel rank `tp_rank` of `tp_size`."""
    hf = megatron_causal_to_hf([state], shape, tied=tied)
    return hf_causal_to_megatron(hf, shape, tied=tied, tp_rank=tp_rank, tp_size=tp_size)


def _gather_shards(
    state: dict[str, torch.Tensor], split: set[str], tp_size: int
) -> list[dict[str, Any]] | None:
    """Every tensor-parallel rank's `state` (rank order) on rank 0 of the group, None on the others:
    the keys in `split` gathered (a collective every rank joins, in the dict's order, the same on
    every rank), the replicated rest rank 0's own."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    root = parallel_state.get_tensor_model_parallel_src_rank()
    first = dist.get_rank() == root
    shards: list[dict[str, Any]] = [{} for _ in range(tp_size)]
    for key, tensor in state.items():
        if key in split:
            value = tensor.detach().contiguous()
            parts = [torch.empty_like(value) for _ in range(tp_size)] if first else None
            dist.gather(value, parts, dst=root, group=group)
            for shard, part in zip(shards, parts or [], strict=False):
                shard[key] = part
        else:
            for shard in shards:
                shard[key] = tensor
    return shards if first else None


# --------------------------------------------------------------------------------------------------
# the model


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, L, V]


class MegatronCausalLM(nn.Module):
    """A megatron-core `GPTModel` with its output layer, called like a transformers causal LM on a
    right-padded batch (see the module docstring)."""

    def __init__(self, hf_config: PretrainedConfig, tp_size: int = 1):
        """`tp_size` > 1: this rank's slice of a tensor-parallel model (megatron's parallel state set
        up at that size first: `init_trainer_parallel`)."""
        super().__init__()
        from hpref.models.megatron.backbone import cpu_rotary, transformer_config, varlen_layer_spec
        from hpref.models.megatron.convert import shape_of

        spec = varlen_layer_spec()  # first: it imports megatron's gpt package with its notes silenced
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel

        self.config = hf_config
        self.created_group = False
        self.shape = shape_of(hf_config)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.tp_size = tp_size
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp_size > 1 else 0
        if tp_size > 1:
            from hpref.models.megatron.sequence_parallel import place_collective_buffers_on_cpu

            place_collective_buffers_on_cpu()  # megatron's logit gather allocates on "the" CUDA device
        self.gpt = GPTModel(
            config=transformer_config(self.shape, tp_size=tp_size),
            transformer_layer_spec=spec,
            vocab_size=self.shape.padded_vocab(tp_size),
            max_sequence_length=self.shape.max_position_embeddings,
            pre_process=True,
            post_process=True,
            share_embeddings_and_output_weights=self.tied,
            position_embedding_type="rope",
            rotary_base=self.shape.rope_theta,
            parallel_output=False,  # every rank gets the logits over the whole vocabulary
        )
        cpu_rotary(self.gpt, even_with_cuda=True)  # an rl trainer's weights stay on the CPU

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any
    ) -> CausalLMOutput:
        """Logits `[B, L, V]` of a right-padded batch (zeros at padding positions)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        from hpref.models.attention import CONTEXT_KWARG
        from hpref.models.packed_layout import VarlenContext

        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        lengths = attention_mask.sum(dim=1)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        real = positions[None, :] < lengths[:, None]
        if not torch.equal(real, attention_mask.bool()):
            raise ValueError("MegatronCausalLM takes right-padded rows (the attention mask a prefix of ones)")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=input_ids.device)
        cu[1:] = torch.cumsum(lengths, 0)
        longest = int(lengths.max())
        ctx = VarlenContext(backend="auto", cu_seqlens=cu, max_seqlen=longest)
        packed = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
        setattr(packed, CONTEXT_KWARG, ctx)
        row = input_ids[real][None]  # [1, T]: the rows one after another
        logits = self.gpt(input_ids=row, position_ids=None, attention_mask=None, packed_seq_params=packed)
        logits = logits.reshape(-1, logits.shape[-1])[:, : self.shape.vocab_size]  # [T, V]
        out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
        out[real] = logits
        return CausalLMOutput(logits=out)

    def load_hf_state(self, hf_state: dict[str, Any]) -> None:
        """Load a transformers causal LM's state dict (every weight must be there)."""
        split = dict(tp_rank=self.tp_rank, tp_size=self.tp_size)
        ours = hf_causal_to_megatron(hf_state, self.shape, tied=self.tied, **split)
        missing, unexpected = self.load_state_dict(ours, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(
                f"megatron conversion left keys out: missing {missing[:4]}, unexpected {unexpected[:4]}"
            )

    def hf_state_dict(self) -> dict[str, Any]:
        """This model's weights as the transformers causal LM's state dict (detached CPU copies).
        Tensor parallel: every rank joins the gathers, rank 0 of the group gets the whole state and
        the others an empty dict."""
        state = {k: v.detach() for k, v in self.state_dict().items() if not k.endswith("_extra_state")}
        shards = [state] if self.tp_size == 1 else _gather_shards(state, self._split_names(), self.tp_size)
        if shards is None:
            return {}
        return {
            k: v.detach().cpu().clone()
            for k, v in megatron_causal_to_hf(shards, self.shape, tied=self.tied).items()
        }

    def _split_names(self) -> set[str]:
        """The parameters megatron splits over the tensor-parallel ranks (the rest are replicated)."""
        return {n for n, p in self.named_parameters() if getattr(p, "tensor_model_parallel", False)}

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients of `params` to `max_norm` by their global norm, which is returned: over
        every tensor-parallel slice, each replicated weight once (every rank holds the same gradient
        of it). One rank: torch's `clip_grad_norm_`, as the transformers trainer."""
        if self.tp_size == 1:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        import torch.distributed as dist
        from megatron.core import parallel_state

        stepped = [p for p in params if p.grad is not None]
        squares = torch.stack([p.grad.float().pow(2).sum() for p in stepped])
        is_split = torch.tensor([bool(getattr(p, "tensor_model_parallel", False)) for p in stepped])
        split = squares[is_split.to(squares.device)].sum()
        dist.all_reduce(split, group=parallel_state.get_tensor_model_parallel_group())
        norm = (split + squares[~is_split.to(squares.device)].sum()).sqrt()
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in stepped:
            p.grad.mul_(coefficient.to(p.grad.dtype))
        return norm

    def _moment_names(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The parameter name of each index of `optimizer`'s state dict."""
        names = {id(p): n for n, p in self.named_parameters()}
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]

    def _relayout_moments(
        self, state: dict[str, Any], names: list[str], convert: Any, *, local: bool
    ) -> dict[str, Any]:
        """An optimizer state dict whose moments (the tensors shaped like their parameter) went
        through `convert({param name: moment})` (`None`: this rank keeps nothing). `local`: the
        moments are this rank's (a parameter without them, never stepped, counts as zeros); else a
        save's, which has them for every parameter or none (a `KeyError` otherwise)."""
        params = dict(self.named_parameters())
        per_param = state["state"]
        kinds = sorted(
            {k for s in per_param.values() for k, v in s.items() if torch.is_tensor(v) and v.dim()}
        )
        out = {i: dict(s) for i, s in per_param.items()}
        for kind in kinds:
            have = {names[int(i)]: s[kind] for i, s in per_param.items() if kind in s}
            moments = {
                n: have[n] if n in have or not local else torch.zeros_like(p) for n, p in params.items()
            }
            converted = convert(moments)
            if converted is None:
                continue
            for i, s in out.items():
                if kind in s:
                    s[kind] = converted[names[int(i)]]
        return {"state": out, "param_groups": state["param_groups"]}

    def one_rank_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`optimizer`'s state dict in a one-rank trainer's layout (a save's, whatever the size):
        tensor parallel, every rank joins the gathers and rank 0 of the group gets the whole state."""
        state = optimizer.state_dict()
        if self.tp_size == 1:
            return state
        split = self._split_names()

        def gather(moments: dict[str, torch.Tensor]) -> dict[str, Any] | None:
            shards = _gather_shards(moments, split, self.tp_size)
            if shards is None:
                return None
            hf = megatron_causal_to_hf(shards, self.shape, tied=self.tied)
            return hf_causal_to_megatron(hf, self.shape, tied=self.tied)

        return self._relayout_moments(state, self._moment_names(optimizer), gather, local=True)

    def sliced_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> dict[str, Any]:
        """A one-rank optimizer state dict (`one_rank_optimizer_state`'s) cut into this rank's
        slices, for `optimizer.load_state_dict`."""
        if self.tp_size == 1 or not state.get("state"):
            return state
        split = dict(tp_rank=self.tp_rank, tp_size=self.tp_size)

        def cut(moments: dict[str, torch.Tensor]) -> dict[str, Any]:
            return relayout(moments, self.shape, tied=self.tied, **split)

        return self._relayout_moments(state, self._moment_names(optimizer), cut, local=False)

    def save_pretrained(self, folder: str | Path, state_dict: dict[str, Any] | None = None) -> None:
        """A transformers folder (config.json and model.safetensors) the engine or a transformers
        policy loads; a tied `lm_head.weight` is left out, as transformers itself saves it.
        `state_dict`: the transformers state to write (a group's, gathered), else `hf_state_dict()`."""
        from pathlib import Path

        from safetensors.torch import save_file

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(path)
        state = dict(state_dict) if state_dict is not None else self.hf_state_dict()
        if self.tied:
            state.pop("lm_head.weight")
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def from_transformers(hf_lm: PreTrainedModel) -> MegatronCausalLM:
    """A `MegatronCausalLM` holding exactly the weights of the transformers causal LM `hf_lm` (this
    rank's slice of them in a trainer group: `init_trainer_parallel`; `created_group`: whether this
    made the process group, what `release_model_parallel` may destroy)."""
    from hpref.models.megatron.backbone import require_megatron

    require_megatron()
    created, tp_size = init_trainer_parallel()
    lm = MegatronCausalLM(hf_lm.config, tp_size=tp_size)
    lm.load_hf_state(hf_lm.state_dict())
    lm.created_group = created
    return lm
