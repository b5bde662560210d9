"""`hpref save`: a training checkpoint -> a self-contained HF-style folder (or, with `--now`, a
checkpoint asked of a live run first).

command        the `save` command body (plain arguments in, exit code out)
export         the export: the checkpoint loaded through `hpref.runtime.checkpoint` (safe loading
               only), written as `PreferenceModel.save_pretrained`'s folder (or PEFT's adapter folder
               and the head) with a model card, swapped into place whole
policy_export  a causal-LM policy's folder (merged, or PEFT's adapter): offline DPO's, and its writer
rl_export      one policy of an `hpref rl` run at one of its global saves (`--policy`), through it
target, card   where an export may go and how it replaces a folder; the model cards' closing sections

The `save --now` trigger is the run folder's (`hpref.runfolder.save_trigger`), shared with the
trainer and the rl leader. Importing this package is cheap: torch is imported inside functions.
"""
