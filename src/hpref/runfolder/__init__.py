"""The run folder's owner: how hpref writes, verifies, finds and reads back the files it keeps.

This is the layer under train, eval, save and rl (it imports nothing of theirs):

- `layout`: the names hpref writes in a run folder, and the checks that keep runs from being lost.
- `start`: what a run writes when it starts (the resolved recipe, the log file), and the check of
  the folder before a fresh training run.
- `files`: every file hpref owns is written atomically (temporary file, fsync, rename, fsync of the
  folder), and whole folders are fsynced before a pointer moves to them.
- `heartbeat`: how a live run says it is alive, and how `save --now` / `--overwrite` tell.
- `save_trigger`: `hpref save --now`'s request file, and the wait for the save it asked for.
- `checkpoints`: finding the saves of a run (train `step-*`, rl `rollout-*`), resolving the one a
  user means, validating one before a tensor is read.
- `record`: an rl run's `record.json`, the commit point of its global saves.
- `safe_load`: the one reader of files that other people may hand us (DCP checkpoints, trainer
  state): exact, named classes only, never arbitrary pickle.
- `integrity`: a checksum of every file in a checkpoint, written at save time and verified before
  a checkpoint is trusted.
"""
