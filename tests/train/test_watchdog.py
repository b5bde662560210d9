"""No silent hang, no orphans, nothing listening beyond loopback: real 2-rank `hpref train` runs.

Each live run is `hpref train` in its own session (so the test can always kill what is left) on
~2,000 one-battle steps, long enough to outlive every check here by minutes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sockets import alive, beyond_loopback, cmdline, listening, needs_ss
from tests.train.conftest import write_recipe

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and prctl")

LIVE = [
    "dataset.train.num_battles=2000",
    "train.epochs=1",
    "train.batch_size=1",
    "train.checkpoint_interval=0",
    "train.eval_interval=0",
    "train.log_interval=50",
]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


@contextlib.contextmanager
def live_run(tmp_path: Path, name: str, extra: list[str] = ()):
    """Yields (launcher Popen, {rank: worker pid}, run_dir) once both ranks have started training;
    kills whatever is left of the run on the way out."""
    recipe = write_recipe(tmp_path, name)
    run_dir = tmp_path / "runs" / name
    env = dict(os.environ, HPREF_HOME=str(tmp_path / "home"))
    args = [sys.executable, "-m", "hpref", "train", str(recipe), "--nproc-per-node", "2"]
    for o in [*LIVE, *extra]:
        args += ["--set", o]
    launcher = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    workers: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "heartbeat.json").exists():  # rank 0 wrote it after its first step
            assert launcher.poll() is None, f"the run ended early: {launcher.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "the run did not reach its first step in 180 s"
            time.sleep(0.5)
        for pid in _children(launcher.pid):
            if "hpref.train.worker" in cmdline(pid):
                workers[_rank_of(pid)] = pid
        assert sorted(workers) == [0, 1], workers
        yield launcher, workers, run_dir
    finally:
        for pid in [launcher.pid, *workers.values()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)


def test_workers_die_with_a_launcher_killed_by_sigkill(tmp_path):
    """`kill -9` of `hpref train`: the kernel must take both workers within seconds. If this fails,
    the workers do not set PR_SET_PDEATHSIG (or set it from a thread that has ended), and a killed
    launcher leaves two orphans training to the end of the epoch."""
    with live_run(tmp_path, "orphans") as (launcher, workers, _run_dir):
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in workers.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {rank: pid for rank, pid in workers.items() if alive(pid)}
        assert not left, f"workers outlived their launcher: {left}"


def test_a_stopped_rank_ends_the_run_with_its_name_and_log(tmp_path):
    """SIGSTOP rank 1: with a 6 s heartbeat timeout the launcher must end the run within a minute,
    exit non-zero, and print one line naming rank 1 and its log. If this times out, a frozen rank
    still hangs the run for the gloo timeout (30 min) with nothing said; if the line names rank 0,
    the watchdog blames the rank that was waiting for the frozen one."""
    with live_run(tmp_path, "stopped", ["launch.heartbeat_timeout_s=6"]) as (launcher, workers, run_dir):
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            code = launcher.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("the run still hangs 90 s after rank 1 was stopped")
        took = time.monotonic() - stopped
        stderr = launcher.stderr.read()
        assert code != 0
        lines = [line for line in stderr.splitlines() if "stopped making progress" in line]
        assert len(lines) == 1, stderr[-3000:]
        assert "rank 1 stopped making progress" in lines[0]
        assert str(run_dir / "logs" / "rank1.log") in lines[0]
        assert "T (stopped)" in lines[0]
        assert took < 60, f"{took:.0f} s from SIGSTOP to the end of the run"
        assert not any(alive(pid) for pid in workers.values())


@needs_ss
def test_a_one_node_run_listens_on_loopback_only(tmp_path):
    """Every TCP socket a live 2-rank run listens on (launcher and workers: rendezvous store, gloo)
    must be bound to 127.0.0.1 or ::1. If this fails, torchrun's store (which binds every
    interface whatever host it is given) is reachable from the network during the run, so anyone
    on it can write into the store the ranks trust."""
    with live_run(tmp_path, "loopback") as (launcher, workers, _run_dir):
        lines = listening({launcher.pid, *workers.values()})
        assert lines, "found no listening socket at all: the check itself is broken"
        assert not beyond_loopback(lines), "listening beyond loopback:\n" + "\n".join(beyond_loopback(lines))


def test_more_cpu_ranks_than_cores_are_refused_before_anything_starts(tmp_path):
    """Pinned to one core, `--nproc-per-node 2` must exit 2 with one line that says why and how to
    override, before any worker starts. If this fails, hpref silently starts more ranks than the CPU
    can run (64 ranks on 2 cores printed nothing for a minute)."""
    recipe = write_recipe(tmp_path, "cores")
    env = dict(os.environ, HPREF_HOME=str(tmp_path / "home"))
    args = ["taskset", "-c", "0", sys.executable, "-m", "hpref", "train", str(recipe)]
    args += ["--nproc-per-node", "2", "--set", "train.max_steps=1"]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: 2 ranks per node on a CPU with 1 cores: use --nproc-per-node 1 or fewer, "
        "or --set launch.oversubscribe=true to run them anyway"
    ]
    assert not (tmp_path / "runs" / "cores" / "logs").exists()


def test_oversubscribe_lets_more_ranks_than_cores_through(monkeypatch, tmp_path):
    """The override is honoured (and GPUs are never counted against CPU cores)."""
    from hpref.errors import UserError
    from hpref.recipe import load_recipe
    from hpref.train import launch

    monkeypatch.setattr(launch, "cpu_cores", lambda: 2)
    recipe = load_recipe(write_recipe(tmp_path, "over"))
    launch.check_cpu_ranks(2, recipe)
    with pytest.raises(UserError, match="3 ranks per node on a CPU with 2 cores"):
        launch.check_cpu_ranks(3, recipe)
    launch.check_cpu_ranks(64, load_recipe(write_recipe(tmp_path, "over"), ["launch.oversubscribe=true"]))
