"""SIGTERM and Ctrl-C stop `hpref rl` gracefully (`hpref.rl.control.stop`): the leader's rollout in flight
finishes, a global save is written as `hpref save --now` writes it, every actor (and the local
cluster hpref started) ends, one line names the signal, the rollout and the save, exit 143 / 130; a
second signal stops at once, without a save.

The live runs are the real command in its own session on the tiny two-policy recipe, with no save of
their own (`save_interval = 0`, endless), so a save can only be the stop's. Two join the session's
Ray cluster (a cluster's start costs ~10 s; `hpref rl` leaves a cluster it joined running); the
Ctrl-C one starts its own, because a terminal's Ctrl-C reaches every process of the group, Ray's
included, and that is what it checks. The first tests are the handlers' rules, in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpref.rl.control.driver import drive
from hpref.rl.control.record import CheckpointRecord, read_record, write_record
from hpref.rl.control.stop import StopNow, StopSignals, stopped_line
from tests.rl.console import HPREF, cli_env, foreign_lines
from tests.rl.control.test_driver import World, config, make, run
from tests.rl.tiny import write_rl_recipe
from tests.sockets import alive, beyond_loopback, cmdline, descendants, listening, needs_ss

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")

#: the process titles Ray gives the run's actors' workers
ACTORS = ("ray::EngineHost", "ray::RolloutExecutor", "ray::TrainerActor")
SAVED = re.compile(
    r"hpref rl: stopped by (SIGTERM|SIGINT) after leader rollout (\d+); saved (checkpoints/rollout-\d+); "
    r"run again with --resume auto to continue from it"
)


def test_a_first_signal_waits_for_the_loop_and_a_second_stops_at_once():
    """Before the loop a signal stops at once; in it the first is only noted (the leader asks at its
    next rollout boundary) and the second raises; after it, signals are noted and never raised (the
    teardown must reach every actor). If this fails, a first SIGTERM would cut a rollout short with
    no save, a second would wait for the save, or a late one would break the teardown."""
    handler = signal.getsignal(signal.SIGINT)  # what the process had (another test's CLI run may differ)
    with StopSignals(timeout_s=600) as signals:
        with pytest.raises(StopNow) as before:
            signal.raise_signal(signal.SIGINT)
        assert before.value.signal == signal.SIGINT and before.value.second is None
        assert before.value.exit_code == 130
    with StopSignals(timeout_s=600) as signals:
        with signals.graceful():
            signal.raise_signal(signal.SIGTERM)
            assert signals.requested and signals.first == signal.SIGTERM
            with pytest.raises(StopNow) as second:
                signal.raise_signal(signal.SIGINT)
        # the first signal names the exit code, the second is named in the line
        assert second.value.signal == signal.SIGTERM and second.value.second == signal.SIGINT
        assert second.value.exit_code == 143 and second.value.expired_after is None
        signal.raise_signal(signal.SIGTERM)  # closing: noted, not raised
        assert signals.exit_code == 143
    with StopSignals(timeout_s=600) as signals:
        with signals.graceful():
            pass
        signal.raise_signal(signal.SIGINT)  # after the loop: the run is closing
        assert signals.first == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is handler  # put back


def test_the_wait_for_the_boundary_is_bounded(tmp_path):
    """A first signal whose boundary never comes (a rollout that hangs) stops the run once
    `timeout_s` has passed, as a second signal would, and the line says why. If this fails, a
    hung rollout keeps a SIGTERMed run alive until the scheduler's SIGKILL."""
    with StopSignals(timeout_s=0.05) as signals, signals.graceful():
        signal.raise_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        with pytest.raises(StopNow) as expired:
            while time.monotonic() < deadline:
                time.sleep(0.01)
    assert expired.value.expired_after == 0.05 and expired.value.signal == signal.SIGTERM
    assert expired.value.exit_code == 143
    assert stopped_line(tmp_path, expired.value).startswith(
        "hpref rl: stopped by SIGTERM: the rollout and its save did not end within 0.05 s, nothing saved;"
    )


def test_the_leader_saves_at_its_next_rollout_after_a_signal_and_everyone_stops(tmp_path):
    """A first SIGTERM while the loops run (the driver with in-process fake actors): the leader
    finishes its rollout, parks every follower, saves every part and the record at that rollout,
    and every loop ends; a signal after the loops is only noted. If this fails, a signal is ignored
    until `num_rollouts` (and a scheduler's SIGKILL then loses all since the last save), or the save
    is taken while a follower is in the middle of a step."""
    world = World()
    order = ["a", "b"]
    handles, trainers = make(world, order)

    async def signalled() -> object:
        asyncio.get_running_loop().call_later(0.05, signal.raise_signal, signal.SIGTERM)
        starts = {"a": 0, "b": 0}
        return await drive(config(num_rollouts=100000), order, handles, tmp_path, starts, signals=signals)

    with StopSignals(timeout_s=600) as signals:
        result = run(signalled())
        signal.raise_signal(signal.SIGINT)  # the run is closing: noted, not raised
    assert result.stopped_by == "SIGTERM" and result.saves == 1
    assert 0 < result.positions["a"] < 100000
    record = read_record(tmp_path)
    assert record is not None and record.save_dir == result.last_save
    assert record.rollout_ids == {"a": result.positions["a"], "b": trainers["b"].done}
    assert world.saves[-1]["busy"] == set()  # every follower parked for the save


def test_the_stop_line_says_where_resume_continues(tmp_path):
    """The one line of a stop at once names the signal and where `--resume auto` continues: the
    record's save, or the beginning when there is none. If this fails, the user is told to resume
    from a save that is not the record's."""
    stop = StopNow(signal.SIGTERM, second=signal.SIGINT)
    assert stopped_line(tmp_path, stop) == (
        "hpref rl: stopped at once by a second signal (SIGINT after SIGTERM), nothing saved; no save was "
        "recorded yet, so a new run starts from the beginning"
    )
    write_record(tmp_path, CheckpointRecord("a", {"a": 4, "b": 3}, save_dir="checkpoints/rollout-000004"))
    early = StopNow(signal.SIGINT)
    assert stopped_line(tmp_path, early) == (
        "hpref rl: stopped by SIGINT before the first rollout, nothing saved; run again with --resume auto "
        "to continue from leader rollout 4 (checkpoints/rollout-000004)"
    )


def test_the_callers_sigterm_handler_survives_ray_init():
    """`connect_ray` keeps the caller's SIGTERM handler across `ray.init`, which sets its own
    (`sys.exit(15)`), and a SIGTERM that arrives while Ray starts reaches the caller's handler.
    If this fails, SIGTERM to `hpref rl` is Ray's C++ stack dump and abort again."""
    from hpref.runtime.ray_cluster import _own_sigterm

    heard: list[int] = []

    def own(signum, _frame):
        heard.append(signum)

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with _own_sigterm():  # what ray.init does as it starts
            signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(signum))
        assert signal.getsignal(signal.SIGTERM) is own and heard == []
        signal.raise_signal(signal.SIGTERM)
        assert heard == [signal.SIGTERM]
        with pytest.raises(SystemExit), _own_sigterm():
            signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(signum))
            signal.raise_signal(signal.SIGTERM)  # while Ray starts
        assert heard == [signal.SIGTERM, signal.SIGTERM]  # the caller heard it
    finally:
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------------------------------
# live runs


def _actor_pids(root: int) -> set[int]:
    """The hpref actors' worker processes below `root`."""
    return {pid for pid in descendants(root) if cmdline(pid).startswith(ACTORS)}


def _wait_gone(pids: set[int], timeout: float = 60) -> set[int]:
    """The pids still alive after `timeout` (a killed actor's worker exits within a moment)."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {p for p in pids if alive(p)}


@contextlib.contextmanager
def _live_rl(log: Path, args: list[str], run_dir: Path, rollouts: int) -> Iterator[subprocess.Popen]:
    """`hpref rl` in its own session, yielded once policy a has `rollouts` metrics rows; its console
    (stderr) goes to `log`; whatever is left is killed on the way out."""
    with open(log, "w") as stderr:
        rl = subprocess.Popen(
            [*HPREF, "rl", *args],
            env=cli_env(log.parent),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        metrics = run_dir / "metrics" / "a.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= rollouts):
            assert rl.poll() is None, f"hpref rl ended early: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no rollout in 300 s: {log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield rl
    finally:
        if rl.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rl.pid, signal.SIGKILL)
        rl.wait(timeout=60)


def _console(log: Path) -> tuple[str, list[str]]:
    """A run's console and its stop lines (the message, without the time and level); every console
    line is hpref's (no Python traceback, no Ray stack dump, no library noise)."""
    text = log.read_text()
    assert not foreign_lines(text), foreign_lines(text)[:10]
    stops = [line.partition(" WARNING ")[2] for line in text.splitlines() if "hpref rl: stopped" in line]
    return text, stops


@pytest.mark.slow
def test_sigterm_saves_where_resume_auto_continues_and_a_second_signal_stops_at_once(tmp_path, ray_cluster):
    """`kill PID` once policy a has trained a rollout: the leader finishes its rollout, saves every
    part, every actor ends, one line, exit 143. `--resume auto` then continues from that save (a's
    next row is the saved rollout), and Ctrl-C with `kill` right after it stops it at once: exit 130
    or 143 (the first signal taken), one line naming both signals and the first run's save, no new
    save, no actor left. If this fails with exit -15 or a stack dump, Ray's SIGTERM handler is still
    the driver's; with no record, the leader did not save before it ended; with live actors, the
    teardown did not reach them."""
    import ray

    run_dir = tmp_path / "runs" / "stop"
    recipe = write_rl_recipe(tmp_path, "stop", num_rollouts=100000, save_interval=0)
    joined = [str(recipe), "--policies", "a,b", "--ray-address", ray.get_runtime_context().gcs_address]
    first, second = tmp_path / "first.stderr", tmp_path / "second.stderr"
    before = _actor_pids(os.getpid())  # the session cluster's workers are this process's descendants
    with _live_rl(first, joined, run_dir, rollouts=1) as rl:
        ours = _actor_pids(os.getpid()) - before
        os.kill(rl.pid, signal.SIGTERM)
        assert rl.wait(timeout=300) == 143
    text, lines = _console(first)
    assert len(lines) == 1, text[-3000:]
    said = SAVED.fullmatch(lines[0])
    assert said is not None and said.group(1) == "SIGTERM", lines[0]
    at, saved = int(said.group(2)), said.group(3)
    record = read_record(run_dir)
    assert record is not None and record.save_dir == saved and record.rollout_ids["a"] == at >= 1
    assert {"a", "b", "executor"} <= {p.name for p in (run_dir / saved).iterdir()}  # every part
    assert json.loads((run_dir / "rl_summary.json").read_text())["stopped_by"] == "SIGTERM"
    # two trainers; the executor and the engines it hosts are in the driver's process (CPU engines)
    assert len(ours) == 2, ours
    assert not _wait_gone(ours), "actors outlived the run"

    before = _actor_pids(os.getpid())
    with _live_rl(second, [*joined, "--resume", "auto"], run_dir, rollouts=at + 1) as rl:
        ours = _actor_pids(os.getpid()) - before
        # back to back, so that the second comes before the tiny rollout in flight could end (a
        # pause would let the graceful stop save); the two can reach Python in either order (Ray's
        # threads block SIGINT, so a pending SIGINT may wait for the main thread): the exit code is
        # the first taken's, which the line names
        os.killpg(rl.pid, signal.SIGINT)
        os.kill(rl.pid, signal.SIGTERM)
        code = rl.wait(timeout=300)
    rows = [json.loads(line) for line in (run_dir / "metrics" / "a.jsonl").read_text().splitlines()]
    assert rows[at]["rollout"] == at  # the resumed run went on from the saved rollout
    text, lines = _console(second)
    assert f"resumed from {run_dir / saved}" in text
    took, then = ("SIGINT", "SIGTERM") if code == 130 else ("SIGTERM", "SIGINT")
    assert code in (130, 143) and lines == [
        f"hpref rl: stopped at once by a second signal ({then} after {took}), nothing saved; run again "
        f"with --resume auto to continue from leader rollout {at} ({saved})"
    ], (code, text[-3000:])
    assert read_record(run_dir) == record  # no save by the stop at once
    assert len(ours) == 2, ours
    assert not _wait_gone(ours), "actors outlived the run"
    assert ray.get(ray.put(1)) == 1  # the cluster it joined is still up


@pytest.mark.slow
@needs_ss
def test_ctrl_c_saves_and_every_process_of_the_local_cluster_ends(tmp_path):
    """Ctrl-C in a terminal: SIGINT to the whole process group, the driver, the local Ray cluster
    it started and the actors' workers alike. Ray's processes block SIGINT, so the actors live until
    the save; exit 130, one line, every process of the run gone. If this fails with a save missing a
    part, an actor died of the signal; with processes left, the cluster outlived the run. The live
    cluster `hpref rl` started must listen on loopback only: Ray's default, every interface, exposes
    a cluster that runs any code sent to it (the suite's one run that starts its own cluster and
    lives long enough to be read)."""
    run_dir = tmp_path / "runs" / "ctrl-c"
    recipe = write_rl_recipe(tmp_path, "ctrl-c", num_rollouts=100000, save_interval=0)
    log = tmp_path / "ctrl-c.stderr"
    # one policy: what is checked here is the group's signal and the processes, not the parking
    with _live_rl(log, [str(recipe), "--policies", "a"], run_dir, rollouts=1) as rl:
        tree = descendants(rl.pid)
        assert any("gcs_server" in cmdline(p) for p in tree), [cmdline(p) for p in tree]
        # a's trainer, in the group (the executor, with a's engine, is the driver's process)
        assert len(_actor_pids(rl.pid)) == 1
        heard = listening(tree)
        assert any("gcs_server" in line for line in heard), heard
        assert not beyond_loopback(heard), "\n".join(beyond_loopback(heard))
        os.killpg(rl.pid, signal.SIGINT)
        assert rl.wait(timeout=300) == 130
    text, lines = _console(log)
    assert len(lines) == 1, text[-3000:]
    said = SAVED.fullmatch(lines[0])
    assert said is not None and said.group(1) == "SIGINT", lines[0]
    record = read_record(run_dir)
    assert record is not None and record.save_dir == said.group(3)
    assert {"a", "executor"} <= {p.name for p in (run_dir / record.save_dir).iterdir()}
    left = _wait_gone(tree)
    assert not left, [cmdline(p) for p in left]
