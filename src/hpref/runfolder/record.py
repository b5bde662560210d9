"""The checkpoint record of an `hpref rl` run: `record.json`, the commit point of a global save.

A global save writes each trainer's state and the rollout executor's, then — only once every part
has saved — `record.json`: who led, where each policy stood, and the folder holding the save. A
save that died half way leaves the previous record in place, so the record names the newest
complete save. The record is written twice, into the save's own folder first, then the run's: a
write of the run's record that fails (a full disk) would otherwise send a resume one save back.
Each record carries its save's lineage (`hpref.runfolder.lineage`: the save it continued from), and
`read_record` answers with the newest save that descends from the one the run's record names. It
lives here, beside the train checkpoints' own layout, because every reader of a run folder needs
it: rl resume (`hpref.rl.control.record` holds the resume checks) and `hpref save --now`, which waits for
the record to name a new save (`hpref.runfolder.checkpoints.complete_saves`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from hpref.errors import UserError
from hpref.runfolder import lineage
from hpref.runfolder.files import write_text_atomic
from hpref.runfolder.layout import CHECKPOINTS, RECORD_FILE, ROLLOUT_PREFIX
from hpref.runfolder.lineage import LINEAGE_KEY, Lineage

RECORD_FORMAT = 1


class ResumeError(UserError):
    """A resume that cannot continue consistently (missing record, other leader, moved positions)."""


@dataclass(frozen=True)
class CheckpointRecord:
    """Leader id and each policy's next rollout id at the last complete global save."""

    leader: str
    rollout_ids: dict[str, int]
    save_dir: str = ""  # the folder (relative to the run folder) holding this save's parts
    extra: dict[str, object] = field(default_factory=dict)
    #: the save's place in the run's timeline (`write_record` sets it); not part of what it records
    lineage: Lineage | None = field(default=None, compare=False)

    def to_json(self) -> str:
        payload = {
            "format": RECORD_FORMAT,
            "leader": self.leader,
            "rollout_ids": dict(sorted(self.rollout_ids.items())),
            "save_dir": self.save_dir,
            "extra": self.extra,
        }
        if self.lineage is not None:
            payload[LINEAGE_KEY] = self.lineage.to_json()
        return json.dumps(payload, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = RECORD_FILE) -> CheckpointRecord:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ResumeError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise ResumeError(f"{where}: not a checkpoint record of format {RECORD_FORMAT}")
        ids = data.get("rollout_ids")
        if not isinstance(data.get("leader"), str) or not isinstance(ids, dict):
            raise ResumeError(f"{where}: a record needs 'leader' and 'rollout_ids'")
        if not all(isinstance(v, int) and v >= 0 for v in ids.values()):
            raise ResumeError(f"{where}: rollout ids must be non-negative integers, got {ids}")
        return cls(
            data["leader"],
            dict(ids),
            str(data.get("save_dir", "")),
            dict(data.get("extra", {})),
            Lineage.from_json(data.get(LINEAGE_KEY)),
        )


def write_record(folder: Path, record: CheckpointRecord) -> Path:
    """Commit a global save: its record into the save's folder (when it exists), then as the run's
    `folder/record.json`, each atomically (temporary file, fsync, `os.replace`: a reader or a crash
    sees the old record or the new one). The record's lineage names the save the run's record names
    now (followed as `read_record` follows it) as its parent."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save = folder / record.save_dir if record.save_dir else None
    if record.lineage is None and save is not None:
        current = read_record(folder)
        parent = folder / current.save_dir if current is not None and current.save_dir else None
        born = lineage.child_of(save.name, parent, _save_lineage)
        record = CheckpointRecord(record.leader, record.rollout_ids, record.save_dir, record.extra, born)
    text = record.to_json()
    if save is not None and save.is_dir():
        write_text_atomic(save / RECORD_FILE, text)  # the save is whole: every part wrote before this
    return write_text_atomic(folder / RECORD_FILE, text)


def _stored(path: Path) -> CheckpointRecord | None:
    if not path.is_file():
        return None
    return CheckpointRecord.from_json(path.read_text(encoding="utf-8"), str(path))


def _save_lineage(save: Path) -> Lineage | None:
    """The lineage in a save folder's own record; None without one (a save of an older hpref, or one
    that did not finish) or with a damaged one (never followed)."""
    try:
        own = _stored(save / RECORD_FILE)
    except (ResumeError, OSError):
        return None
    return own.lineage if own is not None else None


def read_record(folder: Path) -> CheckpointRecord | None:
    """The record of the run in `folder`'s newest complete save, or None when there is none (a run
    that never completed a save): the one `record.json` names, or the newest save that continues it
    when the write of `record.json` after that save failed (`hpref.runfolder.lineage`)."""
    folder = Path(folder)
    record = _stored(folder / RECORD_FILE)
    root = folder / CHECKPOINTS
    if record is None or record.lineage is None or not record.save_dir or not root.is_dir():
        return record
    saves = sorted(
        (p for p in root.iterdir() if p.name.startswith(ROLLOUT_PREFIX) and (p / RECORD_FILE).is_file()),
        key=lambda p: p.name,
    )
    named = folder / record.save_dir
    newest = lineage.head(named, saves, _save_lineage)
    if newest == named:
        return record
    logger.warning(
        f"{folder / RECORD_FILE} names {named.name}, and {newest.name} continues it (the record's "
        f"write after that save did not finish): {newest.name} is the run's newest save"
    )
    return _stored(newest / RECORD_FILE)
