"""`hpref save RUN --now` against a live `hpref rl` run: a real run of two tiny policies in its own
process (joining the session's Ray cluster with `--ray-address`: a cluster's start costs the suite
~10 s, and test_cluster.py checks the one `hpref rl` starts), and the command from another process.

The run saves only at its end (`save_interval = 0`) and runs for `time_limit_s`, so a `rollout-*`
save in the middle can only come from the trigger. If the command says "not alive", the rl driver
writes no heartbeat; if it times out, the leader does not read the trigger, or the command waits
for `step-*` folders while rl writes `rollout-*`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from hpref.runfolder.layout import CHECKPOINTS, ROLLOUT_PREFIX  # noqa: E402
from hpref.runfolder.record import read_record  # noqa: E402
from tests.conftest import run_hpref_here  # noqa: E402
from tests.rl.console import HPREF, cli_env, foreign_lines  # noqa: E402
from tests.rl.tiny import write_rl_recipe  # noqa: E402

pytestmark = pytest.mark.slow

RUN_SECONDS = 15  # the policies' loops (both cores busy); the save is asked for within the first
# few: heartbeat + one `hpref save` start-up, ~5 s on a busy machine


def _recipe(folder: Path) -> Path:
    return write_rl_recipe(folder, "live", num_rollouts=100000, save_interval=0, time_limit_s=RUN_SECONDS)


def test_save_now_checkpoints_a_live_rl_run_at_the_next_rollout(tmp_path, ray_cluster):
    import ray

    recipe = _recipe(tmp_path)
    run_dir = tmp_path / "runs" / "live"
    env = cli_env(tmp_path)
    gcs = ray.get_runtime_context().gcs_address
    log = tmp_path / "rl.stderr"  # a file, not a pipe: a full pipe would stall the run
    with open(log, "w") as stderr:
        rl = subprocess.Popen(
            [*HPREF, "rl", str(recipe), "--policies", "a,b", "--ray-address", gcs],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "heartbeat.json").exists():
            assert rl.poll() is None, f"hpref rl ended before it was asked: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no heartbeat from the live rl run"
            time.sleep(0.5)
        assert read_record(run_dir) is None  # nothing saved yet: the next save is the trigger's
        saved = subprocess.run(
            [*HPREF, "save", str(run_dir), "--now", "--timeout", "120"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert saved.returncode == 0, saved.stderr
        path = Path(saved.stdout.strip().splitlines()[-1])
        assert path.is_dir() and path.parent == run_dir / "checkpoints", saved.stdout
        assert path.name.startswith("rollout-")
        # every part saved, then the save's own record (written last: it is what makes the save whole)
        assert sorted(p.name for p in path.iterdir()) == ["a", "b", "executor", "record.json"]
        record = read_record(run_dir)
        assert record is not None and record.save_dir == f"checkpoints/{path.name}"
        assert not (run_dir / "SAVE_NOW").exists()  # the leader consumed the trigger
        assert rl.poll() is None  # the run goes on after the save

        rl.wait(timeout=RUN_SECONDS + 180)
        assert rl.returncode == 0, log.read_text()[-3000:]
    finally:
        if rl.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rl.pid, signal.SIGTERM)
            rl.wait(timeout=60)
    summary = json.loads((run_dir / "rl_summary.json").read_text())
    text = log.read_text()
    # every console line is hpref's: a library's log line, a progress bar or Ray's start-up notes
    # there is the noise issue #40 moved to the log files
    foreign = foreign_lines(text)
    assert not foreign, foreign[:10]
    # the leader took the trigger at a rollout boundary, said so, and saved there. `hpref save --now`
    # answers with that save, or with a later one when the run saved again (its time limit) before
    # the command's next look: an rl record names only its newest save (seen once under load: the
    # trigger's save at rollout 1, the time limit's at rollout 2 a second later)
    taken = re.search(r"hpref save --now: a global save after leader rollout (\d+)", text)
    assert taken is not None, text[-3000:]
    taken_at = int(taken.group(1))
    assert f"saved {CHECKPOINTS}/{ROLLOUT_PREFIX}{taken_at:06d}:" in text
    assert int(path.name.removeprefix(ROLLOUT_PREFIX)) >= taken_at
    final = read_record(run_dir)
    assert final is not None and summary["timed_out"]
    if final.save_dir == f"{CHECKPOINTS}/{ROLLOUT_PREFIX}{taken_at:06d}":
        # the trigger was read on the rollout where the time limit ran out (a slow or busy machine):
        # one global save serves both, never two saves of the same rollout
        assert summary["saves"] == 1
    else:
        assert summary["saves"] == 2  # the trigger's save, then the final one
    assert path.is_dir()  # keep_last = 0: the requested save stays beside the final one
    assert not (run_dir / "heartbeat.json").exists()  # the run is over: no longer "alive"

    # an rl save holds policies, not a preference model: exporting it without naming one of them
    # (`--policy`) is one line and exit 2 (in this process: a refusal starts nothing)
    export = run_hpref_here("save", str(run_dir), "--to", str(tmp_path / "export"))
    assert export.returncode == 2, export.stderr
    assert "--policy" in export.stderr and "its policies: a, b" in export.stderr
    assert not (tmp_path / "export").exists()
