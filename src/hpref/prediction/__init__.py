"""Predictions: computing them, scoring them, storing them. One of each, shared by every caller.

predict   a model + tokenized views -> probabilities per battle row: the eval planner's packed
          micro-batches, this rank's share scored, all_gather over ranks, swapped views mapped back
          and averaged (torch). Used by the train loop's eval, `hpref eval` (with or without swap
          TTA) and anything else that scores a model.
metrics   log loss, accuracy, per-class calibration (ECE), confusion matrix, Bayes floor and gap
          closed; `metrics.json` and the printed table (numpy only). The one log loss of hpref:
          training eval, `hpref eval`, ensembles, the cheap baselines and the synthetic arena's
          report all call it.
evaluation `evaluate_battles`: battles (tokenized or encoded here) -> predict -> log loss and
          accuracy when labelled -> prediction files (rank 0). The one eval that the train loop
          and `hpref eval` both call.
files     prediction files (`id, winner_model_a, winner_model_b, winner_tie`) written as CSV /
          Parquet / JSONL and read back with strict checks.
baselines the cheap baselines (the label prior, the style and length features' logistic fits) that a
          run's summary and the synthetic arena's report score beside the model.

It sits above `hpref.data` (it imports data and the core modules) and below the synthetic arena and
the models; it never imports the command packages (`train`, `evaluate`, `rl`) or the plugin layer.
Importing the package is cheap; only `predict` imports torch.
"""
