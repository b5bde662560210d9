"""The checkpoint record and the resume rules: each failure names the policy at fault."""

from __future__ import annotations

import json
import os

import pytest

from hpref.rl.control.record import (
    RECORD_FILE,
    CheckpointRecord,
    ResumeError,
    check_resume,
    read_record,
    write_record,
)


def test_record_round_trips_and_is_written_atomically(tmp_path, monkeypatch):
    record = CheckpointRecord("a", {"a": 4, "b": 3}, save_dir="checkpoints/rollout-4")
    write_record(tmp_path, record)
    assert read_record(tmp_path) == record
    assert json.loads((tmp_path / RECORD_FILE).read_text())["leader"] == "a"

    # a crash before the rename leaves the previous record intact (no torn file, no temp left behind
    # under the final name)
    def fail(*_args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_record(tmp_path, CheckpointRecord("a", {"a": 8, "b": 8}))
    assert read_record(tmp_path) == record


def test_missing_record_reads_as_none_and_garbage_is_an_error(tmp_path):
    assert read_record(tmp_path) is None
    (tmp_path / RECORD_FILE).write_text("{not json")
    with pytest.raises(ResumeError, match="not valid JSON"):
        read_record(tmp_path)
    (tmp_path / RECORD_FILE).write_text(json.dumps({"format": 1, "leader": "a", "rollout_ids": {"a": -1}}))
    with pytest.raises(ResumeError, match="non-negative"):
        read_record(tmp_path)


def test_fresh_run_needs_fresh_followers():
    check_resume(None, "a", {"a": 0, "b": 0})
    with pytest.raises(ResumeError, match="policy 'b' resumes at rollout 2 but the leader 'a' starts fresh"):
        check_resume(None, "a", {"a": 0, "b": 2})


def test_a_leader_that_restored_nothing_does_not_match_its_record():
    with pytest.raises(ResumeError, match="policy 'a' restored rollout 0 but the checkpoint record says 2"):
        check_resume(CheckpointRecord("a", {"a": 2, "b": 0}), "a", {"a": 0, "b": 0})


def test_resumed_leader_needs_a_record():
    with pytest.raises(ResumeError, match="no record.json"):
        check_resume(None, "a", {"a": 2, "b": 2})


def test_record_must_name_the_same_leader():
    record = CheckpointRecord("a", {"a": 2, "b": 2})
    with pytest.raises(ResumeError, match="leader 'a', not 'b'"):
        check_resume(record, "b", {"a": 2, "b": 2})


def test_every_policy_must_match_its_recorded_position():
    record = CheckpointRecord("a", {"a": 2, "b": 3})
    check_resume(record, "a", {"a": 2, "b": 3}, {"a": 2, "b": 3})
    with pytest.raises(ResumeError, match="policy 'b' restored rollout 2 but the checkpoint record says 3"):
        check_resume(record, "a", {"a": 2, "b": 2})
    with pytest.raises(ResumeError, match="policy 'c' is not in the checkpoint record"):
        check_resume(record, "a", {"a": 2, "c": 2})
    with pytest.raises(ResumeError, match="policy 'b': the rollout executor restored data position 0"):
        check_resume(record, "a", {"a": 2, "b": 3}, {"a": 2})


def test_a_subset_of_the_recorded_policies_may_resume():
    # dropping a follower is allowed: every policy that does run is checked
    check_resume(CheckpointRecord("a", {"a": 2, "b": 3}), "a", {"a": 2})


def test_the_early_check_needs_only_the_record():
    from hpref.rl.control.record import check_record_leader

    record = CheckpointRecord("a", {"a": 2, "b": 3})
    check_record_leader(record, "a", ["a", "b"])
    with pytest.raises(ResumeError, match="leader 'a', not 'b'"):
        check_record_leader(record, "b", ["b", "a"])
    with pytest.raises(ResumeError, match="policy 'c' is not in the checkpoint record"):
        check_record_leader(record, "a", ["a", "c"])
