"""kill -9 of one policy's engine or trainer actor in a live `hpref rl` run on a real local Ray
cluster: the run ends with one line naming the policy and the actor, and `--resume auto` continues
from record.json."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from hpref.recipe import recipe_from_dict  # noqa: E402
from hpref.rl import launch as driver  # noqa: E402
from hpref.rl.record import read_record  # noqa: E402
from tests.rl.conftest import start_ray  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402
from tests.sockets import beyond_loopback, descendants, listening, needs_ss  # noqa: E402

pytestmark = pytest.mark.slow


def recipe(run_dir, num_rollouts, b_ranks=1):
    rl = {
        "num_rollouts": num_rollouts,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 4},
        "reward": {"name": "rule"},
        "defaults": {"model": TINY, "lr": 1e-3},
        "policies": {"a": {}, "b": {"model": {"seed": 1}, "ranks": b_ranks}},
        "eval_interval": 0,
        "save_interval": 1,
    }
    return recipe_from_dict(
        {"run": {"name": run_dir.name, "output_dir": str(run_dir.parent)}, "rl": rl}, resolve=False
    )


@pytest.fixture
def synced(monkeypatch):
    """Paths whose data was fsynced (through any fd) during the test."""
    paths: list[str] = []
    real = os.fsync

    def fsync(fd):
        paths.append(os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else str(fd))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return paths


@needs_ss
@pytest.mark.parametrize("kind", ["trainer", "engine"])
def test_a_killed_actor_is_named_and_the_run_resumes(
    kind, request, tmp_path, monkeypatch, log_messages, synced, _ray_for_the_session
):
    """SIGKILL policy b's actor (its engine, or rank 1 of its two trainer ranks) once b has trained
    two rollouts and a save is recorded. If the run hangs, a dead actor is not noticed; if it ends
    in a traceback or the line lacks "policy 'b': engine actor" / "trainer rank 1 actor", the user
    cannot tell what died; if the resume fails, the record written before
    the death is not usable. The trainer's death is in a run that started its own local cluster
    (which must listen on loopback only: Ray's default, every interface, exposes a cluster that
    runs any code sent to it; and be down afterwards, actor dead or not), and is resumed; the
    engine's in a run that joined the session's cluster (which must be left running, as `hpref rl`
    leaves any cluster it joined). Its resume would run the trainer kind's code again (the record,
    not the dead actor, says where to go on): ~20 s of the suite for nothing new.
    Also: rl.json, rl_summary.json and the metrics plot are written through a fsynced temporary
    file (a crash mid-write must leave the old file, not half of one), and a run without evals says
    why its leaderboard is empty."""
    own_cluster = kind == "trainer"
    request.getfixturevalue("without_ray" if own_cluster else "ray_cluster")
    assert ray.is_initialized() is not own_cluster
    run_dir = tmp_path / "arena"
    pids: dict[str, int] = {}
    real_create = driver.create_ray_actors

    def create(config, order, teardown, prompts=None, where="recipe"):
        handles = real_create(config, order, teardown, prompts, where)
        # the trainer: rank 1 of b's two-rank group (issue #36); the engine: b's one engine
        actor = handles.trainers["b"].ranks[1] if kind == "trainer" else handles.engines["b"]
        pids["b"] = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
        return handles

    monkeypatch.setattr(driver, "create_ray_actors", create)

    cluster: dict[str, object] = {}

    def killer():
        metrics = run_dir / "metrics" / "b.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            saved = read_record(run_dir) is not None
            if "b" in pids and saved and metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                if own_cluster:  # the live cluster this process started: GCS, raylet, actors' workers
                    cluster["processes"] = descendants(os.getpid())
                    cluster["listening"] = listening(cluster["processes"])
                os.kill(pids["b"], signal.SIGKILL)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    start = time.monotonic()
    b_ranks = 2 if kind == "trainer" else 1
    code = driver.run_rl(recipe(run_dir, 200, b_ranks), ["a", "b"])
    thread.join(timeout=5)
    assert code == 1
    assert time.monotonic() - start < 300
    lines = [m for m in log_messages if " died (" in m]
    assert len(lines) == 1, log_messages[-10:]
    assert f"policy 'b': {'trainer rank 1' if kind == 'trainer' else 'engine'} actor died" in lines[0]
    record = read_record(run_dir)
    assert record is not None and record.save_dir in lines[0] and "--resume auto" in lines[0]
    assert ray.is_initialized() is not own_cluster
    if kind == "engine":
        return
    assert pids["b"] in cluster["processes"]  # the tree holds the actors' workers
    assert any("gcs_server" in line for line in cluster["listening"]), cluster["listening"]
    assert not beyond_loopback(cluster["listening"]), "\n".join(beyond_loopback(cluster["listening"]))

    # the record, not the metrics, says where the run stands; resume runs two leader rollouts more.
    # It joins the tests' shared cluster (started here if it is not up yet, left up for the tests
    # after): the resume is checked here, a cluster's start and stop were checked above
    start_ray()
    stop = record.rollout_ids["a"] + 2
    assert driver.run_rl(recipe(run_dir, stop, b_ranks), ["a", "b"], resume="auto") == 0
    assert any("resumed from" in m and record.save_dir in m for m in log_messages)
    assert read_record(run_dir).rollout_ids["a"] == stop
    for name in ("rl.json", "rl_summary.json", "metrics/rewards.png"):
        target = run_dir / name
        temporary = str(target.parent / f".{target.name}.")  # write_bytes_atomic's temporary name
        assert any(p.startswith(temporary) for p in synced), (name, synced[-5:])
    # eval_interval = 0: no eval ran, so no leaderboard, and the run says why rather than leaving an
    # empty {} to be read as a failure (README: the leaderboard needs an eval)
    summary = json.loads((run_dir / "rl_summary.json").read_text())
    assert summary["leaderboard"] == {} and summary["leaderboard_by"] is None
    assert any(
        "no leaderboard in rl_summary.json: no eval ran (eval_interval = 0)" in m for m in log_messages
    )


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
    with pytest.raises(ray.exceptions.RayActorError):  # Ray knows it is dead (slow under load)
        ray.get(trainer.__ray_ready__.remote(), timeout=120)
    assert dead_actor(handles, names) == "policy 'a': trainer actor"
    for actor in (engine, executor):
        ray.kill(actor)
