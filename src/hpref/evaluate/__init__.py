"""Evaluation: `hpref eval`, the predictions and metrics of a trained preference model.

command      the `eval` command body (plain arguments in, exit code out)
launch       a multi-process `hpref eval`: N `worker` ranks through torchrun, as training starts
worker       one eval rank: `run_eval` under a process group
runner       `run_eval`: model folder / checkpoint + battles -> `hpref.prediction.predict` ->
             prediction file, soft labels, metrics; or an ensemble of prediction files
ensemble     blending prediction files (ids checked), fitting blend weights on labelled data, and
             soft-label files for distillation that the `arena` reader accepts
plots        the reliability diagram PNG (matplotlib, optional)
adapter_export  loading a LoRA export (PEFT's adapter folder and hpref's head) for `hpref eval`

Predicting, scoring and prediction files are `hpref.prediction`'s (shared with the trainer's eval);
the checkpoint -> model loader is `hpref.runtime.checkpoint`'s (shared with `hpref save`), and so are
torchrun and the process group. Importing this package is cheap: torch is imported inside functions.
"""
