"""The rl trainer's backends, behind one Protocol (`hpref.rl.protocols.TrainerBackend`).

`transformers` trains the policy's transformers causal LM itself; `megatron` trains a megatron-core
GPTModel holding the same weights (`hpref.rl.megatron_policy`), converted back to the transformers
layout for every sync and save, always in fp32, with a parallel state that `close` releases. The
trainer (`hpref.rl.trainer`), the launcher's checks and teardown (`hpref.rl.launch`) and `hpref
recipes check` (`hpref.rl.checks`) ask `trainer_backend(name)`; none of them branches on the name.
"""

from __future__ import annotations

import copy
from typing import Any

from hpref.rl.protocols import TrainerBackend


class TransformersBackend:
    name = "transformers"
    holds_process_state = False

    def check(self, config: Any, policies: list[str], where: str) -> None:
        return None  # `check_policy_models` checks every policy's causal LM

    def build(self, model: Any) -> tuple[Any, Any]:
        from hpref.rl.policy import build_policy_model

        return build_policy_model(model)

    def frozen_copy(self, model: Any, settings: Any) -> Any:
        return copy.deepcopy(model)

    def compute_dtype(self, precision: str, model: Any) -> Any:
        import torch

        from hpref.models.precision import resolve_precision

        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        return resolve_precision(precision, torch.device("cpu"), hidden)

    def plain_state(self, model: Any) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def load_plain_state(self, model: Any, state: dict[str, Any]) -> None:
        model.load_state_dict(state, strict=True)

    def close(self, model: Any) -> None:
        return None


class MegatronBackend:
    name = "megatron"
    holds_process_state = True  # megatron's parallel state and the one-rank process group made for it

    def check(self, config: Any, policies: list[str], where: str) -> None:
        from hpref.rl.megatron_policy import check_megatron_policies

        check_megatron_policies(config, policies, where)

    def build(self, model: Any) -> tuple[Any, Any]:
        from hpref.rl.megatron_policy import build_megatron_policy

        return build_megatron_policy(model)

    def frozen_copy(self, model: Any, settings: Any) -> Any:
        # built again: its modules hold process groups deepcopy cannot copy
        return self.build(settings)[0]

    def compute_dtype(self, precision: str, model: Any) -> Any:
        import torch

        return torch.float32  # the megatron trainer always computes in fp32

    def plain_state(self, model: Any) -> dict[str, Any]:
        return model.hf_state_dict()  # un-fused back to the transformers layout the engine loads

    def load_plain_state(self, model: Any, state: dict[str, Any]) -> None:
        model.load_hf_state(state)

    def close(self, model: Any) -> None:
        from hpref.rl.megatron_policy import release_model_parallel

        release_model_parallel(model.created_group)


BACKENDS: dict[str, TrainerBackend] = {"transformers": TransformersBackend(), "megatron": MegatronBackend()}


def trainer_backend(name: str) -> TrainerBackend:
    """The backend a policy's `trainer_backend` names (the recipe allows only these)."""
    return BACKENDS[name]


def check_backends(config: Any, policies: list[str], where: str) -> None:
    """Every backend's check for the policies on it, before any actor starts."""
    for name in sorted({config.policies[p].trainer_backend for p in policies}):
        on_it = [p for p in policies if config.policies[p].trainer_backend == name]
        trainer_backend(name).check(config, on_it, where)
