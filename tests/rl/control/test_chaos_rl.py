"""`hpref rl` killed twice and resumed, compared bit for bit with a run never killed: the suite's
short version of benchmarks/chaos_rl.py, through its own functions, on policies that meet (the
`signal` game: every episode is both policies', so a kill lands in the middle of their joint
rollouts)."""

from __future__ import annotations

import argparse
import json
import os
import re
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")
ray = pytest.importorskip("ray")

from benchmarks import chaos_rl  # noqa: E402

from tests.conftest import REPO, run_hpref_here  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402

pytestmark = pytest.mark.slow

#: the seed of the kill plan (benchmarks/chaos_rl.py's --seed): the delays and which rank dies
SEED = 47
ROLLOUTS = 12


def write_recipe(folder: Path) -> Path:
    """Two LoRA policies playing `signal` (a speaks, b listens; the game scores its episodes), a's
    trainer group two ranks (FSDP2 over gloo); the run's name, folder, rollouts and saves are
    chaos_rl's `--set`s."""
    model = ", ".join(f"{k} = {v}" for k, v in TINY.items())
    path = folder / "chaos-rl.toml"
    path.write_text(
        textwrap.dedent(f"""
        [rl]
        [rl.rollout]
        group_size = 2
        prompts_per_rollout = 2
        max_new_tokens = 1

        [rl.reward]
        name = "rule"  # read by no one: signal scores its episodes itself

        [rl.environment]
        name = "signal"
        names = ["A", "B"]
        roles = {{ speaker = "a", listener = "b" }}

        [rl.defaults]
        lr = 1e-3
        model = {{ {model} }}
        lora = {{ r = 4 }}

        [rl.policies.a]
        ranks = 2

        [rl.policies.b]
        model = {{ seed = 1 }}
        """)
    )
    return path


def reference_here(args: argparse.Namespace) -> dict:
    """`chaos_rl.reference`, its `hpref rl` run through the CLI's own entry point in this process
    (it joins the session's cluster, already up here) instead of a new one: the reference is
    never killed, so nothing about its process is under test, and a new interpreter's imports and
    teardown cost ~8 s. The same command line, cache and home as the benchmark's, its console
    where `chaos_rl.check` reads the `saved` lines of a run, and the benchmark's check that the
    run's actors all ended after it. Its engines are actors of their own (`rl.engines_in_executor =
    false`), and so is its executor, where the chaos runs' engines are in their rollout executor and
    the executor in the driver's process (the CPU defaults): the final saves compared bit for bit
    then also show that hosting the engines, and the executor in the driver, change nothing."""
    started = time.monotonic()
    command = chaos_rl.rl_command(args, "ref", resume=False) + ["--set", "rl.engines_in_executor=false"]
    assert command[: len(chaos_rl.HPREF)] == chaos_rl.HPREF
    with pytest.MonkeyPatch.context() as env:
        for name, value in chaos_rl.run_env(args.work, args.cache).items():
            if name.startswith("HPREF_"):
                env.setenv(name, value)
        result = run_hpref_here(*command[len(chaos_rl.HPREF) :], cwd=REPO)
    log = args.work / "logs" / "ref-0.stderr"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(result.stderr)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((args.work / "runs" / "ref" / "rl_summary.json").read_text())
    deadline = time.monotonic() + 15  # the benchmark's grace for a run's actors to end
    while (left := actors_of_the_session()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return {
        "wall_s": time.monotonic() - started,
        "drive_s": summary["drive_s"],
        "setup_s": summary["setup_s"],
        "positions": summary["positions"],
        "left_behind": [f"{pid} {title[:60]}" for pid, title in left],
    }


def actors_of_the_session() -> list[tuple[int, str]]:
    """hpref's actor processes in the session's cluster (this process's descendants)."""
    import psutil
    from benchmarks.common import tree_pids

    found = []
    for pid in tree_pids(os.getpid()):
        try:
            title = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if title.startswith(tuple(chaos_rl.TITLES.values())):
            found.append((pid, title))
    return found


def test_rl_killed_twice_resumes_to_the_reference_bit_for_bit(ray_cluster, tmp_path, monkeypatch):
    """One `hpref rl` run of two policies that meet SIGKILLed twice at seeded random moments, each resumed
    with `--resume auto`: first a trainer actor (a rank of a's two-rank group, or b's one; once a save is
    recorded), which the run's one line must name with the save `--resume auto` continues from, then the
    driver (`hpref rl` itself). Each policy's final save must equal the unkilled run's tensor for tensor
    (the adapter's weights and every AdamW moment), every rollout trained exactly once, weight versions
    rising by one, the trainer's step counts at the record's position, and no actor left behind. The
    reference's engines and executor are actors of their own, the chaos runs' engines are in their
    executor, in the driver's process (`reference_here`). If this fails, a resume does not restore the
    adapter or its optimizer state exactly (or regenerates a rollout from other weights), engines hosted
    in the executor, or the executor in the driver, generate or sync otherwise than actors do, a dead rank
    is not noticed (a hang) or not named (a traceback, a line blaming the survivor), the driver's actors
    outlive it, or a rollout is replayed or skipped. Runs join the suite's cluster (no cluster start per
    run); the unkilled reference runs in this process (`reference_here`)."""
    args = argparse.Namespace(
        work=tmp_path,
        cache=Path(os.environ["HPREF_CACHE"]),
        recipe=str(write_recipe(tmp_path)),
        sets={},
        policies=["a", "b"],
        targets=["trainer", "leader"],
        kills=2,
        seed=SEED,
        rollouts=ROLLOUTS,
        staleness=None,
        kill_after=2,  # the first kill once rollout 2 is trained: a save is recorded by then
        slot_s=0.4,  # each kill 0.02-0.5 s after that, or a resume's first new rollout (~0.5 s each)
        stall_s=300.0,
        exit_timeout=120.0,
        run_timeout=600.0,
        ray_address=ray.get_runtime_context().gcs_address,
        cluster_root=os.getpid(),  # the suite's cluster is this process's: its actors are below it
    )
    monkeypatch.setattr(chaos_rl, "reference", reference_here)
    result = chaos_rl.run(args)
    assert result["reference"]["positions"]["a"] == ROLLOUTS  # the reference ran here, whole
    assert chaos_rl.failures(result) == [], chaos_rl.table(result)
    trainer, driver = result["kills"]
    assert trainer["target"] == "trainer" and driver["target"] == "leader"
    # one line naming what died and where the resume goes on (was test_actor_death's [trainer] run)
    died = re.fullmatch(
        r"policy '([ab])': trainer (?:rank [01] )?actor died \([^()]+\); the run stopped; --resume auto "
        r"continues from (checkpoints/rollout-\d{6}) \(.*record\.json\)",
        trainer["message"],
    )
    assert trainer["exit_code"] == 1 and died is not None, trainer
    assert (tmp_path / "runs" / "chaos" / died.group(2) / died.group(1) / "trainer.pt").is_file()
    assert driver["exit_code"] == -9
    for policy in ("a", "b"):  # both players of every episode, each compared with its unkilled self
        final = result["checks"][policy]["final_weights"]
        # LoRA r=4 on TINY's seven linears: 14 adapter matrices, each with AdamW's step and two moments
        assert final["equal"] is True and final["tensors"] >= 14 * 3, (policy, final)
    assert result["checks"]["a"]["final_weights"]["position"] == ROLLOUTS
    assert result["checks"]["a"]["rows"] == ROLLOUTS
