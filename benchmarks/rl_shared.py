"""LoRA policies on one shared base against the same policies apart (issue #37).

    .venv/bin/python -m benchmarks.rl_shared [--rollouts 3] [--rounds 2]
        [--runs alone,shared-2,separate-2,shared-4] [--engine-adapters 1,2,4]
        [--reward DIR] [--work DIR] [--out FILE] [--policy DIR] [--prompts FILE] [--ray-address ADDR]

Two parts, both on SmolLM2-135M-Instruct with the shipped recipe's LoRA (r 16, alpha 32, every block
linear), HH-RLHF helpful-base prompts from ../shared, 8 prompts x 4 answers of at most 64 tokens:

- **Runs** (`hpref rl rl-smollm2`, `--rollouts` leader rollouts, no evals, one save at the end, the
  training reward `--reward`): `alone` is policy a by itself (N policies one after the other cost N
  times it), `shared-N` N policies on one base (`rl.share_base = true`: one engine, one trainer),
  `separate-2` two policies with an engine and a trainer each (`share_base = false`, what hpref did
  before); a name may end in `-vllm` (the vLLM engine), `-ttK` / `-etK` (K torch threads per trainer /
  engine), `-ex` / `-ea` (engines in the rollout executor's actor process / actors of their own), `-ed`
  (engines in the executor, the executor in the driver; unset: the defaults, `rl.engines_in_executor`
  and `rl.executor_in_driver`), and `--gpu` puts engines and trainers on the GPU
  (`benchmarks/gpu.sh` section 6). Per run: the leader's loop time to its last update over the
  rollouts (start-up excluded), the median time between its updates, the peak PSS of the whole process
  tree (driver, every Ray actor, Ray's daemons; RSS in brackets) and the mean load. The runs alternate
  round by round (alone, shared-2, separate-2, alone, ...); the table gives each one's median over its
  rounds.
- **Engine tokens/s** (in this process, one thread, as an engine actor): the transformers engine
  generating one rollout per adapter in one pass (`generate_batch` with `batch_rows = 0`: 1, 2, 4
  adapters of one base,
  each adapter with random non-zero weights, so they differ), against the engine of a policy of
  its own (`merged`: LoRA folded into the weights, what `share_base = false` serves).

The machine must be otherwise quiet: no tests, no helper sessions, no other training.

The suite's smoke run (tests/rl/test_rl_shared_benchmark.py) takes both parts through the same code
in seconds: `--policy` a config-built tiny Llama's folder instead of SmolLM2, `--prompts` a few toy
prompts instead of ../shared's, `--reward` a tiny reward export, and `--ray-address` the suite's Ray
cluster (each run joins it instead of starting its own; a run's memory is then its driver's alone,
as the actors live in the cluster's processes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, run_measured, write_json
from benchmarks.rl_real import HELPFUL, RECIPE, ensure_export, hpref_bin

EXTRA_POLICIES = "cdefgh"  # policies beyond a and b, as the recipe's a


def run_args(name: str) -> tuple[list[str], list[str]]:
    """(policies, --set settings) of a run: `alone`, `shared-N` or `separate-N`, then any of
    `-vllm` (the vLLM engine), `-ttK` (K torch threads per trainer), `-etK` (K per engine), `-ex` /
    `-ea` (the engines in the rollout executor's actor process / in actors of their own), `-ed` (the
    engines in the executor, the executor in the driver's process)."""
    kind, *options = name.split("-")
    count = 1 if kind == "alone" else int(options.pop(0))
    policies = ["a", "b", *EXTRA_POLICIES][:count]
    sets = [] if kind == "alone" else [f"rl.share_base={'true' if kind == 'shared' else 'false'}"]
    sets += [f"rl.policies.{p}={{}}" for p in policies[2:]]
    for option in options:
        if option == "vllm":
            sets.append('rl.engine.name="vllm"')
        elif option.startswith("tt"):
            sets.append(f"rl.defaults.threads={int(option[2:])}")
        elif option.startswith("et"):
            sets.append(f"rl.engine.threads={int(option[2:])}")
        elif option in ("ex", "ea", "ed"):  # engines in the executor's actor, in actors, in the driver
            sets.append(f"rl.engines_in_executor={'false' if option == 'ea' else 'true'}")
            sets.append(f"rl.executor_in_driver={'true' if option == 'ed' else 'false'}")
        else:
            raise SystemExit(f"unknown run option '{option}' in {name}")
    return policies, sets


#: `--gpu` (benchmarks/gpu.sh section 6; not run on the development machine): vLLM engines and trainer
#: ranks on the one GPU, split for Ray's books (each vLLM engine takes its memory share up front)
GPU_SETTINGS = (
    'rl.engine.name="vllm"',
    "rl.engine.num_gpus=0.2",
    "rl.engine.gpu_memory_utilization=0.2",
    "rl.defaults.gpus_per_rank=0.2",
)


def run_hpref(
    name: str,
    round_: int,
    rollouts: int,
    reward: Path,
    work: Path,
    gpu: bool = False,
    *,
    policy: str | None = None,
    prompts: Path = HELPFUL,
    ray_address: str | None = None,
) -> dict:
    """One `hpref rl` run of `name` (`run_args`), timed; `policy`: a causal-LM folder for every
    policy instead of the recipe's SmolLM2; `ray_address`: a Ray cluster to join instead of a local one."""
    policies, sets = run_args(name)
    sets += list(GPU_SETTINGS) if gpu else []
    sets += [f'rl.defaults.model={{ path = "{policy}" }}'] if policy else []
    folder = f"{name}-r{round_}"
    cmd = [
        hpref_bin(), "rl", str(RECIPE), "--policies", ",".join(policies),
        "--set", f'run.output_dir="{work}"', "--set", f'run.name="{folder}"',
        "--set", f'rl.prompts.path="{prompts}"', "--set", f'rl.reward.path="{reward}"',
        # the scorer only scores evals, and these runs have none: the training reward stands in
        "--set", f'rl.eval_scorer.path="{reward}"',
        "--set", f"rl.num_rollouts={rollouts}", "--set", "rl.eval_interval=0",
        "--set", f"rl.save_interval={rollouts}",
    ]  # fmt: skip
    for setting in sets:
        cmd += ["--set", setting]
    cmd += ["--ray-address", ray_address] if ray_address else []
    measured = run_measured(cmd, work / f"{folder}.log", timeout=3 * 3600)
    if measured["rc"] != 0:
        last = Path(measured["log"]).read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"{folder} failed ({last[0][:300]}): see {measured['log']}")
    rows = [json.loads(line) for line in (work / folder / "metrics" / "a.jsonl").read_text().splitlines()]
    times = [r["elapsed_s"] for r in rows if "loss" in r]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    out = {
        **measured,
        "policies": len(policies),
        "loop_to_last_update_s": times[-1],
        "seconds_per_leader_rollout": times[-1] / rollouts,
        "median_gap_s": statistics.median(gaps) if gaps else times[-1],
        "train_s_median": statistics.median(r["train_s"] for r in rows if "loss" in r),
    }
    write_json(work / f"{folder}-result.json", out)
    return out


def engine_tokens(adapters: int, prompts: list, seed: int, policy: str | None = None) -> dict:
    """One rollout per adapter (8 prompts x 4 answers, up to 64 tokens) in one batch; `adapters` 0:
    the engine of a policy of its own (its LoRA merged into the weights); `policy`: a causal-LM
    folder instead of SmolLM2."""
    import torch

    from hpref.models.lm_adapters import adapter_items
    from hpref.recipe.rl import PolicyLoraSection, PolicyModelConfig
    from hpref.rl.engines.transformers_engine import EngineActor
    from hpref.rl.rollout_types import GenerationRequest

    names = [f"p{i}" for i in range(adapters)]
    lora = PolicyLoraSection(r=16, alpha=32)
    adapters_of = dict.fromkeys(names, lora) or None
    # every request in one pass: what batching several adapters costs on this machine
    model = PolicyModelConfig(path=policy) if policy else PolicyModelConfig(name="smollm2")
    engine = EngineActor("a", model, adapters=adapters_of, batch_rows=0)
    generator = torch.Generator().manual_seed(seed)
    for name in names:  # adapters that differ, as trained ones do
        state = {
            k: torch.randn(v.shape, generator=generator) * 0.02 for k, v in adapter_items(engine.model, name)
        }
        engine.begin_update(1, adapter=name)
        engine.load_weights(state, adapter=name)
        engine.commit_update(adapter=name)
    requests = [
        GenerationRequest(
            prompts, group_size=4, max_new_tokens=64, temperature=1.0, seed=seed + i, adapter=name
        )
        for i, name in enumerate(names or [None])
    ]
    start = time.perf_counter()
    results = engine.generate_batch(requests)
    seconds = time.perf_counter() - start
    tokens = sum(r.tokens for r in results)
    return {"adapters": adapters, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def eval_prompts(count: int = 8, path: Path = HELPFUL) -> list:
    from hpref.recipe import load_recipe
    from hpref.rl.rollout.prompts import build_prompt_source

    recipe = load_recipe(RECIPE, [f'rl.prompts.path="{path}"'])
    source = build_prompt_source(recipe.rl)
    return source.train_prompts(0, 0, count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", default="alone,shared-2,separate-2,shared-4")
    parser.add_argument("--once", default="shared-4", help="runs measured in the first round only")
    parser.add_argument("--engine-adapters", default="1,2,4", help="empty: skip the engine part")
    parser.add_argument("--reward", type=Path, default=REPO / "runs" / "minilm-reward-helpful-f0-export")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--gpu", action="store_true", help="vLLM and trainer ranks on the GPU (gpu.sh)")
    parser.add_argument("--policy", default=None, help="a causal-LM folder instead of SmolLM2")
    parser.add_argument("--prompts", type=Path, default=HELPFUL, help="the prompt file (HH-RLHF pairs)")
    parser.add_argument("--ray-address", default=None, help="a Ray cluster the runs join")
    args = parser.parse_args(argv)
    if not args.prompts.is_file():
        print(f"skipped: {args.prompts} not found (the HH-RLHF prompts from ../shared)")
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="hpref-rl-shared-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results: dict[str, list[dict]] = {}
    engine: dict[int, list[dict]] = {}
    once = set(filter(None, args.once.split(",")))
    counts = [int(n) for n in args.engine_adapters.split(",") if n]
    prompts = eval_prompts(path=args.prompts) if counts else []
    reward = ensure_export(args.reward, 0, work) if args.runs else args.reward
    for round_ in range(args.rounds):
        for name in filter(None, args.runs.split(",")):
            if name in once and round_ > 0:
                continue
            print(f"round {round_}: {name} ...", flush=True)
            got = run_hpref(
                name, round_, args.rollouts, reward, work, args.gpu,
                policy=args.policy, prompts=args.prompts, ray_address=args.ray_address,
            )  # fmt: skip
            results.setdefault(name, []).append(got)
            per, pss = got["seconds_per_leader_rollout"], got["peak_pss_gib"]
            print(f"  {per:.1f} s / leader rollout, peak PSS {pss:.2f} GiB", flush=True)
        for n in [0, *counts] if counts else []:  # `--engine-adapters ""`: no engine part
            got = engine_tokens(n, prompts, seed=round_, policy=args.policy)
            engine.setdefault(n, []).append(got)
            print(f"round {round_}: engine with {n or 'merged'} adapters: {got['tokens_per_s']:.1f} tokens/s")
    lines = report(results, engine, args.rollouts)
    print("\n".join(lines))
    if args.out:
        write_json(args.out, {"rollouts": args.rollouts, "runs": results, "engine": engine, "table": lines})
    return 0


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(results: dict[str, list[dict]], engine: dict[int, list[dict]], rollouts: int) -> list[str]:
    lines = []
    if results:
        lines += [
            f"| run | policies | rounds | s / leader rollout ({rollouts}) | median s between updates "
            "| trainer s / rollout | peak PSS GiB (RSS) | load |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, runs in results.items():
            lines.append(
                f"| {name} | {runs[0]['policies']} | {len(runs)} "
                f"| {_median(runs, 'seconds_per_leader_rollout'):.1f} "
                f"| {_median(runs, 'median_gap_s'):.1f} | {_median(runs, 'train_s_median'):.1f} "
                f"| {_median(runs, 'peak_pss_gib'):.2f} ({_median(runs, 'peak_rss_gib'):.2f}) "
                f"| {_median(runs, 'load_mean'):.2f} |"
            )
        alone = results.get("alone")
        if alone:
            lines.append("")
            for name, runs in results.items():
                if name == "alone":
                    continue
                n = runs[0]["policies"]
                wall = _median(runs, "loop_to_last_update_s") / (n * _median(alone, "loop_to_last_update_s"))
                memory = _median(runs, "peak_pss_gib") / _median(alone, "peak_pss_gib")
                lines.append(f"{name}: loop time / {n} x alone = {wall:.2f}; peak PSS / alone = {memory:.2f}")
    if engine:
        merged = _median(engine[0], "tokens_per_s") if 0 in engine else None
        lines += ["", "| engine | answers per pass | tokens/s | vs merged |", "| --- | ---: | ---: | ---: |"]
        for n, runs in sorted(engine.items()):
            speed = _median(runs, "tokens_per_s")
            label = (
                "policy of its own (merged)" if n == 0 else f"{n} adapter{'s' if n > 1 else ''}, one batch"
            )
            versus = f"{speed / merged:.2f}" if merged else "-"
            lines.append(f"| {label} | {32 * max(n, 1)} | {speed:.1f} | {versus} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
