"""`hpref save --now` against a live 2-rank training run (real torchrun, gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.train.conftest import write_recipe


def test_save_now_checkpoints_a_live_two_rank_run(tmp_path):
    """One epoch of ~1,500 one-battle steps and no checkpoint interval: the only way a checkpoint
    appears within the test is the trigger. If `save --now` hangs or fails, the trainer does not
    watch the trigger file (or does not take the checkpoint on every rank at the same step)."""
    recipe = write_recipe(tmp_path, "live")
    run_dir = tmp_path / "runs" / "live"
    env = dict(os.environ, HPREF_HOME=str(tmp_path / "home"))
    overrides = [
        "dataset.train.num_battles=2000",
        "dataset.eval.num_battles=96",
        "train.epochs=1",
        "train.batch_size=1",
        "train.checkpoint_interval=0",
        "train.eval_interval=0",
        "train.log_interval=50",
    ]
    args = [sys.executable, "-m", "hpref", "train", str(recipe), "--nproc-per-node", "2"]
    for o in overrides:
        args += ["--set", o]
    trainer = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "heartbeat.json").exists():
            assert trainer.poll() is None, "training ended before it was asked for a checkpoint"
            assert time.monotonic() < deadline, "no heartbeat from the live run"
            time.sleep(0.5)
        saved = subprocess.run(
            [sys.executable, "-m", "hpref", "save", str(run_dir), "--now", "--timeout", "120"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert saved.returncode == 0, saved.stderr
        path = saved.stdout.strip().splitlines()[-1]
        assert os.path.isdir(path) and "/checkpoints/step-" in path, saved.stdout
        assert not (run_dir / "SAVE_NOW").exists()  # the trainer consumed the trigger
        state = json.loads(
            (run_dir / "checkpoints" / os.path.basename(path) / "train_state.json").read_text()
        )
        assert 0 < state["step"] < 1400  # mid-epoch: neither an epoch end nor the last step
        assert trainer.poll() is None  # the run goes on after the checkpoint
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGTERM)
            trainer.wait(timeout=60)


def test_save_now_refuses_a_run_that_is_not_alive(tmp_path):
    (tmp_path / "run").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "hpref", "save", str(tmp_path / "run"), "--now", "--timeout", "5"],
        env=dict(os.environ, HPREF_HOME=str(tmp_path / "home")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "the run is not alive" in result.stderr
