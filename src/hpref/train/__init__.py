"""Training preference models: `hpref train` and `hpref init`.

launch      validate the recipe, run one process in-process or N through torchrun (`run_train`,
            `run_init`)
worker      one rank: process group, logging, the recipe's parts (`hpref.components`), data, the loop
sharding    the compute precision, and the weights loaded after sharding (`hpref.models.parallelize`)
loop        the train step, the in-training eval (`hpref.prediction`), `fit`
summary     what a finished run reports: summary.json and the table, with the cheap baselines
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
