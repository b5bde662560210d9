"""Training preference models: `hpref train` and `hpref init`.

launch      validate the recipe, run one process in-process or N through torchrun (`run_train`,
            `run_init`)
worker      one rank: process group, logging, components, data, then the loop
sharding    activation checkpointing -> FSDP2 per block and root -> weights loaded after sharding
loop        optimizer and scheduler builders, the train step, evaluation, `fit`
checkpoint  DCP checkpoints written to a temporary folder and renamed when complete; resume
metrics     tokens/s, MFU against a stated peak, memory, metrics.jsonl, the summary table
data        battles -> tokenized examples (both A/B views for training)

Importing this package is cheap; torch is imported by the submodules.
"""

from __future__ import annotations

__all__ = ["run_init", "run_train"]


def __getattr__(name: str):
    if name in __all__:
        from hpref.train import launch

        return getattr(launch, name)
    raise AttributeError(name)
