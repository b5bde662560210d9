"""Where `hpref save` writes: `--to` checked (new, empty, or an earlier export with `--overwrite`; never
overlapping the run it exports), and the finished folder renamed into place, so a folder named `--to`
is always a complete export. Shared by the preference-model and the DPO-policy exports.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpref.errors import UserError
from hpref.exports.layout import CHECKPOINT_JSON


def check_export_target(to: Path, overwrite: bool) -> None:
    """`--to` must be a new or empty folder, or (with `overwrite`) an earlier hpref export: never a
    file, and never a folder holding anything else, which `--overwrite` would have deleted."""
    from hpref.runfolder.layout import check_folder_path

    check_folder_path(to, "--to")
    if not to.is_dir() or not any(to.iterdir()):
        return
    if not (to / CHECKPOINT_JSON).is_file():
        raise UserError(
            f"--to {to}: exists and is not empty, and is not an hpref export (no {CHECKPOINT_JSON}); "
            "refusing to replace it, even with --overwrite: name a new or empty folder"
        )
    if not overwrite:
        raise UserError(
            f"--to {to}: exists and is not empty (an hpref export; pass --overwrite to replace it)"
        )


def check_export_overlap(to: Path, checkpoint_dir: Path) -> None:
    """The export must not be, contain, or sit inside what it is exported from: `--to RUN
    --overwrite` once deleted the whole run. A new folder of the user's choosing inside the run
    folder (`RUN/export`) is fine; the run's own entries (`checkpoints/`, `logs/`, ...) are not."""
    from hpref.runfolder.layout import CHECKPOINTS, owner_of

    target = to.resolve()
    checkpoint = checkpoint_dir.resolve()
    source = checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else checkpoint
    for folder, what in ((source, "the run folder being exported"), (checkpoint, "the checkpoint")):
        if target == folder or target in folder.parents:
            raise UserError(f"--to {to}: is or contains {what} ({folder}); name a folder outside it")
    if checkpoint in target.parents:
        raise UserError(f"--to {to}: lies inside the checkpoint {checkpoint}; name a folder outside it")
    reason = owner_of(target)
    if reason is not None:
        raise UserError(f"--to {to}: {reason}; name a folder outside it")


def replace_folder(tmp: Path, to: Path, overwrite: bool) -> None:
    """Move the finished `tmp` to `to`. An existing `to` (empty, or an export) is first moved aside
    and deleted only once the new folder is in place, so `to` is always a complete export."""
    import uuid

    from hpref.runfolder.files import fsync_dir

    check_export_target(to, overwrite)  # again: the folder may have changed while the model loaded
    old = None
    if to.exists() or to.is_symlink():
        old = to.with_name(f".{to.name}.{uuid.uuid4().hex[:8]}.old")
        os.rename(to, old)
    try:
        os.rename(tmp, to)
    except BaseException:
        if old is not None:
            os.rename(old, to)
        raise
    fsync_dir(to.parent)
    if old is not None:
        if old.is_symlink():  # the link goes; what it pointed to is not ours to delete
            old.unlink()
        else:
            shutil.rmtree(old)
