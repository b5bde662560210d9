"""Built-in optimizer: `adamw`, AdamW with a separate head learning rate and no decay on biases and
norms. `build(config, model)` returns a `torch.optim.Optimizer` over the model's trainable parameters
(with LoRA, the adapters, the head and whatever else `requires_grad`), after sharding, so the
parameters it holds are FSDP2's DTensor shards.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hpref.hookspecs import hookimpl
from hpref.protocols import Optimizer, PreferenceModel


class AdamWConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-4, gt=0, description="base learning rate")
    head_lr: float | None = Field(None, gt=0, description="learning rate of the new head (default: lr)")
    weight_decay: float = Field(0.01, ge=0, description="decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon")


def param_groups(
    model: PreferenceModel, *, lr: float, head_lr: float | None, weight_decay: float
) -> list[dict[str, Any]]:
    """Up to four groups of the trainable parameters: {backbone, head (`head_lr`)} x {decayed
    matrices, undecayed biases and norms}. A plugin optimizer can reuse it for the same grouping."""
    groups: dict[tuple[bool, bool], list[Any]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups.setdefault((name.startswith("head."), param.ndim >= 2), []).append(param)
    return [
        {
            "params": params,
            "lr": (head_lr or lr) if is_head else lr,
            "weight_decay": weight_decay if decayed else 0.0,
        }
        for (is_head, decayed), params in sorted(groups.items())
    ]


def build_adamw(config: AdamWConfig, model: PreferenceModel) -> Optimizer:
    """AdamW, fused where torch has a kernel for the device, else foreach.

    The fused kernel exists for CUDA, and for CPU since torch 2.4: on the 2-core box 3.1 ms a step
    against 8.7 ms foreach and 18 ms per-tensor, for 0.9M FSDP2 parameters."""
    import torch
    from loguru import logger

    groups = param_groups(model, lr=config.lr, head_lr=config.head_lr, weight_decay=config.weight_decay)
    kwargs = dict(lr=config.lr, betas=tuple(config.betas), eps=config.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError) as exc:  # no fused kernel for this device / dtype
        logger.info(f"fused AdamW unavailable ({exc}); using foreach")
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


@hookimpl
def register_optimizers(register):
    register(name="adamw", config=AdamWConfig, build=build_adamw)
