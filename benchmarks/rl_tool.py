"""Tool use learnt by RL: SmolLM2-135M-Instruct with the calculator on generated arithmetic (issue #49).

    .venv/bin/python -m benchmarks.rl_tool [--updates N] [--eval-prompts K] [--policy CAUSAL_LM_FOLDER]
                                           [--work DIR] [--out FILE] [--ray-address ADDR]

What runs: `hpref rl rl-tool-smollm2` (the shipped recipe: one LoRA policy, GRPO on the rule reward
`matches_reference`, the `tool` environment with the calculator, prompts from the `arithmetic` source:
3-5 digit + - * and exact /, the calculator's use spelt out in each prompt) for N updates, with an eval
of K held-out problems (greedy answers) before the first update and after the last; the last eval's row
holds the start's figures beside its own. Reported: the eval success rate (the share of held-out
problems whose final answer is exactly the reference) and the share of eval answers that called the
tool, at the start and after N updates; the seconds per update (the run's loop time up to its last
update over N, from the metrics rows, as `benchmarks.rl_real` counts it: start-up and the final eval
excluded, the start's eval included) and the median seconds between updates (no eval in it: the steady
figure); the training reward of the first and last updates; the 1-minute load average over the run (on a
shared machine: how many other runnable processes competed for the cores). `--policy`: a causal-LM
folder instead of SmolLM2 (the suite's smoke test: a tiny model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO, run_measured, write_json

RECIPE = REPO / "recipes" / "rl-tool-smollm2.toml"


def hpref_bin() -> str:
    return str(Path(sys.executable).with_name("hpref"))


def run_tool(
    updates: int, eval_prompts: int, work: Path, policy: str | None = None, ray_address: str | None = None
) -> dict:
    """One `hpref rl` run of the recipe for `updates` updates and its figures (`tool_figures`)."""
    cmd = [
        hpref_bin(), "rl", str(RECIPE), "--policies", "a",
        "--set", f'run.output_dir="{work}"', "--set", 'run.name="rl-tool"',
        "--set", f"rl.num_rollouts={updates}", "--set", f"rl.eval_interval={updates}",
        "--set", f"rl.save_interval={updates}", "--set", f"rl.rollout.eval_prompts={eval_prompts}",
    ]  # fmt: skip
    cmd += ["--set", f'rl.defaults.model={{ path = "{policy}" }}'] if policy else []
    cmd += ["--ray-address", ray_address] if ray_address else []
    measured = run_measured(cmd, work / "rl-tool.log", timeout=4 * 3600)
    if measured["rc"] != 0:
        last = Path(measured["log"]).read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"hpref rl failed ({last[0][:300]}): see {measured['log']}")
    rows = [json.loads(line) for line in (work / "rl-tool" / "metrics" / "a.jsonl").read_text().splitlines()]
    return {
        **measured,
        **tool_figures(rows, updates),
        "policy": policy or "smollm2",
        "eval_prompts": eval_prompts,
    }


def tool_figures(rows: list[dict], updates: int) -> dict:
    """The figures of one run's metrics rows (`metrics/a.jsonl`): its training rows and its last eval's."""
    train = [r for r in rows if not r.get("eval")]
    evaluation = [r for r in rows if r.get("eval")][-1]
    times = [r["elapsed_s"] for r in train]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        "updates": len(train),
        "seconds_per_update": times[-1] / updates,
        "median_gap_s": statistics.median(gaps) if gaps else times[-1],
        "reward_first": train[0]["reward_mean"],
        "reward_last": train[-1]["reward_mean"],
        "success_start": evaluation["eval_success_start"],
        "success_end": evaluation["eval_success"],
        "tool_call_share_start": evaluation["eval_tool_call_share_start"],
        "tool_call_share_end": evaluation["eval_tool_call_share"],
        "turns_start": evaluation["eval_turns_start"],
        "turns_end": evaluation["eval_turns"],
    }


def report(result: dict) -> list[str]:
    n = result["updates"]
    return [
        f"| policy | eval problems | success: start | after {n} | tool-call share: start | after {n} "
        "| s / update | median s between updates | load |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {Path(result['policy']).name} | {result['eval_prompts']} | {result['success_start']:.3f} "
        f"| {result['success_end']:.3f} | {result['tool_call_share_start']:.3f} "
        f"| {result['tool_call_share_end']:.3f} | {result['seconds_per_update']:.1f} "
        f"| {result['median_gap_s']:.1f} | {result['load_mean']:.2f} |",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=10, help="updates (rollouts) before the eval")
    parser.add_argument("--eval-prompts", type=int, default=32, help="held-out problems the eval answers")
    parser.add_argument("--policy", default=None, help="a causal-LM folder instead of SmolLM2")
    parser.add_argument(
        "--work", type=Path, default=None, help="the run folder's parent (default: a temp dir)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    parser.add_argument("--ray-address", default=None, help="a Ray cluster the run joins")
    args = parser.parse_args(argv)
    if args.updates < 1 or args.eval_prompts < 1:
        parser.error("--updates and --eval-prompts take 1 or more")
    work = args.work or Path(tempfile.mkdtemp(prefix="hpref-rl-tool-"))
    work.mkdir(parents=True, exist_ok=True)
    result = run_tool(args.updates, args.eval_prompts, work, args.policy, args.ray_address)
    lines = report(result)
    print("\n".join(lines))
    if args.out:
        write_json(args.out, {**result, "table": lines})
    return 0


if __name__ == "__main__":
    sys.exit(main())
