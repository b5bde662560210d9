"""The driver with fake in-process actors: ordering, parking before saves, failures, triggers."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from hpref.recipe.rl import parse_rl_section
from hpref.rl.control.actors import Teardown
from hpref.rl.control.driver import Handles, drive, restore
from hpref.rl.control.record import ResumeError, read_record
from hpref.rl.report.metrics import rollout_metrics
from hpref.rl.rollout_types import rollout_of_tokens
from hpref.runfolder.layout import HEARTBEAT, SAVE_NOW
from tests.rl.local_actor import LocalActor


class World:
    """State the fakes share: who is training right now, and what each save saw."""

    def __init__(self):
        self.lock = threading.Lock()
        self.busy: set[str] = set()
        self.gets: dict[str, list[int]] = {}
        self.saves: list[dict] = []


class FakeExecutor:
    def __init__(self, world, fail_at=None, delays=None):
        self.world, self.fail_at, self.delays = world, fail_at, delays or {}
        self.positions = {}

    async def get(self, rollout_id, policy):
        await asyncio.sleep(self.delays.get(policy, 0.001))
        if (policy, rollout_id) == self.fail_at:
            raise ValueError(f"boom in {policy} at {rollout_id}")
        self.world.gets.setdefault(policy, []).append(rollout_id)
        self.positions[policy] = rollout_id + 1
        return rollout_of_tokens(rollout_id, [], [], [], [1.0, 0.0], 2, tokens=4, seconds=0.5)

    async def save(self, folder):
        with self.world.lock:
            self.world.saves.append({"busy": set(self.world.busy), "executor": dict(self.positions)})

    async def load(self, folder):
        return {}

    async def evaluate(self, policies):
        with self.world.lock:
            assert not self.world.busy
        battles = [(policies[0], policies[1], 0.75)] * 3 if len(policies) > 1 else []
        return {
            "true_utility": {p: 1.0 for p in policies},
            "battles": battles,
            "leaderboard_battles": battles,
        }


class FakeTrainer:
    def __init__(self, policy, world):
        self.policy, self.world, self.done, self.saved_at = policy, world, 0, None

    def train(self, rollout):
        with self.world.lock:
            self.world.busy.add(self.policy)
        time.sleep(0.003)
        with self.world.lock:
            self.world.busy.discard(self.policy)
        self.done += 1
        return {"loss": 0.0}

    def sync_version(self):
        return self.done

    def device_type(self):
        return "cpu"

    def open_weight_channel(self):
        return "127.0.0.1", 0

    def connect_weight_channel(self, host, port, device):
        pass

    def send_weights(self, bucket_bytes, dtype):
        yield from ()  # the fake engine takes no bytes

    def save(self, folder):
        self.saved_at = self.done

    def load(self, folder):
        return 0


class FakeEngine:
    def __init__(self):
        self.version, self._staging = 0, None

    def begin_update(self, v):
        self._staging = v

    def load_weights(self, state):
        pass

    def commit_update(self):
        self.version = self._staging
        return self.version

    def abort_update(self):
        self._staging = None

    def weight_dtype(self):
        return "float32"

    def weight_channel_device(self):
        return "cpu"

    def connect_weight_channel(self, host, port, device):
        pass


def make(world, order, **executor_kwargs):
    trainers = {p: FakeTrainer(p, world) for p in order}
    handles = Handles(
        LocalActor(FakeExecutor(world, **executor_kwargs)),
        {p: LocalActor(FakeEngine()) for p in order},
        {p: LocalActor(trainers[p]) for p in order},
    )
    return handles, trainers


def config(**over):
    data = {"num_rollouts": 4, "policies": {"a": {}, "b": {}, "c": {}}}
    data.update(over)
    return parse_rl_section(data, "test")


def run(coro, timeout=20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_leader_parks_everyone_before_each_save_and_records_where_each_stood(tmp_path):
    world = World()
    order = ["a", "b", "c"]
    handles, trainers = make(world, order, delays={"b": 0.0005, "c": 0.004})
    cfg = config(num_rollouts=6, save_interval=2, eval_interval=3)
    result = run(drive(cfg, order, handles, tmp_path, {p: 0 for p in order}))

    assert result.positions["a"] == 6 and result.saves == 3 and not result.debug_exit
    # no trainer was mid-step while the executor saved: everyone was parked
    assert [s["busy"] for s in world.saves] == [set(), set(), set()]
    record = read_record(tmp_path)
    assert record.leader == "a" and record.save_dir == "checkpoints/rollout-000006"
    # the final record holds each policy where its trainer and the executor stood, and followers did
    # not run on after the final save
    assert record.rollout_ids == {p: trainers[p].done for p in order} == result.positions
    assert world.saves[-1]["executor"] == record.rollout_ids
    # each policy drained only its own buffer, strictly in order
    for p in order:
        assert world.gets[p] == list(range(result.positions[p])), p
    assert [e["rollout"] for e in result.evals] == [3, 6]
    ratings = result.leaderboard(order)
    assert ratings["a"] > ratings["c"] > ratings["b"]  # a beat b; c played nobody and stays central


def test_a_failing_follower_ends_the_run_with_its_error(tmp_path):
    world = World()
    order = ["a", "b"]
    handles, trainers = make(world, order, fail_at=("b", 2))
    with pytest.raises(ValueError, match="boom in b at 2"):
        run(drive(config(num_rollouts=10_000), order, handles, tmp_path, {"a": 0, "b": 0}))
    assert trainers["a"].done < 10_000  # the leader was cancelled, not left running
    assert read_record(tmp_path) is None  # no save happened: nothing claims a consistent state


def test_the_trigger_file_is_handled_by_the_leader_once(tmp_path):
    world = World()
    order = ["a", "b"]
    handles, _ = make(world, order)
    (tmp_path / SAVE_NOW).write_text("")
    result = run(drive(config(num_rollouts=3), order, handles, tmp_path, {"a": 0, "b": 0}))
    assert result.saves == 2  # the trigger after rollout 1, then the final save
    assert not (tmp_path / SAVE_NOW).exists()


def test_debug_exit_saves_and_stops_everyone(tmp_path):
    world = World()
    order = ["a", "b"]
    handles, trainers = make(world, order)
    result = run(
        drive(config(num_rollouts=50, debug_exit_after_rollout=2), order, handles, tmp_path, {"a": 0, "b": 0})
    )
    assert result.debug_exit and result.positions["a"] == 2
    assert read_record(tmp_path).rollout_ids == {"a": 2, "b": trainers["b"].done}


def test_restore_of_a_fresh_run_and_of_a_missing_leader_part(tmp_path):
    world = World()
    handles, _ = make(world, ["a", "b"])
    starts, record = run(restore(handles, ["a", "b"], None))
    assert starts == {"a": 0, "b": 0} and record is None
    # a record exists but the fake trainers restore nothing: the leader would start fresh under a record
    # that says otherwise
    from hpref.rl.control.record import CheckpointRecord, write_record

    write_record(tmp_path, CheckpointRecord("a", {"a": 2, "b": 2}, "checkpoints/x"))
    with pytest.raises(ResumeError, match="policy 'a' restored rollout 0 but the checkpoint record says 2"):
        run(restore(handles, ["a", "b"], tmp_path))


def test_teardown_runs_in_reverse_and_survives_failures():
    calls = []
    td = Teardown()
    td.add("engine", lambda: calls.append("engine"))
    td.add("executor", lambda: (_ for _ in ()).throw(RuntimeError("dead")))
    td.add("trainer", lambda: calls.append("trainer"))
    assert td.close() == ["trainer", "executor", "engine"]
    assert calls == ["trainer", "engine"]


def test_rollout_metrics():
    row = rollout_metrics(
        rollout_of_tokens(
            3, [], [], [], [1.0, 3.0], 2, version=2, tokens=10, seconds=2.0, true_utility=[4, 0]
        ),
        {"kl": 0.1},
        3,
    )
    assert (row["reward_mean"], row["reward_std"], row["true_utility"]) == (2.0, 1.0, 2.0)
    assert (row["gen_tokens_per_s"], row["weight_version"], row["kl"]) == (5.0, 3, 0.1)
    json.dumps(row)


def test_resume_truncates_metrics_written_after_the_save(tmp_path):
    from hpref.rl.report.metrics import MetricsWriter, keep_row

    writer = MetricsWriter(tmp_path)
    for r in range(5):
        writer.write("a", {"rollout": r, "reward_mean": 0.0})
    writer.write("a", {"rollout": 3, "eval": True})
    writer.write("a", {"rollout": 4, "eval": True})
    # resuming at rollout 3: rows of rollouts 3 and 4 were trained after the save, and the eval at 4
    # came after it too; they would otherwise be counted twice
    assert writer.truncate("a", 3) == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "a.jsonl").read_text().splitlines()]
    assert [(r["rollout"], bool(r.get("eval"))) for r in rows] == [
        (0, False),
        (1, False),
        (2, False),
        (3, True),
    ]
    assert keep_row({"rollout": 2}, 3) and not keep_row({"rollout": 3}, 3)
    assert writer.truncate("missing", 0) == 0


def test_resume_source(tmp_path):
    from hpref.rl.control.record import CheckpointRecord, write_record
    from hpref.rl.launch import resume_source

    assert resume_source(tmp_path, None) is None  # fresh folder, fresh run
    assert resume_source(tmp_path, "auto") is None  # auto with nothing saved starts fresh
    with pytest.raises(ResumeError, match="no record.json there"):
        resume_source(tmp_path, str(tmp_path / "elsewhere"))
    write_record(tmp_path, CheckpointRecord("a", {"a": 1}))
    assert resume_source(tmp_path, "auto") == tmp_path
    assert resume_source(tmp_path / "new", str(tmp_path)) == tmp_path  # continue another run's save
    with pytest.raises(ResumeError, match="already holds a checkpoint record"):
        resume_source(tmp_path, None)


def test_a_failing_save_ends_the_run_and_writes_no_record(tmp_path):
    """The leader's save fails while every follower is parked: the error is the run's, the
    followers are released and cancelled (the run would hang otherwise), and no record claims the
    half-done save."""
    world = World()
    order = ["a", "b", "c"]
    handles, _ = make(world, order)

    async def broken_save(folder):
        raise OSError("disk full")

    handles.executor.wrapped.save = broken_save
    with pytest.raises(OSError, match="disk full"):
        run(drive(config(num_rollouts=10, save_interval=2), order, handles, tmp_path, {p: 0 for p in order}))
    assert read_record(tmp_path) is None


def test_keep_last_prunes_old_saves_but_never_the_recorded_one(tmp_path):
    # Wrong if pruning deleted the save a resume needs (the record's), kept more than asked, or
    # touched anything outside checkpoints/rollout-*.
    from hpref.rl.control.driver import prune_checkpoints
    from hpref.rl.control.record import CheckpointRecord

    root = tmp_path / "checkpoints"
    for r in (2, 4, 6, 8):
        (root / f"rollout-{r:06d}" / "a").mkdir(parents=True)
    (root / "notes.txt").write_text("mine")
    # resumed from rollout 4 into this folder: the record points at an older save than the newest
    record = CheckpointRecord("a", {"a": 4}, save_dir="checkpoints/rollout-000004")
    assert prune_checkpoints(tmp_path, 1, record) == ["rollout-000002", "rollout-000006"]
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt", "rollout-000004", "rollout-000008"]


def test_eval_rows_carry_the_win_rate_against_the_start(tmp_path):
    # Wrong if the leader skipped the eval at the last rollout (the number a run is judged by) or
    # the win rate against the start did not reach metrics.jsonl.
    from hpref.rl.report.metrics import MetricsWriter

    class WinRateExecutor(FakeExecutor):
        async def evaluate(self, policies):
            out = await super().evaluate(policies)
            out["win_rate_vs_start"] = {p: 0.625 for p in policies}
            out["true_utility"].update({f"{p}@start": 0.5 for p in policies})
            return out

    world = World()
    handles, _ = make(world, ["a", "b"])
    handles.executor = LocalActor(WinRateExecutor(world))
    metrics = MetricsWriter(tmp_path)
    cfg = config(num_rollouts=5, eval_interval=3)
    result = run(drive(cfg, ["a", "b"], handles, tmp_path, {"a": 0, "b": 0}, metrics))
    assert [e["rollout"] for e in result.evals] == [3, 5]  # every 3 rollouts, and at the end
    evals = [r for r in metrics.rows["a"] if r.get("eval")]
    assert [(r["eval_win_rate_vs_start"], r["eval_start_true_utility"]) for r in evals] == [(0.625, 0.5)] * 2


def test_time_limit_ends_the_leader_with_a_final_eval_and_save(tmp_path):
    # Wrong if the limit were ignored, or the run ended without the save and eval a finished run
    # gets (then "what did it reach within N minutes" could not be read off the run).
    world = World()
    handles, _ = make(world, ["a", "b"], delays={"a": 0.02})
    cfg = config(num_rollouts=1000, eval_interval=500, time_limit_s=0.3)
    result = run(drive(cfg, ["a", "b"], handles, tmp_path, {"a": 0, "b": 0}))
    assert result.timed_out and 3 <= result.positions["a"] < 1000
    assert result.saves == 1 and read_record(tmp_path).rollout_ids["a"] == result.positions["a"]
    assert [e["rollout"] for e in result.evals] == [result.positions["a"]]


def test_the_leader_beats_while_the_policies_run_and_stops_at_the_end(tmp_path, monkeypatch):
    """`hpref save --now` asks only a live run: the driver writes `heartbeat.json` while the
    policies run (the leader's position as its step), and removes it when they stop."""
    from hpref.rl.control import driver
    from hpref.runfolder.heartbeat import run_status, write_heartbeat

    beats = []

    def spy(run_dir, step):
        write_heartbeat(run_dir, step)
        beats.append((step, run_status(run_dir)[0]))

    monkeypatch.setattr(driver, "write_heartbeat", spy)
    world = World()
    order = ["a", "b"]
    handles, _ = make(world, order)
    run(drive(config(num_rollouts=3), order, handles, tmp_path, {"a": 0, "b": 0}))
    assert beats and beats[0] == (0, True)  # alive from the start
    assert not (tmp_path / HEARTBEAT).exists()  # and no longer once the policies stopped


# --- the driver's parts alone (`Driver.step`, `evaluate`, `after_rollout`, `follow`)


def driver_of(tmp_path, order, **over):
    from hpref.rl.control.driver import Driver
    from hpref.rl.report.metrics import MetricsWriter

    world = World()
    handles, trainers = make(world, order)
    cfg = config(policies={p: {} for p in order}, **over)
    return Driver(cfg, order, handles, tmp_path, {p: 0 for p in order}, MetricsWriter(tmp_path)), trainers


def test_step_trains_one_rollout_pushes_weights_when_due_and_writes_its_row(tmp_path):
    """Two steps of one policy at `update_weights_interval = 2`: the position advances one rollout a
    step, the engine gets the trainer's weights after the second step only, and each step writes one
    row naming its rollout and the version it pushed (none after the first). If this fails, a step
    trains twice or skips, pushes on the wrong rollout, or loses its metrics row."""
    drv, trainers = driver_of(tmp_path, ["a"], update_weights_interval=2)
    engine = drv.handles.engines["a"]
    run(drv.step("a"))
    assert drv.positions["a"] == 1 and trainers["a"].done == 1 and engine.wrapped.version == 0
    run(drv.step("a"))
    assert drv.positions["a"] == 2 and trainers["a"].done == 2 and engine.wrapped.version == 2
    rows = drv.metrics.rows["a"]
    assert [r["rollout"] for r in rows] == [0, 1]
    assert [r.get("weight_version") for r in rows] == [None, 2]
    assert all(r["elapsed_s"] >= 0 for r in rows)


def test_evaluate_writes_a_row_per_policy_with_the_kl_since_the_last_eval(tmp_path):
    """An eval after the policies moved: one eval row per policy at its own position, each with the
    mean KL of its rollouts since the last eval, which then starts again. If this fails, an eval row
    is lost or misplaced, or a policy's KL leaks into the next eval."""
    drv, _ = driver_of(tmp_path, ["a", "b"])
    drv.positions.update(a=4, b=6)
    drv.kl_since_eval["a"].extend([0.1, 0.3])
    run(drv.evaluate())
    assert drv.result.evals[-1]["rollout"] == 4
    assert drv.result.evals[-1]["kl"] == {"a": pytest.approx(0.2)}
    rows = {p: drv.metrics.rows[p][-1] for p in ("a", "b")}
    assert rows["a"]["rollout"] == 4 and rows["b"]["rollout"] == 6
    assert rows["a"]["eval"] and rows["b"]["eval"]
    assert drv.kl_since_eval == {"a": [], "b": []}


def test_after_the_last_leader_rollout_the_leader_evaluates_saves_and_stops_the_followers(tmp_path):
    """At the leader's last rollout: its eval, one save recording where it stands, the stop set
    (followers end where the save recorded them); the run ends by its rollout count, not by a signal,
    a debug exit or the clock. Before the last rollout, with nothing due, nothing happens. (With
    followers the leader parks them first: test_leader_parks_everyone_before_each_save_...) If this
    fails, the final save or eval is skipped or made twice, or the followers run on."""
    drv, _ = driver_of(tmp_path, ["a"], num_rollouts=3, save_interval=0, eval_interval=5)
    drv.positions["a"] = 2
    assert run(drv.after_rollout()) is False
    assert drv.result.saves == 0 and not drv.stop.is_set() and read_record(tmp_path) is None
    drv.positions["a"] = 3
    assert run(drv.after_rollout()) is False
    assert drv.result.saves == 1 and drv.stop.is_set() and [e["rollout"] for e in drv.result.evals] == [3]
    assert read_record(tmp_path).rollout_ids == {"a": 3}
    assert not (drv.result.debug_exit or drv.result.timed_out or drv.result.stopped_by)


def test_after_rollout_ends_the_run_at_the_debug_exit_and_at_the_time_limit(tmp_path):
    """`debug_exit_after_rollout` and `time_limit_s` each end the leader's loop after a save, and the
    result says which. If this fails, a debug exit runs on, or a timed-out run ends without its save."""
    drv, _ = driver_of(tmp_path, ["a"], num_rollouts=10, debug_exit_after_rollout=2)
    drv.positions["a"] = 2
    assert run(drv.after_rollout()) is True
    assert drv.result.debug_exit and drv.result.saves == 1
    drv, _ = driver_of(tmp_path / "t", ["a"], num_rollouts=10, time_limit_s=0.001)
    drv.positions["a"] = 1
    drv.began -= 1.0  # a second into the run: past its limit
    assert run(drv.after_rollout()) is True
    assert drv.result.timed_out and drv.result.saves == 1


def test_a_follower_steps_until_the_stop_and_leaves_its_parkers(tmp_path):
    """A follower runs rollouts while the leader has not stopped, and once stopped it steps no more
    and leaves both parkers (a later hold does not wait for it). If this fails, a follower trains
    past the final save, or a save after it ended waits for it until `park_timeout`."""
    drv, trainers = driver_of(tmp_path, ["a", "b"])

    async def two_steps_then_stop():
        follower = asyncio.ensure_future(drv.follow("b"))
        while trainers["b"].done < 2:
            await asyncio.sleep(0.001)
        drv.stop.set()
        await follower
        async with drv.save_parker.hold(1.0):  # nobody left to park: returns at once
            pass

    run(two_steps_then_stop())
    done = trainers["b"].done
    assert done >= 2 and drv.positions["b"] == done


def test_a_frozen_policy_acts_and_never_learns_and_a_schedule_gives_turns(tmp_path):
    """`train = false` on b: its rollouts are taken and logged (`learned: false`), its trainer never
    steps and its engine never gets weights, while a learns every rollout. `[rl.schedule] alternate
    = 2` on two learning policies: a learns at its rollouts 0, 1, 4, 5, b at 2, 3, 6, 7, and each
    pushes what it learned when its turn ends (its engine then serves it while it acts frozen).
    Wrong: a frozen opponent drifting, or a turn's weights never reaching the engine."""
    from hpref.recipe.rl import parse_rl_section

    drv, trainers = driver_of(tmp_path, ["a", "b"])
    drv.config = parse_rl_section({"policies": {"a": {}, "b": {"train": False}}}, "test")
    for _ in range(3):
        run(drv.step("a"))
        run(drv.step("b"))
    assert trainers["a"].done == 3 and trainers["b"].done == 0
    assert drv.handles.engines["b"].wrapped.version == 0 and drv.handles.engines["a"].wrapped.version == 3
    assert [r.get("learned", True) for r in drv.metrics.rows["b"]] == [False] * 3

    drv, trainers = driver_of(tmp_path / "turns", ["a", "b"])
    schedule = {"policies": {"a": {}, "b": {}}, "schedule": {"alternate": 3}, "update_weights_interval": 2}
    drv.config = parse_rl_section(schedule, "test")
    learned = {"a": [], "b": []}
    for r in range(9):
        for p in ("a", "b"):
            before = trainers[p].done
            run(drv.step(p))
            if trainers[p].done > before:
                learned[p].append(r)
    assert learned == {"a": [0, 1, 2, 6, 7, 8], "b": [3, 4, 5]}
    # pushed when due (every 2nd rollout) and when its turn ends, never while it acts frozen
    assert [r.get("weight_version") for r in drv.metrics.rows["a"]] == [
        None,
        2,
        3,
        None,
        None,
        None,
        None,
        5,
        6,
    ]
    assert [r.get("weight_version") for r in drv.metrics.rows["b"]] == [None] * 3 + [1, None, 3] + [None] * 3


def test_a_run_where_nothing_learns_is_refused(tmp_path):
    """Every policy the run trains frozen: one line before any actor starts."""
    from hpref.errors import RecipeError
    from hpref.rl.control.preflight import check_cast

    cfg = config(policies={"a": {"train": False}, "b": {}})
    with pytest.raises(
        RecipeError, match=r"rl.policies: every policy this run trains \(a\) has train = false"
    ):
        check_cast(cfg, ["a"], "r.toml")
    check_cast(cfg, ["a", "b"], "r.toml")  # b learns: fine


def test_policies_that_play_together_never_start_a_rollout_while_a_partner_pushes(tmp_path):
    """Two policies in one episode (`signal` roles), each push slow: no policy takes a rollout (whose
    prefetch starts the next joint rollout's episodes) while its partner's push is under way, so a
    partner's turns in them come from the weights it had before or after its push always the same
    way, never as timing has it. Wrong if `Driver.ahead` let a policy go once its partner had
    trained, before the partner's weights reached its engine: a resumed run then replays the
    episodes with other weights than the run never stopped (#50 point 6)."""
    world = World()
    pushing: set[str] = set()
    taken: list[tuple[str, int, set[str]]] = []

    class SeatedExecutor(FakeExecutor):
        async def get(self, rollout_id, policy):
            with world.lock:
                taken.append((policy, rollout_id, pushing - {policy}))
            return await super().get(rollout_id, policy)

        async def settle(self, policy):
            pass

    class SlowPush(FakeEngine):
        def __init__(self, policy):
            super().__init__()
            self.policy = policy

        def begin_update(self, v):
            with world.lock:
                pushing.add(self.policy)
            super().begin_update(v)

        def commit_update(self):
            time.sleep(0.03)  # longer than a waiting partner's poll (LOCKSTEP_POLL_S)
            with world.lock:
                pushing.discard(self.policy)
            return super().commit_update()

    order = ["a", "b"]
    handles = Handles(
        LocalActor(SeatedExecutor(world)),
        {p: LocalActor(SlowPush(p)) for p in order},
        {p: LocalActor(FakeTrainer(p, world)) for p in order},
    )
    roles = {"name": "signal", "roles": {"speaker": "a", "listener": "b"}}
    cfg = config(num_rollouts=6, policies={"a": {}, "b": {}}, environment=roles)
    run(drive(cfg, order, handles, tmp_path, {"a": 0, "b": 0}))
    assert sum(p == "a" for p, _, _ in taken) == 6 and sum(p == "b" for p, _, _ in taken) >= 5
    assert [(p, r) for p, r, partners in taken if partners] == []
