"""End to end on a real local Ray cluster: two tiny policies warm-started from a supervised warm-up,
the `rule` reward, a save at `debug_exit_after_rollout`, a resume from the record, a resume refused
for the wrong leader, old saves pruned by `keep_last`, and the win rate against the warm-up start."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from hpref.recipe import recipe_from_dict  # noqa: E402
from hpref.rl.control.record import ResumeError, read_record  # noqa: E402
from hpref.rl.launch import run_rl  # noqa: E402
from hpref.runfolder.integrity import write_manifest  # noqa: E402
from hpref.runfolder.safe_load import CheckpointError  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402
from tests.train.logger_files import assert_curves_match, tensorboard_scalars  # noqa: E402

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow


def recipe(run_dir, b_ranks=1, **rl_over):
    rl = {
        "num_rollouts": 3,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6},
        "reward": {"name": "rule"},
        "defaults": {"model": TINY, "lr": 1e-3},
        "policies": {"a": {}, "b": {"model": {"seed": 1}, "algorithm": {"kl_coef": 0.05}, "ranks": b_ranks}},
        "eval_interval": 3,
        "save_interval": 1,
        "keep_last": 1,
        "warmup": {"steps": 15, "batch_size": 8, "battles": 200, "warmup_steps": 2},
    }
    rl["rollout"]["eval_prompts"] = 4
    rl.update(rl_over)
    run = {"name": run_dir.name, "output_dir": str(run_dir.parent)}
    logging = {"loggers": ["tensorboard"]}  # read back at the end of the stop-and-resume test
    return recipe_from_dict({"run": run, "rl": rl, "logging": logging}, resolve=False)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def read_metrics(run_dir, policy):
    lines = (run_dir / "metrics" / f"{policy}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_run_stop_resume_and_refuse_a_wrong_leader(ray_cluster, tmp_path, log_messages):
    run_dir = tmp_path / "arena"

    # 1. stop after rollout 2 as if interrupted: the save there is the one to resume from. Policy b
    # trains on two ranks (FSDP2 over a gloo group, its KL reference sharded too: issue #36) and
    # resumes below on one: a group's save is the one-rank files
    assert run_rl(recipe(run_dir, debug_exit_after_rollout=2, b_ranks=2), ["a", "b"], None, None) == 0
    first = read_record(run_dir)
    assert first.leader == "a" and first.rollout_ids["a"] == 2
    stopped_b = first.rollout_ids["b"]
    assert stopped_b >= 1  # the follower really ran beside the leader
    assert json.loads((run_dir / "rl_summary.json").read_text())["debug_exit"] is True
    # it stopped before its first eval: the summary says why it has no leaderboard, rather than
    # "eval_interval = 0" or an empty {} to be read as a failure
    why = "no leaderboard in rl_summary.json: no eval ran (the run stopped before rollout 3, the first eval)"
    assert any(why in m for m in log_messages), log_messages[-10:]

    # 2. a fresh start into the same folder is refused: it would mix two runs
    with pytest.raises(ResumeError, match="already holds a checkpoint record"):
        run_rl(recipe(run_dir), ["a", "b"], None, None)

    # 2b. a tampered copy of b's save (its trainer state pickles as os.system, checksums rewritten to
    # match) is refused by the trainer that resumes from it, and its code never runs; if this fails,
    # resuming a downloaded rl run folder runs a stranger's code in the trainer actor. The trainer's
    # own load, in this process: a run's resume would start every actor to reach the same line
    from hpref.rl.trainer.actor import TrainerActor

    tampered = tmp_path / "tampered-b"
    shutil.copytree(run_dir / first.save_dir / "b", tampered)
    marker = tmp_path / "MARKER"
    torch.save({"optimizer": _Evil(marker), "rollouts_done": 1, "version": 0}, tampered / "trainer.pt")
    write_manifest(tampered)
    config = json.loads((run_dir / "rl.json").read_text())["config"]
    policy_b = recipe(run_dir).rl.policies["b"]
    policy_b = policy_b.model_copy(
        update={"model": policy_b.model.model_copy(update=config["policies"]["b"]["model"])}
    )
    with pytest.raises(CheckpointError, match="trainer.pt: refused to load"):
        TrainerActor("b", policy_b, 1).load(str(tampered))
    assert not marker.exists()

    # 3. the wrong leader is refused before any actor starts
    with pytest.raises(ResumeError, match="written with leader 'a', not 'b'"):
        run_rl(recipe(run_dir), ["b", "a"], None, "auto")
    assert read_record(run_dir) == first

    # 4. resume: each policy continues exactly where the record put it, and the leader finishes
    assert run_rl(recipe(run_dir), ["a", "b"], None, "auto") == 0
    final = read_record(run_dir)
    assert final.rollout_ids["a"] == 3
    rows_a = [r for r in read_metrics(run_dir, "a") if not r.get("eval")]
    assert [r["rollout"] for r in rows_a] == [0, 1, 2]  # nothing replayed, nothing skipped
    rows_b = [r for r in read_metrics(run_dir, "b") if not r.get("eval")]
    resumed_b = [r["rollout"] for r in rows_b]
    assert resumed_b == list(range(len(resumed_b))), resumed_b  # b's second run began at stopped_b
    for row in rows_a + rows_b:
        for key in ("reward_mean", "loss", "kl", "clip_fraction", "true_utility", "gen_tokens_per_s"):
            assert math.isfinite(row[key]), (key, row)
    assert any(r["kl"] > 0 for r in rows_b[1:])  # b trains against its frozen start, a does not
    assert all(r["kl"] == 0 for r in rows_a)
    evals = [r for r in read_metrics(run_dir, "a") if r.get("eval")]
    assert len(evals) == 1 and math.isfinite(evals[0]["eval_true_utility"])
    assert 0.0 < evals[0]["eval_win_rate_vs_start"] < 1.0
    # every eval's greedy answers are kept with their scores: a mean that moved can be read (#22:
    # without them a policy's drift back to longer answers under a falling scorer was unreadable)
    folder = run_dir / "metrics" / "eval_answers"
    read = lambda name: [json.loads(x) for x in (folder / f"{name}.jsonl").read_text().splitlines()]  # noqa: E731
    evaluated, start = read(f"rollout-{evals[0]['rollout']:06d}"), read("start")
    assert sorted(r["player"] for r in evaluated) == sorted(["a", "b", "a@start", "b@start"] * 4)
    assert all(isinstance(r["answer"], str) and r["tokens"] >= 1 and r["prompt"] for r in evaluated)
    assert all(math.isfinite(r["reward"]) for r in evaluated)  # the training reward's score
    at_start = [(r["player"], r["prompt"], r["answer"]) for r in evaluated if "@" in r["player"]]
    assert sorted(at_start) == sorted((r["player"], r["prompt"], r["answer"]) for r in start)
    summary = json.loads((run_dir / "rl_summary.json").read_text())
    # the policies and their starting checkpoints are rated together, centred on 1000
    assert set(summary["leaderboard"]) == {"a", "b", "a@start", "b@start"}
    assert sum(summary["leaderboard"].values()) / 4 == pytest.approx(1000.0)
    assert summary["leaderboard_by"] == "ground truth"  # the arena's prompts have one
    assert (run_dir / "metrics" / "rewards.png").stat().st_size > 1000
    # TensorBoard shows every row of both policies' metrics.jsonl at its rollout, each once across the
    # stop and the resume (its purge starts at the earliest policy's resumed rollout; the kept rows of
    # a policy that resumed later are logged again), and the leaderboard at the leader's last rollout;
    # if this fails, the leader's loggers lose or repeat rollouts
    curves = tensorboard_scalars(run_dir / "tensorboard")
    expected = {}
    for policy in ("a", "b"):
        for row in read_metrics(run_dir, policy):
            for key, value in row.items():
                if key not in ("rollout", "eval") and isinstance(value, int | float):
                    short = key.removeprefix("eval_") if row.get("eval") else key
                    name = f"{policy}/eval/{short}" if row.get("eval") else f"{policy}/{short}"
                    expected.setdefault(name, {})[row["rollout"]] = float(value)
    expected.update({f"leaderboard/{p}": {3: r} for p, r in summary["leaderboard"].items()})
    assert_curves_match(expected, curves)

    # both policies started from their own cached warm-up checkpoint, and the resume reused it
    warm = summary["warmup_checkpoints"]
    assert set(warm) == {"a", "b"} and warm["a"] != warm["b"]  # different seeds, different starts
    written = json.loads((run_dir / "rl.json").read_text())
    config = written["config"]
    assert config["policies"]["a"]["model"]["path"] == warm["a"]
    # CPU engines ran in the rollout executor's process, the executor in the driver's, and rl.json
    # says so and why
    from hpref.rl.placement.engine_process import HOSTED_REASON, IN_DRIVER_REASON

    assert config["engines_in_executor"] is True and written["engines_in_executor_reason"] == HOSTED_REASON
    assert config["executor_in_driver"] is True and written["executor_in_driver_reason"] == IN_DRIVER_REASON
    # keep_last = 1: one save survives, and it is the one the record points to
    saves = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saves == [final.save_dir.split("/")[-1]] == ["rollout-000003"]
