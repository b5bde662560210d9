"""Everything between a user's file and the tensors a rank trains on.

records   the one internal `Battle` record every reader produces
readers   `arena` (Chatbot-Arena / Kaggle LMSYS schema) and `pairwise` (chosen/rejected) readers
splits    k-fold selection grouped by prompt and stratified by label
formatting judge-prompt formatters (`pab`, `papb`) with token-budget truncation
cache     tokenize once, keyed by data + tokenizer + formatter
packing   padding-free packed micro-batches and the per-step, per-rank plan

Importing this package is cheap: torch and transformers are imported only by `packing` and inside the
functions that need them.
"""

from hpref.data.records import LABELS, Battle, Probs

__all__ = ["LABELS", "Battle", "Probs"]
