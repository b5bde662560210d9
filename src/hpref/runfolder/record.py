"""The checkpoint record of an `hpref rl` run: `record.json`, the commit point of a global save.

A global save writes each trainer's state and the rollout executor's, then — only once every part
has saved — `record.json`: who led, where each policy stood, and the folder holding the save. A
save that died half way leaves the previous record in place, so the record names the newest
complete save. It lives here, beside the train checkpoints' own layout, because every reader of a
run folder needs it: rl resume (`hpref.rl.record` holds the resume checks) and `hpref save --now`,
which waits for the record to name a new save (`hpref.runfolder.checkpoints.complete_saves`).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from hpref.errors import UserError
from hpref.runfolder.layout import RECORD_FILE

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

    def to_json(self) -> str:
        payload = {
            "format": RECORD_FORMAT,
            "leader": self.leader,
            "rollout_ids": dict(sorted(self.rollout_ids.items())),
            "save_dir": self.save_dir,
            "extra": self.extra,
        }
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
        return cls(data["leader"], dict(ids), str(data.get("save_dir", "")), dict(data.get("extra", {})))


def write_record(folder: Path, record: CheckpointRecord) -> Path:
    """Write `folder/record.json` atomically: a temporary file, fsync, then `os.replace`, so a reader
    (or a crash) sees the old record or the new one, never a torn one."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / RECORD_FILE
    tmp = folder / f".{RECORD_FILE}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(record.to_json())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    return final


def read_record(folder: Path) -> CheckpointRecord | None:
    """The record in `folder`, or None when there is none (a run that never completed a save)."""
    path = Path(folder) / RECORD_FILE
    if not path.is_file():
        return None
    return CheckpointRecord.from_json(path.read_text(encoding="utf-8"), str(path))
