"""Chaos benchmark for `hpref train`: kill it at random steps, fill its disk, resume, compare.

    .venv/bin/python -m benchmarks.chaos_train [--kills N] [--seed S] --work DIR --out FILE.json

The engine tests' tiny recipe (`tests/train/conftest.py`: a config-built 2-block tiny-llama on the
synthetic arena, fp32, a checkpoint every 3 steps) with 5 epochs (50 steps) runs twice under hpref's own
launcher, 2 gloo ranks: untouched (the reference, keeping every checkpoint), and with faults in turn at
steps a seeded RNG draws: a torchrun worker (a child of the launcher) SIGKILLed, the launcher's process
group SIGKILLed, and a full disk while a checkpoint is written. The full disk is a `sitecustomize.py`
in a folder on the chaos run's PYTHONPATH only: it wraps `open` (DCP's shard streams and
`hpref.runfolder.files.write_bytes_atomic` both go through it), and the first write of the chosen file
in `checkpoints/.tmp-step-N/` writes half its bytes and raises `OSError(ENOSPC)`. After each fault
`hpref train RECIPE --resume auto` runs until the run completes.

Checked: final weights (`hpref save` exports) and every step's loss equal the reference's bit for bit;
every checkpoint folder, after each fault and at the end, passes `validate_checkpoint` and holds the
reference's bytes; resume picks what `resolve_resume` predicts; no `.part`/`.tmp-*` where hpref would
read it; each step once in `metrics.jsonl`; no orphan workers; the full disk is one line, exit != 0.
A check that found nothing to compare (no tensor, no step, no checkpoint, no fault of a planned kind)
fails and says what it did not compare: `all()` over nothing is not a pass. Exit 1 unless every check
passes.

The suite's short version (tests/train/test_engine.py) imports `run_chaos` and `verify`: a rank and
the launcher killed in one run of the tests' 20-step recipe, compared with its 2-rank reference run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
NAME = "chaos-train"
SETS = ["train.epochs=5", "train.checkpoint_interval=3"]  # on the tests' recipe, for every launch
KEEP = 3  # the chaos run's train.keep_checkpoints; the reference keeps them all
LOAD: list[float] = []  # 1-minute load average, sampled while waiting on runs

#: Armed by HPREF_CHAOS_ENOSPC (JSON: parent folder name, file name pattern, rank, record file, and a
#: folder that must exist), which only the launch meant to suffer the fault gets. Fires once.
SITECUSTOMIZE = '''"""benchmarks/chaos_train.py: one write of one checkpoint file fails with ENOSPC."""
import builtins, errno, fnmatch, io, json, os, time

_SPEC = os.environ.get("HPREF_CHAOS_ENOSPC")
if _SPEC:
    _CFG, _REAL_OPEN, _FIRED = json.loads(_SPEC), io.open, []

    class _FullDisk:
        def __init__(self, fh, path):
            self._fh, self._path = fh, path

        def write(self, data):
            if _FIRED:
                return self._fh.write(data)
            _FIRED.append(True)
            view = memoryview(data.encode() if isinstance(data, str) else data).cast("B")
            self._fh.write(view[: len(view) // 2])
            self._fh.flush()
            with _REAL_OPEN(_CFG["record"], "w") as out:
                json.dump({"path": self._path, "rank": os.environ.get("RANK"), "pid": os.getpid(),
                           "written": len(view) // 2, "of": len(view), "time": time.time()}, out)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._path)

        def __getattr__(self, name):
            return getattr(self._fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._fh.__exit__(*exc)

    def _open(file, mode="r", *args, **kwargs):
        fh = _REAL_OPEN(file, mode, *args, **kwargs)
        if _FIRED or not any(c in mode for c in "wax") or isinstance(file, int):
            return fh
        path = os.path.abspath(os.fsdecode(os.fspath(file)))
        if (os.path.basename(os.path.dirname(path)) == _CFG["parent"]
                and fnmatch.fnmatch(os.path.basename(path), _CFG["pattern"])
                and os.environ.get("RANK", "0") == _CFG["rank"]
                and (not _CFG["requires"] or os.path.isdir(_CFG["requires"]))):
            return _FullDisk(fh, path)
        return fh

    builtins.open = io.open = _open
'''

#: --enospc-file: which write of the chosen checkpoint fails: (folder, name pattern, rank 0's only)
ENOSPC_FILES = {
    "shard": ("tmp", "__*_*.distcp", False),  # a rank's DCP shard (model + optimizer tensors)
    "metadata": ("tmp", ".metadata.tmp", True),  # DCP's index, written last by rank 0
    "rank-state": ("tmp", ".rank-*.json.*.part", False),  # a rank's RNG state (write_bytes_atomic)
    "train-state": ("tmp", ".train_state.json.*.part", True),
    "checksums": ("tmp", ".checksums.json.*.part", True),
    "latest": ("checkpoints", ".latest.*.part", True),  # after step-N was renamed into place
}


@dataclass
class Launch:
    proc: subprocess.Popen
    started: float  # time.monotonic()
    wall: float  # time.time()
    err: Path


def env_for(work: Path, chaos: bool, enospc: dict | None = None, cache: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, HPREF_CACHE=str(cache or work / "cache"), HF_HUB_OFFLINE="1")
    env.pop("HPREF_CHAOS_ENOSPC", None)
    if chaos:  # the injector's folder first; a PYTHONPATH given to the benchmark stays behind it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work / "inject"), env.get("PYTHONPATH")) if p)
    if enospc is not None:
        env["HPREF_CHAOS_ENOSPC"] = json.dumps(enospc)
    return env


def hpref_cmd(*args: str) -> list[str]:
    script = Path(sys.executable).parent / "hpref"
    return [str(script), *args] if script.is_file() else [sys.executable, "-m", "hpref", *args]


def start(
    folder: Path,
    tag: str,
    env: dict[str, str],
    *extra: str,
    recipe: str = "recipe-in.toml",
    sets: list[str] = SETS,
) -> Launch:
    """`hpref train` of `folder`'s recipe, 2 ranks, in a process group of its own (to kill it whole)."""
    set_args = [a for s in sets for a in ("--set", s)]
    cmd = hpref_cmd("train", recipe, "--nproc-per-node", "2", *set_args, *extra)
    (folder / f"{tag}.cmd").write_text(" ".join(cmd) + "\n")
    err = folder / f"{tag}.err"
    with open(folder / f"{tag}.out", "wb") as out, open(err, "wb") as errf:
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=out, stderr=errf, start_new_session=True)
    return Launch(proc, time.monotonic(), time.time(), err)


def train_steps(run_dir: Path) -> list[int]:
    """The train steps in metrics.jsonl as it is now (a line cut mid-append is skipped)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "train":
            steps.append(int(record["step"]))
    return steps


def wait_for_step(launch: Launch, run_dir: Path, step: int, timeout: float = 300) -> float | None:
    """Seconds from the launch to `step` (or a later one) in metrics.jsonl; None if it ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(train_steps(run_dir), default=0) >= step:
            return time.monotonic() - launch.started
        if launch.proc.poll() is not None:
            return None
        LOAD.append(os.getloadavg()[0])
        time.sleep(0.01)
    raise TimeoutError(f"step {step} not reached in {timeout} s (see {launch.err})")


def finish(launch: Launch, timeout: float = 300) -> tuple[int, str]:
    rc = launch.proc.wait(timeout)
    return rc, launch.err.read_text(errors="replace")


def error_report(stderr: str) -> dict[str, Any]:
    """What the user saw: the launcher's error line, the lines from it on, and any traceback's last line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    first = next((i for i, line in enumerate(lines) if re.match(r"\S+ ERROR ", line)), None)
    raised = [line for line in lines if re.match(r"(\[rank\d+\]: )?[\w.]+(Error|Exception): ", line)]
    return {
        "message": lines[first].split(" ERROR ", 1)[1].strip() if first is not None else None,
        "lines_from_error": 0 if first is None else len(lines) - first,
        "traceback": any("Traceback (most recent call last)" in line for line in lines),
        "traceback_last_line": raised[-1] if raised else None,
    }


def workers_of(pid: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers whose parent is `pid` (/proc; Linux)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if int((entry / "stat").read_text().rpartition(")")[2].split()[1]) != pid:
                continue
            if b"hpref.train.worker" not in (entry / "cmdline").read_bytes():
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
            rank = next(int(v[5:]) for v in env if v.startswith(b"RANK="))
            found[rank] = int(entry.name)
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def checkpoint_state(run_dir: Path, ref_dir: Path) -> dict[str, Any]:
    """Every save in the run folder through hpref's own trust check (and, if it passes, whether its
    files are the reference's of the same step), and what `--resume auto` would pick."""
    from hpref.runfolder.checkpoints import validate_checkpoint
    from hpref.train.checkpoint import resolve_resume

    root = run_dir / "checkpoints"
    folders, partial = {}, []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if p.name.startswith(".tmp-"):
            partial.append(p.name)
        elif p.is_dir():
            try:
                validate_checkpoint(p)
                ref = ref_dir / "checkpoints" / p.name
                if not ref.is_dir():  # a reference that keeps fewer saves (the suite's) has none here
                    folders[p.name] = UNMATCHED
                    continue
                same = file_digests(p) == file_digests(ref)
                folders[p.name] = "verified" if same else "verified, but not the reference's bytes"
            except Exception as exc:  # the problem is the result
                folders[p.name] = f"{type(exc).__name__}: {exc}"
    try:
        pick = resolve_resume(run_dir, "auto")
        pick_name = pick.name if pick is not None else None
    except Exception as exc:
        pick_name = f"refused: {exc}"
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    return {"checkpoints": folders, "partial": partial, "latest": latest, "resume_would_pick": pick_name}


#: checkpoint_state's verdict on a save that verifies but has no save of the same step in the reference
UNMATCHED = "verified; the reference kept no save of this step"


#: train_state.json's keys that name the save rather than the state trained to (its own id, its
#: parent's, its time: `hpref.runfolder.lineage`): two runs' saves of one step differ there only
OWN_KEYS = ("lineage",)


def file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file of a checkpoint (its manifest) but DCP's index, which holds its own path;
    train_state.json as its content without `OWN_KEYS`."""
    manifest = json.loads((folder / "checksums.json").read_text())["files"]
    digests = {
        name: v["sha256"] for name, v in manifest.items() if name not in (".metadata", "train_state.json")
    }
    state = json.loads((folder / "train_state.json").read_text())
    digests["train_state.json"] = json.dumps(
        {k: v for k, v in state.items() if k not in OWN_KEYS}, sort_keys=True
    )
    return digests


def leftovers(run_dir: Path) -> list[dict[str, Any]]:
    """Temporary names (`*.part`, `*.tmp`, `.tmp-*`) in the run folder, and whether one lies inside a
    `step-*` folder (the only place hpref reads files from without a temporary name)."""
    found = []
    for root, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            if name.endswith((".part", ".tmp")) or name.startswith(".tmp-"):
                rel = (Path(root) / name).relative_to(run_dir)
                inside = any(part.startswith("step-") for part in rel.parts[:-1])
                found.append({"path": rel.as_posix(), "inside_checkpoint": inside})
    return found


def compare_exports(a: Path, b: Path) -> dict[str, Any]:
    """Every tensor of every safetensors file of two exports, compared as raw bytes."""
    import torch
    from safetensors.torch import load_file

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    files = sorted(p.name for p in a.glob("*.safetensors"))
    if not files or files != sorted(p.name for p in b.glob("*.safetensors")):
        return {"files": files, "bit_identical": False, "different": ["the export folders differ"]}
    tensors, different = 0, []
    for name in files:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        different += [f"{name}: {k} in one export only" for k in sorted(set(x) ^ set(y))]
        for key in sorted(set(x) & set(y)):
            tensors += 1
            if x[key].dtype != y[key].dtype or x[key].shape != y[key].shape or raw(x[key]) != raw(y[key]):
                different.append(f"{name}: {key}")
    return {"files": files, "tensors": tensors, "bit_identical": not different, "different": different[:10]}


def draw_fault(rng: random.Random, args: argparse.Namespace, i: int, after: int, ctx: dict) -> dict:
    """Fault `i`: its kind (in turn), its step (in the i-th slice of the run, at least 2 steps past the
    last fault); for ENOSPC a checkpoint step, the rank and the injector's spec (`SITECUSTOMIZE`)."""
    total, width = ctx["total"], (ctx["total"] - 4) / args.kills
    lo = max(3 + int(i * width), after + 2)
    hi = min(max(3 + int((i + 1) * width) - 1, lo), total - 2)
    fault: dict[str, Any] = {"kind": ("rank", "launcher", "enospc")[i % 3]}
    if fault["kind"] != "enospc":
        fault["target_step"] = rng.randint(lo, hi)
        return fault
    saves = [s for s in ctx["saves"] if lo <= s <= hi] or [s for s in ctx["saves"] if s >= lo][:1]
    target = rng.choice(saves)
    where, pattern, rank0 = ENOSPC_FILES[args.enospc_file]
    rank = 0 if rank0 else rng.randint(0, 1)
    step_dir = ctx["run_dir"] / "checkpoints" / f"step-{target:06d}"
    fault.update(target_step=target, file=args.enospc_file, rank=rank)
    fault["spec"] = {
        "parent": f".tmp-step-{target:06d}" if where == "tmp" else "checkpoints",
        "pattern": pattern,
        "rank": str(rank),
        "record": str(ctx["record"]),
        "requires": str(step_dir) if where == "checkpoints" else "",
    }
    return fault


def strike(rng: random.Random, fault: dict, launch: Launch, run_dir: Path) -> None:
    """Kill a rank, or the launcher's process group, a random moment after `target_step` is logged."""
    if wait_for_step(launch, run_dir, fault["target_step"]) is None:
        raise RuntimeError(f"the run ended before step {fault['target_step']}: see {launch.err}")
    time.sleep(rng.uniform(0.0, 0.2))  # in the next step or two, or in a save
    workers = workers_of(launch.proc.pid)
    if not workers:
        raise RuntimeError(f"no worker of the launcher at step {fault['target_step']}: see {launch.err}")
    if fault["kind"] == "rank":
        fault["rank"] = rng.choice(sorted(workers))
        os.kill(workers[fault["rank"]], signal.SIGKILL)
    else:  # the launcher alone: its group would take the workers with it only if they were in it
        os.kill(launch.proc.pid, signal.SIGKILL)
    fault["at_step"] = max(train_steps(run_dir), default=0)  # the last step logged when it struck
    fault["at_s"] = round(time.monotonic() - launch.started, 2)
    if fault["kind"] == "launcher":  # the workers must die with it (PR_SET_PDEATHSIG), not linger
        gone = time.monotonic()
        while any(alive(p) for p in workers.values()) and time.monotonic() - gone < 60:
            time.sleep(0.02)
        fault["workers_gone_after_s"] = round(time.monotonic() - gone, 2)
        fault["orphans"] = [p for p in workers.values() if alive(p)]
        for pid in fault["orphans"]:  # recorded as the failure; not left running
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):  # anything else of its group
            os.killpg(launch.proc.pid, signal.SIGKILL)


def planned_kinds(kills: int) -> list[str]:
    """The kinds of `kills` faults, in the turn `draw_fault` takes them."""
    return [("rank", "launcher", "enospc")[i % 3] for i in range(kills)]


def run_chaos(args: argparse.Namespace, work: Path, ctx: dict) -> dict[str, Any]:
    """The chaos run: faults in turn, each followed by `--resume auto`, which the next fault hits.

    `args`: kills, seed, enospc_file. `ctx`: total (steps), saves (the reference's checkpoint steps),
    run_dir, ref_dir, record (the injector's file), and optionally cache (HPREF_CACHE), recipe (its
    file name in `work/chaos`), sets (`--set`s of every launch), extra (more arguments of every
    launch) and before_resume (called with the fault's index before its resume starts)."""
    rng = random.Random(args.seed)
    folder, run_dir, ref_dir = work / "chaos", ctx["run_dir"], ctx["ref_dir"]
    recipe, sets, always = ctx.get("recipe", "recipe-in.toml"), ctx.get("sets", SETS), ctx.get("extra", [])

    def begin(tag: str, enospc: dict | None, *extra: str) -> Launch:
        env = env_for(work, True, enospc, ctx.get("cache"))
        return start(folder, tag, env, *always, *extra, recipe=recipe, sets=sets)

    faults: list[dict[str, Any]] = []
    t0 = time.monotonic()
    fault = draw_fault(rng, args, 0, 1, ctx)  # drawn before its launch: ENOSPC arms the launch
    launch = begin("launch-0", fault.get("spec"))
    for i in range(args.kills):
        if fault["kind"] == "enospc":
            rc, stderr = finish(launch)
            fired = json.loads(ctx["record"].read_text()) if ctx["record"].is_file() else None
            ctx["record"].unlink(missing_ok=True)
            fault.update(injected=fired, at_step=fault["target_step"] if fired else None)
            fault["at_s"] = round(fired["time"] - launch.wall, 2) if fired else None
        else:
            strike(rng, fault, launch, run_dir)
            rc, stderr = finish(launch)
        fault.update(exit_code=rc, **error_report(stderr), after_fault=checkpoint_state(run_dir, ref_dir))
        fault["logged_to"] = max(train_steps(run_dir), default=0)  # what the resume logs again
        fault.pop("spec", None)
        faults.append(fault)
        after = fault["at_step"] or fault["target_step"]
        nxt = draw_fault(rng, args, i + 1, after, ctx) if i + 1 < args.kills else None
        ctx.get("before_resume", lambda _i: None)(i)  # the suite plants a partial save here
        fault["resume_launch"] = tag = f"launch-{i + 1}"
        launch = begin(tag, (nxt or {}).get("spec"), "--resume", "auto")
        passed = wait_for_step(launch, run_dir, after + 1)  # past the step the fault interrupted
        fault["recovery_s"] = round(passed, 2) if passed is not None else None
        fault = nxt
    rc, stderr = finish(launch)
    retries = 0
    while rc != 0 and retries < 2:  # a resume that failed on its own: record it, try again
        faults.append({"kind": "unplanned-failure", "exit_code": rc, **error_report(stderr)})
        retries += 1
        launch = begin(f"launch-retry-{retries}", None, "--resume", "auto")
        rc, stderr = finish(launch)
    for fault in faults:
        if "resume_launch" in fault:
            text = (folder / f"{fault['resume_launch']}.err").read_text(errors="replace")
            hit = re.findall(r"resumed from (\S+)", text)
            fault["resumed_from"] = Path(hit[-1]).name if hit else None
            fault["resume_predicted"] = fault["after_fault"]["resume_would_pick"]
    return {"faults": faults, "final_exit_code": rc, "wall_s": round(time.monotonic() - t0, 1)}


def losses(run_dir: Path) -> dict[int, float]:
    from hpref.train.metrics import read_metrics

    if not (run_dir / "metrics.jsonl").is_file():  # a run that logged nothing: verify says so
        return {}
    return {
        r["step"]: r["step_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"
    }


def verify(
    work: Path, ref_dir: Path, run_dir: Path, chaos: dict, kills: int, exports: bool = True
) -> dict[str, dict[str, Any]]:
    """The end checks (module docstring): name -> {ok, what was found}. A check with nothing to
    compare fails with `not_compared` saying what was missing. `kills`: the faults planned (their
    kinds in turn: each kind planned must have struck, and only those kinds' checks run).
    `exports`: also compare `hpref save` exports (two more processes); without, the final weights
    are the final checkpoint's bytes (model and optimizer shards)."""
    checks: dict[str, dict[str, Any]] = {}

    def check(name: str, ok: Any, compared: int, what: str, **found: Any) -> None:
        checks[name] = {"ok": bool(ok) and compared > 0, "compared": compared, **found}
        if compared == 0:
            checks[name]["not_compared"] = f"compared nothing: {what}"

    kinds = planned_kinds(kills)
    faults = [f for f in chaos["faults"] if f["kind"] != "unplanned-failure"]
    struck = [f["kind"] for f in faults]
    check(
        "every planned fault struck, in turn", struck == kinds, len(struck), "no fault struck", struck=struck
    )
    unplanned = [f for f in chaos["faults"] if f["kind"] == "unplanned-failure"]
    check("no resume failed on its own", not unplanned, len(faults), "no resume ran", failures=unplanned)
    if exports:
        for side, run in (("ref", ref_dir), ("chaos", run_dir)):
            cmd = hpref_cmd("save", str(run), "--to", str(work / side / "export"))
            subprocess.run(cmd, env=env_for(work, False), check=True, capture_output=True)
        weights = compare_exports(work / "ref" / "export", work / "chaos" / "export")
        check(
            "final weights bit-identical (every tensor of both exports)",
            weights["bit_identical"],
            weights.get("tensors", 0),
            "no tensor in the exports",
            **weights,
        )
    ref_l, chaos_l = losses(ref_dir), losses(run_dir)
    diff = sorted(s for s in set(ref_l) | set(chaos_l) if ref_l.get(s) != chaos_l.get(s))
    check(
        "every step's loss identical to the reference's",
        not diff,
        len(ref_l),
        "no reference loss",
        differ=diff,
    )
    steps = train_steps(run_dir)
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    once = steps == list(range(1, len(ref_l) + 1))
    check("metrics.jsonl holds each step once", once, len(steps), "no step logged", repeated=repeated)
    states = [f["after_fault"] for f in chaos["faults"] if "after_fault" in f]
    states.append(end := checkpoint_state(run_dir, ref_dir))
    seen = {n: v for st in states for n, v in st["checkpoints"].items()}
    bad = {n: v for n, v in seen.items() if v not in ("verified", UNMATCHED)}
    matched = sum(v != UNMATCHED for st in states for v in st["checkpoints"].values())
    check(
        "each checkpoint seen verifies (and has the reference's bytes where it kept the step)",
        not bad,
        matched,
        "no checkpoint had a reference save of its step",
        seen=sum(len(st["checkpoints"]) for st in states),
        bad=bad,
    )
    final = f"step-{len(ref_l):06d}"
    check(
        "the final checkpoint has the reference's bytes (weights, optimizer, RNG)",
        end["checkpoints"].get(final) == "verified",
        int(final in end["checkpoints"] and (ref_dir / "checkpoints" / final).is_dir()),
        f"{final} is not in both runs",
        found=end["checkpoints"].get(final),
    )
    picks = [(f["resume_predicted"], f["resumed_from"]) for f in faults if "resume_launch" in f]
    check(
        "resume picked the newest verified checkpoint",
        all(a == b for a, b in picks),
        len(picks),
        "no fault was resumed",
        picks=picks,
    )
    left = leftovers(run_dir)
    trusted = [x for x in left if x["inside_checkpoint"]]
    check(
        "no temporary file where hpref trusts files",
        not trusted,
        int(run_dir.is_dir()),
        "no run folder",
        left=left,
    )
    newest = max(end["checkpoints"], default=None)
    same = end["latest"] == end["resume_would_pick"] == newest
    check(
        "latest names the newest verified checkpoint",
        same,
        int(newest is not None),
        "no checkpoint at the end",
    )
    if "rank" in kinds:
        ranks = [f for f in faults if f["kind"] == "rank"]
        ended = all(f["exit_code"] not in (0, None) for f in ranks)
        check("rank SIGKILL: the run ended non-zero", ended, len(ranks), "no rank was killed")
    if "launcher" in kinds:
        launcher = [f for f in faults if f["kind"] == "launcher"]
        no_orphans = all(not f["orphans"] for f in launcher)
        check("launcher SIGKILL: no worker outlives it", no_orphans, len(launcher), "no launcher was killed")
    if "enospc" in kinds:
        enospc = [f for f in faults if f["kind"] == "enospc"]
        fired = [bool(f["injected"] and f["exit_code"]) for f in enospc]
        check("ENOSPC: fired, exit code != 0, recovered", all(fired), len(enospc), "no ENOSPC planned struck")
        full = "No space left on device"
        one_line = [
            x["lines_from_error"] == 1 and not x["traceback"] and full in str(x["message"]) for x in enospc
        ]
        check(
            "ENOSPC: one error line naming the full disk, no traceback",
            all(one_line),
            len(enospc),
            "no ENOSPC planned struck",
        )
    check("the chaos run completed (exit 0)", chaos["final_exit_code"] == 0, 1, "")
    return checks


def failures(checks: dict[str, dict[str, Any]]) -> list[str]:
    """One line per failed check: its name and what it did not compare, or what it found."""
    lines = []
    for name, c in checks.items():
        if not c["ok"]:
            found = {k: v for k, v in c.items() if k not in ("ok", "compared", "not_compared")}
            lines.append(f"FAIL: {name}: {c.get('not_compared') or json.dumps(found, default=str)[:300]}")
    return lines


def table(result: dict[str, Any]) -> str:
    rows = [
        "| # | fault | target | struck after step | at s | exit | message seen | resumed from | recovery s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, f in enumerate(result["chaos"]["faults"], 1):
        what = f["kind"] + (f" {f['file']}" if "file" in f else "")
        what += f" (rank {f['rank']})" if "rank" in f else ""
        msg = (f.get("message") or "-").replace("|", "\\|")
        msg = msg if len(msg) < 170 else msg[:167] + "..."
        rows.append(
            f"| {n} | {what} | {f.get('target_step', '-')} | {f.get('at_step', '-')} | {f.get('at_s', '-')} "
            f"| {f['exit_code']} | {msg} | {f.get('resumed_from', '-')} | {f.get('recovery_s', '-')} |"
        )
    t = result["totals"]
    rows += [
        "",
        f"Totals: {t['faults']} faults {t['by_kind']}, {t['recovery_s']} s of recovery in all; chaos run "
        f"{t['chaos_wall_s']} s, reference {t['reference_wall_s']} s; 1-min load average {t['load']}.",
        "",
        "| check | result |",
        "| --- | --- |",
    ]
    rows += [
        f"| {name} | {'pass' if c['ok'] else c.get('not_compared', 'FAIL')} |"
        for name, c in result["checks"].items()
    ]
    return "\n".join(rows)


def cpu_model() -> str:
    names = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
    return names[0].split(":", 1)[1].strip() if names else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3, help="faults in all, kinds in turn (3: each once)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault plan (steps, delays, ranks)")
    parser.add_argument("--enospc-file", choices=sorted(ENOSPC_FILES), default="shard")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (emptied first)")
    parser.add_argument("--out", type=Path, required=True, help="JSON results")
    args = parser.parse_args(argv)
    if not 1 <= args.kills <= 12:
        parser.error("--kills: 1 to 12 (the run has 50 steps)")
    sys.path.insert(0, str(REPO))
    from tests.train.conftest import RECIPE  # the engine tests' tiny recipe, exactly

    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "inject").mkdir(parents=True)
    (work / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    for side, keep in (("ref", 1000), ("chaos", KEEP)):
        (work / side).mkdir()
        text = RECIPE.format(name=NAME, output_dir=(work / side / "runs").as_posix())
        text = re.sub(r"keep_checkpoints = \d+", f"keep_checkpoints = {keep}", text)
        (work / side / "recipe-in.toml").write_text(text)
    load0 = os.getloadavg()
    ref = start(work / "ref", "launch-0", env_for(work, False))
    rc, _ = finish(ref)
    ref_wall = round(time.monotonic() - ref.started, 1)
    if rc != 0:
        raise SystemExit(f"the reference run failed (exit {rc}): see {ref.err}")
    ref_dir, run_dir = work / "ref" / "runs" / NAME, work / "chaos" / "runs" / NAME
    saves = sorted(int(p.name.removeprefix("step-")) for p in (ref_dir / "checkpoints").glob("step-*"))
    ctx = {"total": len(train_steps(ref_dir)), "saves": saves, "run_dir": run_dir, "ref_dir": ref_dir}
    ctx["record"] = work / "inject" / "fired.json"
    chaos = run_chaos(args, work, ctx)
    load = {"start": load0[0], "during_mean": round(sum(LOAD) / max(len(LOAD), 1), 2)}
    load.update(during_max=max(LOAD, default=0.0), end=os.getloadavg()[0])
    checks = verify(work, ref_dir, run_dir, chaos, args.kills)
    faults = [f for f in chaos["faults"] if f["kind"] != "unplanned-failure"]
    result = {
        "command": shlex.join([".venv/bin/python", "-m", "benchmarks.chaos_train", *sys.argv[1:]]),
        "machine": {"cpu": cpu_model(), "nproc": os.cpu_count(), "python": sys.version.split()[0]},
        "recipe": {"tests_recipe_with": SETS, "steps": ctx["total"], "checkpoints_at": saves, "keep": KEEP},
        "seed": args.seed,
        "reference": {"wall_s": ref_wall},
        "chaos": chaos,
        "checks": checks,
        "totals": {
            "faults": len(faults),
            "by_kind": {k: sum(f["kind"] == k for f in faults) for k in ("rank", "launcher", "enospc")},
            "recovery_s": round(sum(f.get("recovery_s") or 0 for f in faults), 2),
            "chaos_wall_s": chaos["wall_s"],
            "reference_wall_s": ref_wall,
            "load": load,
            "all_checks_pass": all(c["ok"] for c in checks.values()),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(table(result))
    for line in failures(checks):
        print(line, file=sys.stderr)
    print(f"all checks pass: {result['totals']['all_checks_pass']}")
    return 0 if result["totals"]["all_checks_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
