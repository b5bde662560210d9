"""Training preference models: `hpref train` and `hpref init`.

command     `hpref train` from the command line: the run folder checks, then the launcher
checks      what `hpref train` refuses in a recipe, before any process starts
launch      plan the launch, run one process in-process or N through torchrun (`run_train`,
            `run_init`; torchrun itself: `hpref.runtime.torchrun`)
worker      one rank: logging, the recipe's parts (`hpref.components`), data, the loop (its process
            group: `hpref.runtime.distributed`)
sharding    the compute precision, and the weights loaded after sharding (`hpref.models.parallelize`)
loop        the train step, the in-training eval (`hpref.prediction`), `fit`: start_run ->
            train_epoch ... -> end_run -> save_summary
progress    the run's totals, the interval since the last log line, the progress bar
resume      the whole run state saved after a step and restored on resume (files: `checkpoint`)
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
