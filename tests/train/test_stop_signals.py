"""SIGTERM and Ctrl-C stop `hpref train` gracefully: real 2-rank runs under hpref's torchrun launcher,
signalled as a scheduler or a terminal does (the launcher's whole process group), and the handler's
own rules in-process.

Each run is the conftest's tiny 20-step recipe. `HPREF_DEBUG_HOLD_STEP` keeps step 8 in flight on
rank 0 (until the stop is asked, or for good), so the signal lands in a known step whatever the
machine's speed: the test signals once rank 0's log shows step 7.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sockets import alive, cmdline
from tests.train.conftest import write_recipe
from tests.train.test_watchdog import _children

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")


@contextlib.contextmanager
def launched(recipe: Path, *args: str, hold: str | None = None):
    """`hpref train RECIPE --nproc-per-node 2 ARGS` in its own session (its process group is what a
    terminal or a scheduler signals); whatever is left of it is killed on the way out."""
    env = dict(os.environ, HPREF_HOME=str(recipe.parent / "home"))
    env.pop("HPREF_DEBUG_HOLD_STEP", None)
    if hold is not None:
        env["HPREF_DEBUG_HOLD_STEP"] = hold
    command = [sys.executable, "-m", "hpref", "train", str(recipe), "--nproc-per-node", "2", *args]
    launcher = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        yield launcher
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)


def wait_for(launcher: subprocess.Popen, done, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert launcher.poll() is None, f"the run ended before {what}: {launcher.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.2)


def workers_of(launcher: subprocess.Popen) -> list[int]:
    return [pid for pid in _children(launcher.pid) if "hpref.train.worker" in cmdline(pid)]


def logged(run_dir: Path, text: str) -> bool:
    try:
        return text in (run_dir / "logs" / "rank0.log").read_text()
    except FileNotFoundError:
        return False


def finish(launcher: subprocess.Popen, workers: list[int]) -> tuple[int, str]:
    """The launcher's exit code and console (stderr), once it and every worker it started are gone."""
    _out, stderr = launcher.communicate(timeout=120)
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if alive(pid)], "a worker outlived the stopped run"
    for junk in ("Traceback", "internal error", "SignalException", "death signal"):
        assert junk not in stderr, stderr[-3000:]
    return launcher.returncode, stderr


def stop_lines(stderr: str) -> list[str]:
    """The console lines of a stop, without the time and level in front."""
    marker = "hpref train: stopped by"
    return [marker + line.split(marker, 1)[1] for line in stderr.splitlines() if marker in line]


def final_weights(checkpoint: Path) -> dict:
    from hpref.components import Components
    from hpref.runtime.checkpoint import load_model_state, recipe_of_run

    model = Components(recipe_of_run(checkpoint)).model(device="cpu")
    return load_model_state(checkpoint, model)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # reading a checkpoint here
def test_sigterm_saves_the_step_in_flight_and_resume_ends_bit_for_bit(tmp_path, two_rank_run):
    """SIGTERM to the group while step 8 is in flight: step 8 finishes, every rank saves it, the
    workers end, one line names the signal, the step and the checkpoint, exit 143; `--resume auto`
    goes on from step 8 and ends with the uninterrupted run's weights bit for bit. If this fails with
    "internal error: SignalException", torchrun's agent still owns SIGTERM; if it hangs, the ranks
    did not agree on the step to stop at; if the weights differ, the stop saved a different state
    than `hpref save --now` does."""
    from hpref.runfolder.integrity import verify
    from hpref.train import run_train

    recipe = write_recipe(tmp_path, "ref")  # the reference's name: same seeds, same data
    run_dir = tmp_path / "runs" / "ref"
    with launched(recipe, hold="8") as launcher:
        wait_for(launcher, lambda: logged(run_dir, "step 7/20 "), "step 7")
        workers = workers_of(launcher)
        assert len(workers) == 2
        os.killpg(launcher.pid, signal.SIGTERM)
        code, stderr = finish(launcher, workers)
    assert code == 143
    assert stop_lines(stderr) == [
        "hpref train: stopped by SIGTERM after step 8; saved checkpoint step-000008; run again with "
        "--resume auto to continue from step 8 (step-000008)"
    ], stderr[-3000:]
    checkpoint = run_dir / "checkpoints" / "step-000008"
    assert verify(checkpoint) == []
    assert json.loads((checkpoint / "train_state.json").read_text())["step"] == 8
    assert not (run_dir / "summary.json").exists()  # stopped, not finished
    assert not (run_dir / "heartbeat.json").exists()  # `hpref save --now` sees a run that ended

    assert run_train(recipe, nproc_per_node=2, resume="auto") == 0  # in-process: no CLI start-up
    assert "resumed from" in (run_dir / "logs" / "rank0.log").read_text()
    ours = final_weights(run_dir / "checkpoints" / "step-000020")
    theirs = final_weights(two_rank_run / "checkpoints" / "step-000020")
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not ours[k].equal(theirs[k])] == []


def test_a_second_ctrl_c_stops_at_once_without_a_save(tmp_path):
    """Ctrl-C (SIGINT to the group) while step 8 is held for good, then Ctrl-C again: the run stops
    at once, without a step-8 checkpoint, every worker gone, one line, exit 130. If this hangs, a
    second signal waits for a step boundary like the first; if step 8 is saved, the first was not
    graceful (the held step cannot have finished)."""
    recipe = write_recipe(tmp_path, "twice")
    run_dir = tmp_path / "runs" / "twice"
    with launched(recipe, hold="8:forever") as launcher:
        wait_for(launcher, lambda: logged(run_dir, "step 7/20 "), "step 7")
        workers = workers_of(launcher)
        os.killpg(launcher.pid, signal.SIGINT)
        time.sleep(1)  # the first is taken (the run waits for its step boundary), not merged with the second
        assert launcher.poll() is None, "the first Ctrl-C did not wait for the step in flight"
        os.killpg(launcher.pid, signal.SIGINT)
        code, stderr = finish(launcher, workers)
    assert code == 130
    assert stop_lines(stderr) == [
        "hpref train: stopped by SIGINT at once (a second SIGINT), without a save; run again with "
        "--resume auto to continue from step 6 (step-000006)"
    ], stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000003", "step-000006"]


def test_a_signal_before_the_first_step_ends_cleanly(tmp_path):
    """SIGTERM while the workers are still starting (importing, tokenising): nothing to save, so the
    run stops at once, with one line and exit 143, and no worker left. If this prints a traceback
    or "internal error", a stop before the loop is not handled; if it hangs, the launcher waits for
    a step boundary that a starting run cannot promise."""
    recipe = write_recipe(tmp_path, "early")
    run_dir = tmp_path / "runs" / "early"
    with launched(recipe) as launcher:
        wait_for(launcher, lambda: len(workers_of(launcher)) == 2, "workers", timeout=120)
        workers = workers_of(launcher)
        os.killpg(launcher.pid, signal.SIGTERM)
        code, stderr = finish(launcher, workers)
    assert code == 143
    lines = stop_lines(stderr)
    assert len(lines) == 1 and "SIGTERM at once (before the first step)" in lines[0], stderr[-3000:]
    assert "start from step 0" in lines[0]
    assert not list((run_dir / "checkpoints").glob("step-*"))


# --------------------------------------------------------------------------------------------------
# the handler's rules, in this process


def test_the_first_signal_asks_the_ranks_and_a_late_boundary_stops_at_once(monkeypatch):
    """In the loop (ready), SIGTERM writes the request the ranks read and returns; with no step
    boundary within the grace, the handler stops at once, naming why; the previous handlers are back
    afterwards. If this fails, a first signal kills the run without a save, or a wait is unbounded."""
    from hpref.runtime.stop_signals import STOP_FILE_ENV, GracefulStop, StopNow, exit_code, stop_requested

    before = signal.getsignal(signal.SIGTERM)
    stop = GracefulStop(0.3, ready=lambda: True)
    monkeypatch.setenv(STOP_FILE_ENV, stop.environment()[STOP_FILE_ENV])
    with pytest.raises(StopNow) as raised, stop.installed():
        assert stop_requested() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_requested() == signal.SIGTERM  # the handler returned: the run goes on
        time.sleep(30)  # the grace's expiry interrupts this
    assert raised.value.signum == signal.SIGTERM and "no step boundary within 0.3 s" in raised.value.reason
    assert exit_code(signal.SIGTERM) == 143 and exit_code(signal.SIGINT) == 130
    assert signal.getsignal(signal.SIGTERM) is before
    assert not stop.path.parent.exists()  # the request goes with the launch


def test_a_signal_before_the_loop_stops_at_once():
    """Before the training loop (not ready) Ctrl-C stops at once: there is no step to finish; a
    signal during the teardown that follows is not raised again. If this fails, a run still
    tokenising waits for a boundary minutes away, or a third signal cuts the workers' teardown."""
    from hpref.runtime.stop_signals import GracefulStop, StopNow

    stop = GracefulStop(300, ready=lambda: False)
    with pytest.raises(StopNow) as raised, stop.installed():
        with pytest.raises(StopNow) as first:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        os.kill(os.getpid(), signal.SIGTERM)  # during the teardown: noted, not raised again
        raise first.value
    assert raised.value.signum == signal.SIGINT and raised.value.reason == "before the first step"
    assert not stop.path.exists()
