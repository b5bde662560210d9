"""The resume checks of a multi-policy run, against its checkpoint record.

The record itself (`record.json`, written after every part of a global save, the save's commit
point) is part of the run folder: `hpref.runfolder.record`. On resume every restored part reports
its position and `check_resume` compares them with the record; any mismatch is an error naming the
policy, because silently training on from inconsistent positions would replay or skip rollouts
without anyone noticing.
"""

from __future__ import annotations

from collections.abc import Mapping

from hpref.runfolder.record import (
    RECORD_FILE,
    RECORD_FORMAT,
    CheckpointRecord,
    ResumeError,
    read_record,
    write_record,
)

# The record's names, for the rl code and tests that read a record beside these checks.
__all__ = [
    "RECORD_FILE",
    "RECORD_FORMAT",
    "CheckpointRecord",
    "ResumeError",
    "check_record_leader",
    "check_resume",
    "read_record",
    "write_record",
]


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
