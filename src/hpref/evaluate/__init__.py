"""Evaluation and export: what happens to a trained preference model after `hpref train`.

metrics      log loss, accuracy, per-class calibration (ECE), confusion matrix, Bayes floor and gap
             closed (synthetic data); `metrics.json` and the printed table (numpy only)
plots        the reliability diagram PNG (matplotlib, optional)
predictions  Kaggle submission files (`id, winner_model_a, winner_model_b, winner_tie`) written as
             CSV / Parquet / JSONL and read back with strict checks
ensemble     blending prediction files (ids checked), fitting blend weights on labelled data, and
             soft-label files for distillation that the `arena` reader accepts
tta          swap test-time augmentation: score A/B and B/A, map the swap back, average
runner       inference: model folder or checkpoint + battles -> probabilities per battle id
export       `hpref save`: a DCP checkpoint -> a self-contained HF-style folder (safe loading only),
             and the `save --now` trigger protocol shared with the trainer
cli          the `eval` / `save` command bodies (plain arguments in, exit code out)

Importing this package is cheap: torch is imported only by `runner`, `export` and inside functions.
"""
