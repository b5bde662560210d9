"""The rl trainer's backends, behind one Protocol (`hpref.rl.protocols.TrainerBackend`).

`transformers` trains the policy's transformers causal LM itself; `megatron` trains a megatron-core
GPTModel holding the same weights (`hpref.models.megatron.causal_lm`, the megatron family's causal
LM), converted back to the transformers layout for every sync and save, always in fp32, with a
parallel state that `close` releases; in a group its ranks are tensor parallel (`ranks` =
`trainer_tensor_parallel`), each holding a slice of the weights and running the whole rollout.
The trainer (`hpref.rl.trainer.actor`), the launcher's checks and teardown (`hpref.rl.launch`) and
`hpref recipes check` (`hpref.rl.control.preflight`) ask `trainer_backend(name)`; none of them, nor a
backend, branches on the name.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from hpref.hookspecs import hookimpl
from hpref.rl.protocols import TrainerBackend

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from hpref.models.megatron.causal_lm import MegatronCausalLM
    from hpref.recipe.rl import PolicyModelConfig, RLConfig


class TransformersBackend:
    name = "transformers"
    holds_process_state = False

    def check(self, config: RLConfig, policies: list[str], where: str) -> None:
        return None  # `check_policy_models` checks every policy's causal LM

    def build(self, model: PolicyModelConfig) -> tuple[nn.Module, PreTrainedTokenizerBase]:
        from hpref.models.causal_lm import build_policy_model

        return build_policy_model(model)

    def frozen_copy(self, model: nn.Module, settings: PolicyModelConfig) -> nn.Module:
        return copy.deepcopy(model)

    def compute_dtype(self, precision: str, model: nn.Module) -> torch.dtype:
        from hpref.models.precision import ProbeShape, resolve_precision

        device = next(model.parameters()).device  # CUDA where Ray gave the rank a GPU
        return resolve_precision(precision, device, ProbeShape.of(getattr(model, "config", None)))

    def plain_items(self, model: nn.Module, lora: bool) -> Iterator[tuple[str, torch.Tensor]]:
        from hpref.rl.trainer.sharding import plain_items

        return plain_items(model, lora)

    def data_split(self, rank: int, world_size: int) -> tuple[int, int]:
        return rank, world_size  # FSDP2: every rank is a data-parallel rank

    def shard(self, model: nn.Module, device: torch.device, reshard_after_forward: bool = True) -> nn.Module:
        from hpref.rl.trainer.sharding import shard_policy

        return shard_policy(model, device, reshard_after_forward)

    def load_plain_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        model.load_state_dict(state, strict=True)

    def clip_grad_norm(self, model: nn.Module, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        import torch

        return torch.nn.utils.clip_grad_norm_(params, max_norm)  # FSDP2's DTensors: the group's norm

    def gathered_state(
        self, model: nn.Module, lora: Any, optimizer: torch.optim.Optimizer, grouped: bool
    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        from hpref.rl.trainer.sharding import full, full_optimizer_state

        if not grouped:
            return None, optimizer.state_dict()
        if lora is not None:  # PEFT's own names (adapter name included), whole
            weights = {k: full(v) for k, v in lora.state_dict().items() if "lora_" in k}
        else:
            weights = {k: full(v) for k, v in model.state_dict().items()}
        return weights, full_optimizer_state(optimizer)

    def sliced_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], grouped: bool
    ) -> dict[str, Any]:
        from hpref.rl.trainer.sharding import shard_optimizer_state

        return shard_optimizer_state(optimizer, state) if grouped else state

    def close(self, model: nn.Module) -> None:
        return None


class MegatronBackend:
    """The megatron family's causal LM (`hpref.models.megatron.causal_lm.MegatronCausalLM`)."""

    name = "megatron"
    holds_process_state = True  # megatron's parallel state and the one-rank process group made for it

    def check(self, config: RLConfig, policies: list[str], where: str) -> None:
        """A `RecipeError` of one line when a megatron trainer cannot be built for one of `policies`
        (megatron-core missing, an architecture it does not map, a `trainer_tensor_parallel` that
        does not divide the heads, key/value heads and MLP width). LoRA and a
        `trainer_tensor_parallel` other than `ranks` are refused by `PolicyConfig` itself, when the
        recipe is read."""
        from hpref.errors import RecipeError, UserError
        from hpref.models.megatron.backbone import require_megatron
        from hpref.models.megatron.convert import shape_of
        from hpref.rl.policy import policy_skeleton

        for p in policies:
            try:
                require_megatron()
                shape = shape_of(policy_skeleton(config.policies[p].model).config)
            except UserError as exc:
                raise RecipeError(f"{where}: rl.policies.{p}.trainer_backend: {exc}") from None
            except (OSError, ValueError) as exc:
                raise RecipeError(
                    f"{where}: rl.policies.{p}.model.path: no causal LM config there "
                    f"({str(exc).splitlines()[0]})"
                ) from None
            tp = config.policies[p].trainer_tensor_parallel
            sizes = (shape.num_heads, shape.num_kv_heads, shape.ffn_hidden_size)
            if any(n % tp for n in sizes):
                raise RecipeError(
                    f"{where}: rl.policies.{p}.trainer_tensor_parallel = {tp} must divide the model's "
                    f"attention heads ({sizes[0]}), key/value heads ({sizes[1]}) and MLP width "
                    f"({sizes[2]}): megatron splits whole query groups and MLP columns over the ranks"
                )

    def build(self, model: PolicyModelConfig) -> tuple[MegatronCausalLM, PreTrainedTokenizerBase]:
        """(megatron causal LM, tokenizer) holding exactly the weights `build_policy_model` gives the
        engine (that model is built first and converted; its memory is freed before this returns)."""
        from hpref.models.causal_lm import build_policy_model
        from hpref.models.megatron.backbone import require_megatron
        from hpref.models.megatron.causal_lm import from_transformers

        require_megatron()
        hf_lm, tokenizer = build_policy_model(model)
        return from_transformers(hf_lm), tokenizer

    def frozen_copy(self, model: MegatronCausalLM, settings: PolicyModelConfig) -> MegatronCausalLM:
        # built again: its modules hold process groups deepcopy cannot copy
        return self.build(settings)[0]

    def compute_dtype(self, precision: str, model: MegatronCausalLM) -> torch.dtype:
        import torch

        return torch.float32  # the megatron trainer always computes in fp32

    def plain_items(self, model: MegatronCausalLM, lora: bool) -> Iterator[tuple[str, torch.Tensor]]:
        # un-fused back to the transformers layout the engine loads (no LoRA); tensor parallel: the
        # slices gathered on rank 0, the rank that sends (the others join the gathers, yield nothing)
        return iter(model.hf_state_dict().items())

    def data_split(self, rank: int, world_size: int) -> tuple[int, int]:
        # tensor parallel (`PolicyConfig`: ranks = trainer_tensor_parallel): every rank runs the
        # whole rollout, on its slices of the weights; no data parallelism, no gradient averaging
        return 0, 1

    def shard(
        self, model: MegatronCausalLM, device: torch.device, reshard_after_forward: bool = True
    ) -> None:
        import torch.distributed as dist

        # built tensor parallel over the group's process group already (`init_trainer_parallel`)
        if model.tp_size != dist.get_world_size():
            raise RuntimeError(
                f"megatron model built at tensor parallel {model.tp_size}, group of {dist.get_world_size()}"
            )
        return None

    def load_plain_state(self, model: MegatronCausalLM, state: dict[str, Any]) -> None:
        model.load_hf_state(state)  # this rank's slices

    def clip_grad_norm(
        self, model: MegatronCausalLM, params: list[torch.Tensor], max_norm: float
    ) -> torch.Tensor:
        return model.clip_grad_norm(params, max_norm)

    def gathered_state(
        self, model: MegatronCausalLM, lora: Any, optimizer: torch.optim.Optimizer, grouped: bool
    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        # a group's save is a one-rank trainer's: transformers weights, moments in the one-rank layout
        if not grouped:
            return None, optimizer.state_dict()
        return model.hf_state_dict(), model.one_rank_optimizer_state(optimizer)

    def sliced_optimizer_state(
        self, model: MegatronCausalLM, optimizer: torch.optim.Optimizer, state: dict[str, Any], grouped: bool
    ) -> dict[str, Any]:
        return model.sliced_optimizer_state(optimizer, state)

    def close(self, model: MegatronCausalLM) -> None:
        from hpref.models.megatron.causal_lm import release_model_parallel

        release_model_parallel(model.created_group)


class BackendConfig(BaseModel):
    """A built-in backend takes no parameters: a policy's own keys (ranks, precision, ...) set it up."""

    model_config = ConfigDict(extra="forbid")


@hookimpl
def register_trainer_backends(register):
    register(
        name="transformers",
        config=BackendConfig,
        build=lambda config: TransformersBackend(),
        description="the policy's transformers causal LM, FSDP2 over a group's ranks",
    )
    register(
        name="megatron",
        config=BackendConfig,
        build=lambda config: MegatronBackend(),
        description="a megatron-core GPTModel holding the same weights, tensor parallel over a group",
    )


def trainer_backend(name: str) -> TrainerBackend:
    """The registered backend a policy's `trainer_backend` names (checked when the recipe is read)."""
    from hpref.plugins import load_plugins

    component = load_plugins().get("trainer_backend", name)
    return component.build(component.config())


def check_backends(config: RLConfig, policies: list[str], where: str) -> None:
    """Every backend's check for the policies on it, before any actor starts."""
    for name in sorted({config.policies[p].trainer_backend for p in policies}):
        on_it = [p for p in policies if config.policies[p].trainer_backend == name]
        trainer_backend(name).check(config, on_it, where)
