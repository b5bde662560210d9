"""Evaluation and export: what happens to a trained preference model after `hpref train`.

cli          the `eval` / `save` command bodies (plain arguments in, exit code out)
launch       a multi-process `hpref eval`: N `worker` ranks through torchrun, as training starts
worker       one eval rank: `run_eval` under a process group
runner       `run_eval`: model folder / checkpoint + battles -> `hpref.prediction.predict` ->
             prediction file, soft labels, metrics; or an ensemble of prediction files
ensemble     blending prediction files (ids checked), fitting blend weights on labelled data, and
             soft-label files for distillation that the `arena` reader accepts
plots        the reliability diagram PNG (matplotlib, optional)
export       `hpref save`: a DCP checkpoint -> a self-contained HF-style folder (safe loading only),
             and the `save --now` trigger protocol shared with the trainer

Predicting, scoring and prediction files are `hpref.prediction`'s (shared with the trainer's eval).
Importing this package is cheap: torch is imported only by `export` and inside functions.
"""
