"""Two policies that meet: SmolLM2-135M-Instruct LoRA policies in `debate`, shared base vs apart (issue #50).

    .venv/bin/python -m benchmarks.rl_debate [--updates 4] [--rounds 1] [--runs separate,shared]
        [--eval-prompts 16] [--reward DIR] [--scorer DIR] [--work DIR] [--out FILE] [--gpu]
        [--policy DIR] [--prompts FILE] [--ray-address ADDR]

What runs: `hpref rl rl-debate-smollm2 --policies a,b` (the shipped recipe: two LoRA policies, HH-RLHF
helpful-base prompts, 2 debate rounds of up to 64 tokens a turn, judged by the MiniLM reward export
`--reward` in both orders, the second export `--scorer` scoring every eval) for `--updates` leader
rollouts, with an eval before the first update and after the last. `separate`: an engine and a trainer
per policy (`share_base = false`); `shared`: one engine and one trainer for both (`share_base = true`:
every round's turns of both policies in one batched engine call, one adapter per row). The runs
alternate round by round (separate, shared, separate, ...); the table gives each one's median.
`--gpu` puts engines (vLLM) and trainer ranks on the GPU, as `benchmarks.rl_shared --gpu` does
(`benchmarks/gpu.sh`).

Reported per run: seconds per leader rollout (the leader's loop to its last update over the updates,
start-up and the final eval excluded, the start's eval included, as `benchmarks.rl_tool` counts) and the
median seconds between updates (no eval in it: the steady figure); the peak PSS of the whole process
tree (RSS in brackets); the mean load; and the run's outcome: each policy's win rate against its own
start under the scorer at the last eval (greedy debates of the eval prompts, each policy's final answer
against its start's), a's mean verdict against b over the last update (`match_score_mean`), and the
live Bradley-Terry table of `rl_summary.json` (the debates' matches and the last eval's start battles).

The machine must be otherwise quiet: no tests, no helper sessions, no other training.

The suite's smoke run (tests/rl/test_rl_shared_benchmark.py) takes it through the same code in
seconds: a config-built tiny Llama's folder (`--policy`), toy prompts (`--prompts`), a tiny reward
export as both judge and scorer, one update, the suite's Ray cluster (`--ray-address`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO, run_measured, write_json
from benchmarks.rl_real import HELPFUL, ensure_export, hpref_bin
from benchmarks.rl_shared import GPU_SETTINGS

RECIPE = REPO / "recipes" / "rl-debate-smollm2.toml"
RUNS = {"separate": "false", "shared": "true"}


def run_debate(name: str, round_: int, args: argparse.Namespace, reward: Path, scorer: Path) -> dict:
    """One `hpref rl` run of the recipe with `share_base` as `name` says, and its figures."""
    folder = f"{name}-r{round_}"
    n = args.updates
    cmd = [
        hpref_bin(), "rl", str(RECIPE), "--policies", "a,b",
        "--set", f'run.output_dir="{args.work}"', "--set", f'run.name="{folder}"',
        "--set", f"rl.share_base={RUNS[name]}", "--set", f'rl.prompts.path="{args.prompts}"',
        "--set", f'rl.reward.path="{reward}"', "--set", f'rl.eval_scorer.path="{scorer}"',
        "--set", f"rl.num_rollouts={n}", "--set", f"rl.eval_interval={n}", "--set", f"rl.save_interval={n}",
        "--set", f"rl.rollout.eval_prompts={args.eval_prompts}",
    ]  # fmt: skip
    cmd += ["--set", f'rl.defaults.model={{ path = "{args.policy}" }}'] if args.policy else []
    for setting in GPU_SETTINGS if args.gpu else ():
        cmd += ["--set", setting]
    cmd += ["--ray-address", args.ray_address] if args.ray_address else []
    measured = run_measured(cmd, args.work / f"{folder}.log", timeout=4 * 3600)
    if measured["rc"] != 0:
        last = Path(measured["log"]).read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"{folder} failed ({last[0][:300]}): see {measured['log']}")
    run_dir = args.work / folder
    rows = {
        p: [json.loads(line) for line in (run_dir / "metrics" / f"{p}.jsonl").read_text().splitlines()]
        for p in ("a", "b")
    }
    summary = json.loads((run_dir / "rl_summary.json").read_text())
    out = {**measured, **debate_figures(rows, summary, n), "name": name}
    write_json(args.work / f"{folder}-result.json", out)
    return out


def debate_figures(rows: dict[str, list[dict]], summary: dict, updates: int) -> dict:
    """The figures of one run from its metrics rows (`metrics/<p>.jsonl`) and `rl_summary.json`."""
    train = [r for r in rows["a"] if not r.get("eval")]
    times = [r["elapsed_s"] for r in train]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    last_eval = {p: [r for r in rows[p] if r.get("eval")][-1] for p in rows}
    return {
        "updates": len(train),
        "seconds_per_update": times[-1] / updates,
        "median_gap_s": statistics.median(gaps) if gaps else times[-1],
        "match_score_first": train[0]["match_score_mean"],
        "match_score_last": train[-1]["match_score_mean"],
        "win_rate_vs_start": {p: last_eval[p]["eval_scorer_win_rate_vs_start"] for p in rows},
        "leaderboard": summary["leaderboard"],
        "matches": summary["matches"],
    }


def report(results: dict[str, list[dict]]) -> list[str]:
    lines = [
        "| run | rounds | s / leader rollout | median s between updates | peak PSS GiB (RSS) | load "
        "| a's verdict vs b: first / last update | win rate vs start (scorer): a / b "
        "| table: a / b / a@start / b@start |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, runs in results.items():
        last = runs[-1]  # the outcome of the last round's run (the same seeds: the rounds differ in time)
        board = last["leaderboard"]
        table = " / ".join(f"{board[p]:.0f}" if p in board else "-" for p in ("a", "b", "a@start", "b@start"))
        wins = last["win_rate_vs_start"]
        lines.append(
            f"| {name} | {len(runs)} | {_median(runs, 'seconds_per_update'):.1f} "
            f"| {_median(runs, 'median_gap_s'):.1f} "
            f"| {_median(runs, 'peak_pss_gib'):.2f} ({_median(runs, 'peak_rss_gib'):.2f}) "
            f"| {_median(runs, 'load_mean'):.2f} "
            f"| {last['match_score_first']:.3f} / {last['match_score_last']:.3f} "
            f"| {wins['a']:.3f} / {wins['b']:.3f} | {table} |"
        )
    if {"shared", "separate"} <= set(results):
        shared, separate = results["shared"], results["separate"]
        wall = _median(shared, "seconds_per_update") / _median(separate, "seconds_per_update")
        memory = _median(shared, "peak_pss_gib") / _median(separate, "peak_pss_gib")
        lines += ["", f"shared vs separate: seconds per leader rollout x{wall:.2f}; peak PSS x{memory:.2f}"]
    return lines


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=4, help="leader rollouts (updates) per run")
    parser.add_argument("--rounds", type=int, default=1, help="times each run is repeated, interleaved")
    parser.add_argument("--runs", default="separate,shared", help="separate, shared or both")
    parser.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts each eval debates")
    parser.add_argument("--reward", type=Path, default=REPO / "runs" / "minilm-reward-helpful-f0-export")
    parser.add_argument("--scorer", type=Path, default=REPO / "runs" / "minilm-reward-helpful-f1-export")
    parser.add_argument("--work", type=Path, default=None, help="the runs' parent (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    parser.add_argument("--gpu", action="store_true", help="vLLM and trainer ranks on the GPU (gpu.sh)")
    parser.add_argument("--policy", default=None, help="a causal-LM folder instead of SmolLM2")
    parser.add_argument("--prompts", type=Path, default=HELPFUL, help="the prompt file (HH-RLHF pairs)")
    parser.add_argument("--ray-address", default=None, help="a Ray cluster the runs join")
    args = parser.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    if not names or any(n not in RUNS for n in names):
        parser.error(f"--runs takes {' and/or '.join(RUNS)}, comma-separated")
    if args.updates < 1 or args.rounds < 1 or args.eval_prompts < 1:
        parser.error("--updates, --rounds and --eval-prompts take 1 or more")
    if not args.prompts.is_file():
        print(f"skipped: {args.prompts} not found (the HH-RLHF prompts from ../shared)")
        return 0
    args.work = args.work or Path(tempfile.mkdtemp(prefix="hpref-rl-debate-"))
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    reward, scorer = ensure_export(args.reward, 0, args.work), ensure_export(args.scorer, 1, args.work)
    results: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        for name in names:
            print(f"round {round_}: {name} ...", flush=True)
            got = run_debate(name, round_, args, reward, scorer)
            results.setdefault(name, []).append(got)
            per, pss = got["seconds_per_update"], got["peak_pss_gib"]
            print(f"  {per:.1f} s / leader rollout, peak PSS {pss:.2f} GiB", flush=True)
    lines = report(results)
    print("\n".join(lines))
    if args.out:
        write_json(args.out, {"updates": args.updates, "runs": results, "table": lines})
    return 0


if __name__ == "__main__":
    sys.exit(main())
