"""kill -9 of one policy's engine actor in a live `hpref rl` run that joined the session's Ray
cluster: the run ends with one line naming the policy, the actor and the save `--resume auto`
continues from, and leaves the cluster it joined up. A trainer rank's death, named and resumed bit
for bit, is test_chaos_rl.py's first kill; the loopback-only listeners of a cluster `hpref rl` starts
are test_stop_signals.py's Ctrl-C run's; the run files' fsynced writes and the empty leaderboard's
line are test_weight_sync.py's (a run that fails, then resumes to the end): each was a run of its
own here (~40 s of the suite)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from hpref.recipe import recipe_from_dict  # noqa: E402
from hpref.rl import launch as driver  # noqa: E402
from hpref.rl.control.record import read_record  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402

pytestmark = pytest.mark.slow


def recipe(run_dir, num_rollouts):
    rl = {
        "num_rollouts": num_rollouts,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 4},
        "reward": {"name": "rule"},
        "defaults": {"model": TINY, "lr": 1e-3},
        "policies": {"a": {}, "b": {"model": {"seed": 1}}},
        "eval_interval": 0,
        "save_interval": 1,
        # engine actors, as vLLM and GPU engines always have (CPU engines would be in the executor's
        # process, whose death is the executor's: test_engine_process.py names it)
        "engines_in_executor": False,
    }
    return recipe_from_dict(
        {"run": {"name": run_dir.name, "output_dir": str(run_dir.parent)}, "rl": rl}, resolve=False
    )


def test_a_killed_engine_actor_is_named_and_the_joined_cluster_stays_up(
    tmp_path, monkeypatch, log_messages, ray_cluster
):
    """SIGKILL policy b's engine actor once b has trained two rollouts and a save is recorded. If
    the run hangs, a dead actor is not noticed; if it ends in a traceback or the line lacks
    "policy 'b': engine actor died", the user cannot tell what died; if the line does not name the
    recorded save, `--resume auto` is not where the user is told to go on; if Ray is down after, the
    run stopped a cluster it joined (`hpref rl` leaves any cluster it joined running)."""
    run_dir = tmp_path / "arena"
    pids: dict[str, int] = {}
    real_create = driver.create_ray_actors

    def create(config, order, teardown, prompts=None, where="recipe"):
        handles = real_create(config, order, teardown, prompts, where)
        pids["b"] = ray.get(handles.engines["b"].__ray_call__.remote(lambda self: os.getpid()))
        return handles

    monkeypatch.setattr(driver, "create_ray_actors", create)

    def killer():
        metrics = run_dir / "metrics" / "b.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            saved = read_record(run_dir) is not None
            if "b" in pids and saved and metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                os.kill(pids["b"], signal.SIGKILL)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    start = time.monotonic()
    code = driver.run_rl(recipe(run_dir, 200), ["a", "b"])
    thread.join(timeout=5)
    assert code == 1
    assert time.monotonic() - start < 300
    lines = [m for m in log_messages if " died (" in m]
    assert len(lines) == 1, log_messages[-10:]
    assert "policy 'b': engine actor died" in lines[0]
    record = read_record(run_dir)
    assert record is not None and record.save_dir in lines[0] and "--resume auto" in lines[0]
    assert ray.is_initialized()
    assert ray.get(ray.put(1)) == 1  # the joined cluster still answers


def test_a_dead_actor_is_found_when_the_error_does_not_name_it(ray_cluster):
    """A weight push cut by a trainer's death reaches the driver as gloo's "connection reset by
    peer", naming no actor: `dead_actor` asks each of the run's actors and names the dead one (and
    takes a live one for alive). Wrong: the run's line blames the weight update, not what died."""
    from types import SimpleNamespace

    from hpref.runtime.ray_cluster import actor_names, dead_actor

    @ray.remote(num_cpus=0)
    class Idle:
        pass

    trainer, engine, executor = Idle.remote(), Idle.remote(), Idle.remote()
    handles = SimpleNamespace(
        engines={"a": engine}, trainers={"a": SimpleNamespace(ranks=[trainer])}, executor=executor
    )
    names = actor_names(handles)
    assert dead_actor(handles, names) is None
    ray.kill(trainer)
    # `ray.kill` only asks: a call sent right after it may still be served (seen once in a full
    # suite run), so ask until Ray knows the actor is dead (slow under load)
    deadline = time.monotonic() + 120
    while True:
        try:
            ray.get(trainer.__ray_ready__.remote(), timeout=120)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "Ray still serves a killed actor after 120 s"
        time.sleep(0.2)
    assert dead_actor(handles, names) == "policy 'a': trainer actor"
    for actor in (engine, executor):
        ray.kill(actor)
