"""The causal LM the rl trainer trains on megatron-core (issue #15: `trainer_backend = "megatron"` in
a policy's table; `hpref.rl.backends.MegatronBackend` builds it, the trainer sees the backend only).

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

One process, tensor-parallel size 1: megatron's parallel state is set up on a one-rank gloo group
(`init_single_process_parallel`, which creates it when the actor has no process group);
`release_model_parallel` destroys what this module created (`TrainerActor.close`).

Refused in one line each: LoRA (PEFT wraps transformers linears, not megatron's fused ones) and
trainer_tensor_parallel > 1 when the recipe is read (`PolicyConfig`); an architecture megatron does
not map (`hpref.models.megatron.convert.shape_of`) and megatron-core missing before any actor starts
(`MegatronBackend.check`).
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


def init_single_process_parallel() -> bool:
    """megatron's parallel state at tensor-parallel size 1 (a one-rank gloo group on an in-memory
    store when the process has none). Returns whether this call created the process group."""
    import torch.distributed as dist

    from hpref.models.megatron.preference import init_model_parallel

    created = not dist.is_initialized()
    init_model_parallel(1)
    return created


def release_model_parallel(created_group: bool) -> None:
    """Undo `init_single_process_parallel`: megatron's groups, and the process group if it made it
    (after this, megatron models built on them must not run again)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if created_group and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# weight conversion


def hf_causal_to_megatron(hf_state: dict[str, Any], shape: Any, *, tied: bool) -> dict[str, Any]:
    """A transformers causal LM's state dict -> `MegatronCausalLM`'s (tensor-parallel size 1)."""
    from hpref.models.megatron.convert import hf_to_megatron

    out = hf_to_megatron(hf_state, shape)
    out[FINAL_NORM] = out.pop("norm.weight")
    if not tied:
        out[OUTPUT_LAYER] = hf_state["lm_head.weight"]
    return out


def megatron_causal_to_hf(state: dict[str, Any], shape: Any, *, tied: bool) -> dict[str, Any]:
    """`MegatronCausalLM`'s state dict -> the transformers causal LM's keys and shapes (`model.*`
    and `lm_head.weight`, which is a copy of the embedding when the two are tied)."""
    from hpref.models.megatron.convert import megatron_to_hf

    backbone = {k: v for k, v in state.items() if not k.endswith("_extra_state") and k != OUTPUT_LAYER}
    backbone["norm.weight"] = backbone.pop(FINAL_NORM)
    hf = {f"model.{k}": v for k, v in megatron_to_hf([backbone], shape).items()}
    head = hf["model.embed_tokens.weight"] if tied else state[OUTPUT_LAYER][: shape.vocab_size]
    hf["lm_head.weight"] = head.clone().contiguous()
    return hf


# --------------------------------------------------------------------------------------------------
# the model


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, L, V]


class MegatronCausalLM(nn.Module):
    """A megatron-core `GPTModel` with its output layer, called like a transformers causal LM on a
    right-padded batch (see the module docstring)."""

    def __init__(self, hf_config: PretrainedConfig):
        super().__init__()
        from hpref.models.megatron.backbone import cpu_rotary, transformer_config, varlen_layer_spec
        from hpref.models.megatron.convert import shape_of

        spec = varlen_layer_spec()  # first: it imports megatron's gpt package with its notes silenced
        from megatron.core.models.gpt import GPTModel

        self.config = hf_config
        self.created_group = False
        self.shape = shape_of(hf_config)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.gpt = GPTModel(
            config=transformer_config(self.shape),
            transformer_layer_spec=spec,
            vocab_size=self.shape.vocab_size,
            max_sequence_length=self.shape.max_position_embeddings,
            pre_process=True,
            post_process=True,
            share_embeddings_and_output_weights=self.tied,
            position_embedding_type="rope",
            rotary_base=self.shape.rope_theta,
        )
        cpu_rotary(self.gpt, even_with_cuda=True)  # an rl trainer's weights stay on the CPU

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any
    ) -> CausalLMOutput:
        """Logits `[B, L, V]` of a right-padded batch (zeros at padding positions)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        from hpref.models.attention import CONTEXT_KWARG, VarlenContext

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
        ours = hf_causal_to_megatron(hf_state, self.shape, tied=self.tied)
        missing, unexpected = self.load_state_dict(ours, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(
                f"megatron conversion left keys out: missing {missing[:4]}, unexpected {unexpected[:4]}"
            )

    def hf_state_dict(self) -> dict[str, Any]:
        """This model's weights as the transformers causal LM's state dict (detached CPU copies)."""
        state = {k: v.detach() for k, v in self.state_dict().items() if not k.endswith("_extra_state")}
        return {
            k: v.detach().cpu().clone()
            for k, v in megatron_causal_to_hf(state, self.shape, tied=self.tied).items()
        }

    def save_pretrained(self, folder: str | Path) -> None:
        """A transformers folder (config.json and model.safetensors) the engine or a transformers
        policy loads; a tied `lm_head.weight` is left out, as transformers itself saves it."""
        from pathlib import Path

        from safetensors.torch import save_file

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(path)
        state = self.hf_state_dict()
        if self.tied:
            state.pop("lm_head.weight")
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def from_transformers(hf_lm: PreTrainedModel) -> MegatronCausalLM:
    """A `MegatronCausalLM` holding exactly the weights of the transformers causal LM `hf_lm`, on
    megatron's single-process parallel state (`created_group`: whether this made the process group,
    what `release_model_parallel` may destroy)."""
    from hpref.models.megatron.backbone import require_megatron

    require_megatron()
    created = init_single_process_parallel()
    lm = MegatronCausalLM(hf_lm.config)
    lm.load_hf_state(hf_lm.state_dict())
    lm.created_group = created
    return lm
