"""The run folder's owner: how hpref writes, verifies and reads back the files it keeps.

This is the layer under train, eval, save and rl (it imports nothing of theirs):

- `files`: every file hpref owns is written atomically (temporary file, fsync, rename, fsync of the
  folder), and whole folders are fsynced before a pointer moves to them.
- `safe_load`: the one reader of files that other people may hand us (DCP checkpoints, trainer
  state): exact, named classes only, never arbitrary pickle.
- `integrity`: a checksum of every file in a checkpoint, written at save time and verified before
  a checkpoint is trusted.
"""
