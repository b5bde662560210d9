"""Chaos benchmark for `hpref rl` (issue #41 item 3): kill -9 a live two-policy run N times, resume it
with `--resume auto` each time, and check the result against a run that was never killed.

    .venv/bin/python -m benchmarks.chaos_rl [--kills 5] [--seed S] [--model tiny|smollm2]
        [--rollouts N] [--staleness K] --work DIR --out FILE.json

- **Reference**: the shipped two-policy recipe (`rl-arena`: two tiny policies with their warm-ups;
  `rl-smollm2`: two SmolLM2 LoRA policies), `save_interval = 1`, no evals, every save kept, run once
  as a user runs it (`hpref rl` in its own process, session and local Ray cluster, a private
  `HPREF_HOME`, no `RAY_` variables).
- **Chaos**: the same recipe and seeds under another run name. Once the (re)started run has trained its
  first new leader rollout, a seeded RNG draws a delay and a target: a rollout engine actor
  (`ray::EngineHost`; where `engine` may be drawn, both runs set `rl.engines_in_executor = false`, as CPU
  engines otherwise live in the executor's process), a policy trainer actor (`ray::TrainerActor`), the
  reward actor (the rollout executor, `ray::RolloutExecutor`, which holds the reward; where `reward` may
  be drawn, both runs set `rl.executor_in_driver = false`, as a CPU run's executor otherwise lives in the
  driver) or the leader's driver (`hpref rl`, its whole process group). Actors are found by their Ray
  process titles among the processes of the run's own session (so other runs on the machine are never
  touched) and get SIGKILL. The run must then end by itself (exit code and its one ERROR line are kept)
  and is restarted with `--resume auto`; recovery is the time from the restart to the first leader rollout
  past the last one trained before the run stopped (`metrics/<leader>.jsonl`).
- **Checks**: every rollout id exactly once per policy in `metrics/<policy>.jsonl`, weight versions
  rising by one, each trainer's step count (`trainer.pt`: rollouts done, version, AdamW steps) equal
  to the record's position, no Ray process left behind after a run ended, and the final save of each
  policy equal to the reference's save at the same position (a follower, which runs free: the newest
  position both runs saved), tensor by tensor (weights, AdamW moments). Where the numbers part, the
  first rollout that differs per policy (data version, loss, reward) is named with the kill whose
  resume regenerated it. Output: JSON (`--out`), a markdown table.
- **Verdict** (`failures`, exit 1 unless empty): every kill asked struck, no hang, nothing left
  behind, the run completed, the record consistent, and every policy's final save compared and
  equal. Nothing compared is a failure that says what was not compared (a policy with no position
  both runs saved, a save with no tensor), never a pass.

The suite's short version (tests/rl/control/test_chaos_rl.py) imports `reference`, `chaos`, `check` and
`failures` with its own recipe, policies and kill targets in turn (`args.targets`), its runs joined
to the suite's Ray cluster (`args.ray_address`; actors found under `args.cluster_root`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, tree_pids, write_json

HPREF = [sys.executable, "-m", "hpref"]
POLICIES = ["a", "b"]
LEADER = POLICIES[0]
KINDS = ("engine", "trainer", "reward", "leader")
TITLES = {"engine": "ray::EngineHost", "trainer": "ray::TrainerActor", "reward": "ray::RolloutExecutor"}
MODELS: dict[str, dict[str, Any]] = {
    # ~0.3 s per leader rollout with a save each on 2 cores; the warm-ups train once (~40 s)
    "tiny": {"recipe": "rl-arena", "rollouts": 300, "sets": {}},
    # ~70 s per leader rollout on 2 busy cores with 4 prompts a rollout (the recipe's 8: ~65 s quiet)
    "smollm2": {"recipe": "rl-smollm2", "rollouts": 3, "sets": {"rl.rollout.prompts_per_rollout": 4}},
}
COMPARED = ("data_version", "weight_version", "gen_tokens", "reward_mean", "loss", "grad_norm")
ERROR_LINE = re.compile(r"^\d\d:\d\d:\d\d ERROR\s+(.*)$")
SAVED_LINE = re.compile(r"saved checkpoints/(rollout-\d+): (.*)$")


def run_env(work: Path, cache: Path) -> dict[str, str]:
    """No session Ray address (the run starts its own cluster), a private hpref home and cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HPREF_HOME=str(work / "home"), HPREF_CACHE=str(cache))
    return env


def rl_command(args: argparse.Namespace, name: str, resume: bool) -> list[str]:
    """`hpref rl` of `args.recipe` (a shipped name or a file) for `args.policies`, with `args.sets`."""
    sets = {
        "run.name": json.dumps(name),
        "run.output_dir": json.dumps(str(args.work / "runs")),
        "rl.num_rollouts": args.rollouts,
        "rl.save_interval": 1,
        "rl.eval_interval": 0,
        "rl.keep_last": 0,
        **args.sets,
    }
    if args.staleness is not None:
        sets["rl.staleness_limit"] = args.staleness
    targets = getattr(args, "targets", None)  # None: drawn from KINDS, `engine` among them
    if targets is None or "engine" in targets:  # engine actors to kill, in the reference too
        sets["rl.engines_in_executor"] = "false"
    if targets is None or "reward" in targets:  # an executor actor to kill (CPU runs keep it in the driver)
        sets["rl.executor_in_driver"] = "false"
    cmd = [*HPREF, "rl", args.recipe, "--policies", ",".join(args.policies)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    if args.ray_address:
        cmd += ["--ray-address", args.ray_address]
    return cmd + (["--resume", "auto"] if resume else [])


class Segment:
    """One `hpref rl` process of a run (its own session: `os.getsid(p) == pid` for all it started)."""

    def __init__(self, args: argparse.Namespace, name: str, index: int, resume: bool) -> None:
        self.cluster_root = args.cluster_root  # a joined cluster's actors are its processes, not ours
        self.log = args.work / "logs" / f"{name}-{index}.stderr"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        with open(self.log, "w") as stderr:  # a file, not a pipe: a full pipe would stall the run
            self.proc = subprocess.Popen(
                rl_command(args, name, resume),
                cwd=REPO,  # the smollm2 recipe's paths (../shared, runs/...) are relative to the repo
                env=run_env(args.work, args.cache),
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def session(self) -> list[Any]:
        """The live (non-zombie) processes of this run's session: driver, Ray daemons, actors."""
        import psutil

        out = []
        for p in psutil.process_iter(["pid", "status"]):
            with contextlib.suppress(OSError, psutil.Error):
                if os.getsid(p.pid) == self.proc.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def cluster(self) -> list[Any]:
        """The live processes of the joined cluster (`cluster_root`'s tree), none for our own."""
        import psutil

        out = []
        for pid in tree_pids(self.cluster_root) if self.cluster_root else []:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def actors(self, kind: str) -> list[tuple[int, str]]:
        import psutil

        found = []
        for p in self.session() + self.cluster():
            with contextlib.suppress(psutil.Error):
                title = " ".join(p.cmdline())
                if title.startswith(TITLES[kind]):
                    found.append((p.pid, title))
        return sorted(found)

    def message(self) -> str:
        """The run's one-line error (hpref's ERROR line), else its last line."""
        lines = [x.strip() for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        errors = [m.group(1) for x in lines if (m := ERROR_LINE.match(x))]
        return errors[-1] if errors else (lines[-1][:300] if lines else "")

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def left_behind(self, grace: float = 15.0) -> list[str]:
        """Processes of the session still alive `grace` s after the driver ended (then killed)."""
        import psutil

        deadline = time.monotonic() + grace
        while (left := self.session() + self.run_actors()) and time.monotonic() < deadline:
            time.sleep(0.5)
        names = []
        for p in left:
            with contextlib.suppress(psutil.Error):
                names.append(f"{p.pid} {' '.join(p.cmdline())[:60]}")
                p.kill()
        return names

    def run_actors(self) -> list[Any]:
        """A joined cluster's processes that hold one of the run's actors (its daemons and idle
        workers are the cluster's, not the run's)."""
        import psutil

        out = []
        for p in self.cluster():
            with contextlib.suppress(psutil.Error):
                if " ".join(p.cmdline()).startswith(tuple(TITLES.values())):
                    out.append(p)
        return out

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def trained_rows(run_dir: Path, policy: str) -> list[dict[str, Any]]:
    """The training rows of `metrics/<policy>.jsonl` (a last line cut by a kill is dropped)."""
    path = run_dir / "metrics" / f"{policy}.jsonl"
    rows = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if not row.get("eval"):
                    rows.append(row)
    return rows


def last_rollout(run_dir: Path, leader: str = LEADER) -> int:
    """The leader's newest trained rollout id in its metrics (-1: none)."""
    return max((r["rollout"] for r in trained_rows(run_dir, leader)), default=-1)


def record_of(run_dir: Path) -> dict[str, Any] | None:
    with contextlib.suppress(FileNotFoundError, ValueError):
        return json.loads((run_dir / "record.json").read_text())
    return None


def wait_past(segment: Segment, run_dir: Path, rollout: int, stall_s: float, leader: str) -> float | None:
    """Seconds from the segment's start until the leader trains a rollout past `rollout`; None when
    the process ended first or nothing came within `stall_s`."""
    deadline = time.monotonic() + stall_s
    while time.monotonic() < deadline:
        if last_rollout(run_dir, leader) > rollout:
            return time.monotonic() - segment.started
        if not segment.alive():
            return None
        time.sleep(0.1)
    return None


def reference(args: argparse.Namespace) -> dict[str, Any]:
    segment = Segment(args, "ref", 0, resume=False)
    code = segment.wait(args.run_timeout)
    if code is None:
        segment.kill_group()
        raise SystemExit(f"the reference run did not end within {args.run_timeout} s ({segment.log})")
    if code != 0:
        raise SystemExit(f"the reference run failed (exit {code}): {segment.message()} ({segment.log})")
    summary = json.loads((args.work / "runs" / "ref" / "rl_summary.json").read_text())
    return {
        "wall_s": time.monotonic() - segment.started,
        "drive_s": summary["drive_s"],
        "setup_s": summary["setup_s"],
        "positions": summary["positions"],
        "left_behind": segment.left_behind(),
    }


def chaos(args: argparse.Namespace, slot_s: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The killed run: `args.kills` kills, each followed by a `--resume auto` restart. Each kill's
    target is drawn from KINDS, or taken in turn from `args.targets` when given."""
    rng = random.Random(args.seed)
    run_dir, leader = args.work / "runs" / "chaos", args.policies[0]
    began = time.monotonic()
    segment = Segment(args, "chaos", 0, resume=False)
    kills: list[dict[str, Any]] = []
    # the first kill: once the leader trained a rollout past `kill_after` (-1: its first; later, a
    # save is recorded: a kill before any save tests a fresh start, not a resume)
    wait_past(segment, run_dir, args.kill_after, args.stall_s, leader)
    while len(kills) < args.kills and segment.alive():
        # drawn before anything is looked at, so the schedule depends on the seed alone
        delay, kind = rng.uniform(0.05, 1.2) * slot_s, rng.choice(KINDS)
        kind = args.targets[len(kills)] if args.targets else kind
        time.sleep(delay)
        if not segment.alive():
            break
        victims = segment.actors(kind) if kind != "leader" else [(segment.proc.pid, "hpref rl")]
        if not victims:
            continue
        pid, title = rng.choice(victims)
        killed_at = last_rollout(run_dir, leader)
        record = record_of(run_dir) or {}
        kill = {
            "target": kind,
            "pid": pid,
            "title": title[:60],
            "leader_rollout": killed_at,  # the newest it had trained when the kill landed
            "record_at": record.get("rollout_ids"),
            "seconds_into_run": round(time.monotonic() - began, 2),
            "delay_s": round(delay, 2),
            "load": os.getloadavg()[0],
        }
        if kind == "leader":
            segment.kill_group()
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        code = segment.wait(args.exit_timeout)
        if code is None:  # the driver did not notice: a hang
            kill["hang"] = f"hpref rl still running {args.exit_timeout} s after the kill"
            segment.kill_group()
            code = segment.wait(30)
        kill.update(
            exit_code=code,
            ended_s=round(time.monotonic() - began - kill["seconds_into_run"], 2),
            message="SIGKILL of the driver's process group"
            if kind == "leader"
            else ("it had finished (exit 0) before it noticed" if code == 0 else segment.message()),
            left_behind=segment.left_behind(),
        )
        resumed = record_of(run_dir)
        kill["resumed_from"] = resumed["rollout_ids"] if resumed else None
        # the leader may finish a rollout between the kill and the run's end: recovery is to the
        # first rollout past the last one it trained
        kill["stopped_at"] = stopped = last_rollout(run_dir, leader)
        kills.append(kill)
        print(f"kill {len(kills)}: {kind} at leader rollout {killed_at}: exit {code}: {kill['message'][:99]}")
        segment = Segment(args, "chaos", len(kills), resume=True)
        kill["recovery_s"] = wait_past(segment, run_dir, stopped, args.stall_s, leader)
        if kill["recovery_s"] is None and segment.alive():
            kill["hang"] = f"no leader rollout past {stopped} within {args.stall_s} s of the restart"
            segment.kill_group()
    code = segment.wait(args.run_timeout)
    if code is None:
        segment.kill_group()
    end = {
        "exit_code": code,
        "message": segment.message() if code else "",
        "wall_s": time.monotonic() - began,
        "left_behind": segment.left_behind(),
    }
    return kills, end


def saved_positions(run: str, args: argparse.Namespace) -> dict[tuple[str, int], str]:
    """(policy, position) -> the save folder holding it, from the run's `saved ...` console lines
    (a folder saved again after a resume holds what its last `saved` line says)."""
    folders: dict[str, str] = {}
    for log in sorted((args.work / "logs").glob(f"{run}-*.stderr"), key=lambda p: int(p.stem.split("-")[-1])):
        for line in log.read_text(errors="replace").splitlines():
            if m := SAVED_LINE.search(line):
                folders[m.group(1)] = m.group(2)
    out = {}
    for folder, positions in sorted(folders.items()):
        for part in positions.split(", "):
            policy, _, position = part.partition(" at rollout ")
            out[(policy, int(position))] = folder
    return out


def tensors(folder: Path) -> dict[str, Any]:
    """Every tensor of a policy's save: its safetensors files and AdamW's moments in trainer.pt."""
    import torch
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for path in sorted(folder.rglob("*.safetensors")):
        rel = path.relative_to(folder).as_posix()
        out.update({f"{rel}:{k}": v for k, v in load_file(str(path)).items()})
    state = torch.load(folder / "trainer.pt", weights_only=True, map_location="cpu")
    for index, moments in state["optimizer"]["state"].items():
        for key, value in moments.items():
            out[f"trainer.pt:optimizer.{index}.{key}"] = value
    return out


def compare_saves(ours: Path, theirs: Path) -> dict[str, Any]:
    import torch

    a, b = tensors(ours), tensors(theirs)
    differ = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            differ.append({"tensor": key, "missing_in": "chaos" if key not in a else "reference"})
        elif a[key].shape != b[key].shape or not torch.equal(a[key], b[key]):
            gap = (
                (a[key].double() - b[key].double()).abs().max().item()
                if a[key].shape == b[key].shape
                else None
            )
            differ.append({"tensor": key, "max_abs_diff": gap})
    if not a:  # no tensor on either side is nothing compared, not a match
        return {"tensors": 0, "equal": False, "differ": [], "why": f"no tensor in {ours} to compare"}
    return {"tensors": len(a), "equal": not differ, "differ": differ}


def check(args: argparse.Namespace, kills: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    ours, theirs = args.work / "runs" / "chaos", args.work / "runs" / "ref"
    record, ref_record = record_of(ours), record_of(theirs)
    for run, rec in (("chaos", record), ("reference", ref_record)):
        if rec is None:
            raise SystemExit(f"the {run} run has no record.json: nothing to compare (a run that never saved)")
    assert record is not None and ref_record is not None
    ref_saves, our_saves = saved_positions("ref", args), saved_positions("chaos", args)
    out: dict[str, Any] = {"record": record["rollout_ids"], "reference_record": ref_record["rollout_ids"]}
    out["policies"] = policies = list(args.policies)
    for p in policies:
        rows, ref_rows = trained_rows(ours, p), trained_rows(theirs, p)
        ids = [r["rollout"] for r in rows]
        position = record["rollout_ids"][p]
        state = torch.load(
            ours / record["save_dir"] / p / "trainer.pt", weights_only=True, map_location="cpu"
        )
        steps = {int(s["step"]) for s in state["optimizer"]["state"].values()}
        versions = [r["weight_version"] for r in rows]
        mine = {
            "position": position,
            "reference_position": ref_record["rollout_ids"][p],
            "rows": len(rows),
            "duplicated": sorted({i for i in ids if ids.count(i) > 1}),
            "missing": sorted(set(range(position)) - set(ids)),
            "extra": sorted(i for i in set(ids) if i >= position),
            "weight_versions_rise_by_one": all(
                y == x + 1 for x, y in zip(versions, versions[1:], strict=False)
            ),
            "trainer_rollouts_done": state["rollouts_done"],
            "trainer_version": state["version"],
            "adamw_steps": sorted(steps),
        }
        mine["steps_exact"] = state["rollouts_done"] == state["version"] == position and steps == {position}
        mine["steps_exact"] &= position >= 1 and len(rows) >= 1  # a policy that never trained: nothing
        if p == policies[0]:
            mine["steps_exact"] &= position == args.rollouts == ref_record["rollout_ids"][p]
        by_id = {r["rollout"]: r for r in ref_rows}
        differing = [
            (r["rollout"], fields)
            for r in rows
            if r["rollout"] in by_id
            and (fields := [k for k in COMPARED if r.get(k) != by_id[r["rollout"]].get(k)])
        ]
        first = differing[0] if differing else None
        if first is not None:
            r = first[0]
            mine["first_differing_rollout"] = {
                "rollout": r,
                "fields": first[1],
                "chaos": {k: next(x for x in rows if x["rollout"] == r).get(k) for k in first[1]},
                "reference": {k: by_id[r].get(k) for k in first[1]},
                "after_kill": next(
                    (i + 1 for i, k in enumerate(kills) if (k.get("resumed_from") or {}).get(p, 0) == r), None
                ),
            }
        mine["stale_data_reference"] = sum(r["data_version"] < r["rollout"] for r in ref_rows)
        mine["stale_data_chaos"] = sum(r["data_version"] < r["rollout"] for r in rows)
        # a follower runs free, so the reference may not have saved it at this run's final position:
        # then its newest position that both runs saved (a follower's rollout r is the same whatever
        # the leader did)
        common = [n for (q, n) in our_saves if q == p and (p, n) in ref_saves]
        at = position if (p, position) in ref_saves else max(common, default=None)
        if at is None:
            mine["final_weights"] = {"equal": None, "why": f"no position of {p} saved by both runs"}
        else:
            mine["final_weights"] = {
                "position": at,
                "chaos_save": our_saves.get((p, at), Path(record["save_dir"]).name),
                "reference_save": ref_saves[(p, at)],
            }
            chaos_dir = ours / "checkpoints" / mine["final_weights"]["chaos_save"] / p
            mine["final_weights"].update(
                compare_saves(chaos_dir, theirs / "checkpoints" / ref_saves[(p, at)] / p)
            )
        out[p] = mine
    flags = ("weight_versions_rise_by_one", "steps_exact")
    out["consistent"] = all(
        not any(out[p][k] for k in ("duplicated", "missing", "extra")) and all(out[p][k] for k in flags)
        for p in policies
    )
    # every policy compared and equal: a policy with no save both runs made is a failure, not a pass
    out["exact"] = all(out[p]["final_weights"]["equal"] is True for p in policies)
    return out


def failures(result: dict[str, Any]) -> list[str]:
    """The verdict: one line per thing that failed or was not compared; empty when the run passed."""
    out = []
    kills, end, checks = result["kills"], result["end"], result["checks"]
    if len(kills) != result["kills_asked"]:
        out.append(
            f"{len(kills)} kills of {result['kills_asked']} asked struck (the run ended first): the rest "
            "were not tried"
        )
    out += [f"kill {i}: {k['hang']}" for i, k in enumerate(kills, 1) if k.get("hang")]
    leader = checks["policies"][0]
    out += [  # the record already held the whole run: the resume after it had nothing to redo
        f"kill {i}: landed after the leader's last rollout (resumed at {k['resumed_from']}): no resume tested"
        for i, k in enumerate(kills, 1)
        if (k.get("resumed_from") or {}).get(leader) == checks[leader]["reference_position"]
    ]
    left = [x for k in kills for x in k["left_behind"]] + end["left_behind"]
    left += result.get("reference", {}).get("left_behind", [])
    if left:
        out.append(f"processes left behind after a run ended: {left[:5]}")
    if end["exit_code"] != 0:
        out.append(f"the chaos run did not complete (exit {end['exit_code']}): {end['message'][:200]}")
    for p in checks["policies"]:
        c = checks[p]
        bad = {k: c[k] for k in ("duplicated", "missing", "extra") if c[k]}
        if bad or not c["weight_versions_rise_by_one"] or not c["steps_exact"]:
            out.append(
                f"policy {p}: record inconsistent: position {c['position']}, rows {c['rows']}, {bad}, weight "
                f"versions rise by one {c['weight_versions_rise_by_one']}, steps exact {c['steps_exact']}"
            )
        w = c["final_weights"]
        if w["equal"] is None or w.get("why"):
            out.append(f"policy {p}: final weights not compared: {w['why']}")
        elif not w["equal"]:
            out.append(
                f"policy {p}: final weights differ at position {w['position']}: {len(w['differ'])} of "
                f"{w['tensors']} tensors, first {w['differ'][0]['tensor']}"
            )
    return out


def table(result: dict[str, Any]) -> str:
    head = "| # | target | t into run (s) | leader rollout | resumed from | exit | message | recovery (s) |"
    lines = [head, "|" + " --- |" * 8]
    for i, k in enumerate(result["kills"], 1):
        resumed = ", ".join(f"{p} {n}" for p, n in (k["resumed_from"] or {}).items()) or "fresh"
        message = k["message"].replace("|", "/")[:110]
        recovery = "HANG" if k.get("hang") else (k.get("recovery_s") and f"{k['recovery_s']:.1f}")
        lines.append(
            f"| {i} | {k['target']} | {k['seconds_into_run']:.1f} | {k['leader_rollout']} | {resumed} | "
            f"{k['exit_code']} | {message} | {recovery} |"
        )
    c, t = result["checks"], result["totals"]
    lines += [
        "",
        f"Totals: {t['kills']} kills ({t['by_target']}), recovery mean {t['recovery_mean_s']} s / max "
        f"{t['recovery_max_s']} s, leader rollouts redone {t['rollouts_redone']}, chaos wall "
        f"{t['chaos_wall_s']:.0f} s vs reference {t['reference_wall_s']:.0f} s, hangs {t['hangs']}, "
        f"processes left behind {t['left_behind']}.",
        f"Record consistent: {c['consistent']}; final weights equal to the unkilled run: {c['exact']}.",
    ]
    for p in c["policies"]:
        w = c[p]["final_weights"]
        diff = c[p].get("first_differing_rollout")
        lines.append(
            f"- policy {p}: position {c[p]['position']} (reference {c[p]['reference_position']}), rows "
            f"{c[p]['rows']}, duplicated {c[p]['duplicated']}, missing {c[p]['missing']}, steps exact "
            f"{c[p]['steps_exact']}; weights equal {w['equal']}"
            + (f" ({len(w['differ'])} of {w['tensors']} tensors differ)" if w.get("differ") else "")
            + (f"; first differing rollout {diff['rollout']} ({', '.join(diff['fields'])}" if diff else "")
            + (f"; after kill {diff['after_kill']})" if diff else "")
        )
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    return {"cpu": cpu and cpu.group(1), "nproc": os.cpu_count(), "load_at_start": os.getloadavg()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Reference, chaos run and checks (`args`: main's options, and recipe, sets, policies, targets,
    slot_s, kill_after, ray_address, cluster_root); the result `main` writes, `failures` judges."""
    for stale in ("runs/ref", "runs/chaos", "logs"):  # this benchmark's own folders, from an earlier run
        subprocess.run(["rm", "-rf", str(args.work / stale)], check=True)
    info = {"machine": machine(), "command": sys.argv, "recipe": args.recipe, "policies": args.policies}
    info.update(kills_asked=args.kills, seed=args.seed, rollouts=args.rollouts, staleness=args.staleness)
    ref = reference(args)
    print(f"reference: {ref['wall_s']:.0f} s, positions {ref['positions']}")
    # a kill lands 0.05-1.2 slots after a restart's first new rollout: all of them fit in one run
    slot = args.slot_s or ref["drive_s"] / (args.kills + 1)
    kills, end = chaos(args, slot)
    checks = check(args, kills)
    recoveries = [k["recovery_s"] for k in kills if k.get("recovery_s") is not None]
    leader = args.policies[0]
    totals = {
        "kills": len(kills),
        "by_target": {kind: sum(k["target"] == kind for k in kills) for kind in KINDS},
        "recovery_mean_s": round(sum(recoveries) / len(recoveries), 2) if recoveries else None,
        "recovery_max_s": round(max(recoveries), 2) if recoveries else None,
        "rollouts_redone": sum(k["stopped_at"] + 1 - (k["resumed_from"] or {}).get(leader, 0) for k in kills),
        "hangs": sum(bool(k.get("hang")) for k in kills),
        "left_behind": sum(len(k["left_behind"]) for k in kills) + len(end["left_behind"]),
        "chaos_wall_s": end["wall_s"],
        "reference_wall_s": ref["wall_s"],
        "final_exit": end["exit_code"],
        "load_at_end": os.getloadavg(),
    }
    return {**info, "reference": ref, "kills": kills, "end": end, "totals": totals, "checks": checks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--rollouts", type=int, help="leader rollouts (default: tiny 300, smollm2 3)")
    parser.add_argument("--staleness", type=int, help="rl.staleness_limit (default: the recipe's, 1)")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, help="HPREF_CACHE (default: WORK/cache)")
    parser.add_argument("--stall-s", type=float, default=600.0, help="a restart with no progress is a hang")
    parser.add_argument("--exit-timeout", type=float, default=180.0, help="a kill the run does not end on")
    parser.add_argument("--run-timeout", type=float, default=3600.0)
    args = parser.parse_args(argv)
    args.work = args.work.resolve()
    args.rollouts = args.rollouts or MODELS[args.model]["rollouts"]
    args.cache = (args.cache or args.work / "cache").resolve()
    args.recipe, args.sets = MODELS[args.model]["recipe"], MODELS[args.model]["sets"]
    args.policies, args.targets, args.slot_s, args.kill_after = POLICIES, None, None, -1
    args.ray_address, args.cluster_root = None, None  # its own local cluster, as a user runs it
    result = run(args)
    write_json(args.out, result)
    print(table(result))
    failed = failures(result)
    for line in failed:
        print(f"FAIL: {line}", file=sys.stderr)
    print(f"chaos_rl verdict: {'FAIL' if failed else 'pass'} ({len(failed)} failures)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
