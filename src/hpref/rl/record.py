"""The checkpoint record of a multi-policy run, and the checks a resume must pass.

A global save writes each trainer's state and the rollout executor's, then — only once every part
has saved — `record.json`: who led and where each policy stood. The record is the commit point: a
save that died half way leaves the previous record in place, so a resume never mixes parts of two
saves. On resume every restored part reports its position and `check_resume` compares them with the
record; any mismatch is an error naming the policy, because silently training on from inconsistent
positions would replay or skip rollouts without anyone noticing.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpref.errors import UserError

RECORD_FILE = "record.json"
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
    path = folder / RECORD_FILE
    if not path.is_file():
        return None
    return CheckpointRecord.from_json(path.read_text(encoding="utf-8"), str(path))


def check_record_leader(record: CheckpointRecord, leader: str, policies: list[str]) -> None:
    """The checks a record allows before anything is built: the same leader, every policy in it.

    Run first so a wrong `--policies` fails in a second, not after every actor has started;
    `check_resume` repeats them with the positions the parts actually restored.
    """
    if record.leader != leader:
        raise ResumeError(
            f"the checkpoint record was written with leader '{record.leader}', not '{leader}': "
            f"pass --policies with '{record.leader}' first"
        )
    for policy in policies:
        if policy not in record.rollout_ids:
            raise ResumeError(
                f"policy '{policy}' is not in the checkpoint record (it has {sorted(record.rollout_ids)})"
            )


def check_resume(
    record: CheckpointRecord | None,
    leader: str,
    restored: Mapping[str, int],
    executor_positions: Mapping[str, int] | None = None,
) -> None:
    """Raise `ResumeError` unless the restored parts can continue one consistent run.

    `restored` maps each selected policy to the start rollout id its trainer restored (0 = fresh);
    `executor_positions` is the rollout executor's restored data position per policy, when it had
    one. The rules:
    - a fresh leader (start 0) requires fresh followers, else the followers would carry on from a
      run whose leader is gone;
    - a resumed leader needs a record; and whenever a record is resumed from, it must name the same
      leader and hold every selected policy at the very rollout id its trainer (and the executor)
      restored — including a leader whose part went missing and restored nothing.
    """
    if leader not in restored:
        raise ResumeError(f"the leader '{leader}' is not among the restored policies {sorted(restored)}")
    if restored[leader] == 0:
        stale = sorted(p for p, start in restored.items() if start != 0)
        if stale:
            first = stale[0]
            raise ResumeError(
                f"policy '{first}' resumes at rollout {restored[first]} but the leader '{leader}' starts "
                "fresh: start every policy fresh, or resume the leader too"
            )
        if record is None:
            return  # a fresh run
    if record is None:
        raise ResumeError(
            f"the leader '{leader}' resumes at rollout {restored[leader]} but there is no {RECORD_FILE}: "
            "no global save completed, so the parts cannot be trusted to match"
        )
    check_record_leader(record, leader, sorted(restored))
    for policy in sorted(restored):
        start = restored[policy]
        expected = record.rollout_ids[policy]
        if start != expected:
            raise ResumeError(
                f"policy '{policy}' restored rollout {start} but the checkpoint record says {expected}"
            )
        if executor_positions is not None and executor_positions.get(policy, 0) != expected:
            raise ResumeError(
                f"policy '{policy}': the rollout executor restored data position "
                f"{executor_positions.get(policy, 0)} but the checkpoint record says {expected}"
            )
