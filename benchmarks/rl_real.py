"""Multi-policy RL on a real model, side by side with TRL's GRPOTrainer (issue #22).

    .venv/bin/python -m benchmarks.rl_real [--rollouts N] [--contenders hpref-2,hpref-1,trl-bf16,hpref-1-vllm]
                                           [--reward DIR] [--scorer DIR] [--out benchmarks/RL.md]
                                           [--dpo-prompts P] [--eval-prompts K]

What runs (all on SmolLM2-135M-Instruct with LoRA r 16 / alpha 32 on every block linear, HH-RLHF
helpful-base prompts from ../shared, 8 prompts x 4 answers of at most 64 tokens per update, the
recipe's learning rate and KL coefficient (TRL gets the same), temperature 1, one optimizer step per
rollout):

- `hpref-2`: `hpref rl rl-smollm2 --policies a,b` for N leader rollouts: two policies at once on one
  local Ray cluster (the shipped recipe; b samples at temperature 0.8). Each starts and ends with an
  eval: greedy answers to 32 held-out prompts scored by the training reward and by the second scorer.
- `hpref-1`: the same recipe with policy a alone (what "one after the other" costs is twice this).
- `hpref-1-vllm` / `hpref-2-vllm`: the same on the vLLM engine (`--set rl.engine.name="vllm"`, #24).
- `trl-bf16` / `trl-fp32`: TRL's `GRPOTrainer` (`benchmarks.rl_trl`) with the same model, LoRA, prompts
  in the same order, the same reward function (the same MiniLM reward-model export, one score per
  answer), group size, answer length, learning rate and number of updates; TRL's transformers
  generation on the CPU; bf16 is TRL's best setting on this CPU (hpref's trainer computes in bf16
  autocast here: `precision = "auto"`), fp32 its default.
- Online DPO (issue #38; `benchmarks.online_dpo_trl`): `hpref-1-dpo` (`hpref-2-dpo`) is the same recipe
  with every policy's `algorithm = { name = "online-dpo", loss_type = "sigmoid", beta = 0.1 }`,
  `rl.rollout.group_size = 2` and `--dpo-prompts` prompts per rollout (default 8: 16 answers per
  update); `trl-dpo-bf16` / `trl-dpo-fp32` TRL's `OnlineDPOTrainer` with the same model, LoRA, prompts
  in the same order, reward export (a score per answer, the higher one chosen), 2 answers per prompt,
  answer length, temperature, learning rate, beta and number of updates. Their own table: seconds per
  update, peak PSS, the DPO loss, hpref / TRL.

The rewards: `--reward` (default `runs/minilm-reward-helpful-f0-export`) and `--scorer` (default
`runs/minilm-reward-helpful-f1-export`), the recipe's two: `hpref train minilm-reward` on the two
halves of helpful-base (2 folds by prompt), so the scorer judges the same preference from data the
reward never saw; a missing one is trained here and exported with `hpref save`. Per contender: wall
time of the process, seconds per update (hpref: the leader's loop time up to its last update over N,
start-up and the final eval excluded as for TRL, whose `train()` is timed; both also the median time
between consecutive updates), the peak PSS (and RSS) of the process tree (hpref: the driver, every
Ray actor and Ray's own daemons; PSS splits the pages they share, which summed RSS counts once per
process), the mean 1-minute load average, and the training reward of the first and last updates;
hpref also the eval numbers. Contenders run in the order given, one at a time; the machine must be
otherwise quiet. `--eval-prompts` shortens hpref's start and end evals (smoke runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO, python_module, read_json, run_measured, write_json

HELPFUL = REPO.parent / "shared" / "data" / "hh-rlhf-helpful-base-test.jsonl.gz"
RECIPE = REPO / "recipes" / "rl-smollm2.toml"
REWARD_ENV = "HPREF_BENCH_REWARD"
HPREF_CONTENDERS = [
    f"hpref-{n}{algo}{engine}" for n in (1, 2) for algo in ("", "-dpo") for engine in ("", "-vllm")
]
TRL_CONTENDERS = [f"trl-{algo}{precision}" for algo in ("", "dpo-") for precision in ("bf16", "fp32")]


# --------------------------------------------------------------------------------------------------
# the reward function TRL calls (in its own process): hpref's judge reward on the same export


_REWARD = None


def trl_reward(prompts: list[list[dict]], completions: list[str], **_: object) -> list[float]:
    """The MiniLM reward model's score of each completion with its conversation, exactly as hpref's
    `judge` reward scores a rollout (one sequence per answer)."""
    global _REWARD
    if _REWARD is None:
        from hpref.builtin.rewards import JudgeConfig, JudgeReward

        _REWARD = JudgeReward(JudgeConfig(path=os.environ[REWARD_ENV]))
    turns = [tuple(m["content"] for m in p if m["role"] != "system") for p in prompts]
    scores = _REWARD.score_groups(turns, [[c] for c in completions])
    return [float(s[0]) for s in scores]


# --------------------------------------------------------------------------------------------------


def hpref_bin() -> str:
    return str(Path(sys.executable).with_name("hpref"))


def ensure_export(path: Path, fold: int, work: Path) -> Path:
    """`path` if it holds an export; else train `minilm-reward` on helpful-base with 2 folds by prompt,
    `fold` held out (fold 0: the training reward; fold 1: the scorer, trained on the other half), as
    `recipes/rl-smollm2.toml` says, and save it."""
    if (path / "hpref_model.json").is_file():
        return path
    runs = work / "reward-runs"
    name = f"minilm-reward-helpful-f{fold}"
    data = [f'dataset.{split}.{key}={value}' for split in ("train", "eval") for key, value in (
        ("path", f'"{HELPFUL}"'), ("folds", 2), ("fold", fold))]  # fmt: skip
    cmd = [
        hpref_bin(),
        "train",
        "minilm-reward",
        "--set",
        f'run.name="{name}"',
        "--set",
        f'run.output_dir="{runs}"',
    ]
    for setting in data:
        cmd += ["--set", setting]
    train = run_measured(cmd, work / f"{name}-train.log", timeout=3600)
    if train["rc"] != 0:
        raise SystemExit(f"training the reward model {name} failed: see {train['log']}")
    saved = run_measured(
        [hpref_bin(), "save", str(runs / name), "--to", str(path)], work / f"{name}-save.log", timeout=600
    )
    if saved["rc"] != 0:
        raise SystemExit(f"exporting the reward model {name} failed: see {saved['log']}")
    print(f"reward model {name}: trained in {train['wall_s']:.0f} s, exported to {path}", flush=True)
    return path


def run_hpref_rl(
    name: str, rollouts: int, reward: Path, scorer: Path, work: Path, dpo_prompts: int, eval_prompts: int
) -> dict:
    """`hpref-2` / `hpref-1` (policies a,b / a), `-vllm` on the vLLM engine (#24), `-dpo` online DPO
    (#38) on TRL's terms (`benchmarks.online_dpo_trl.hpref_overrides`)."""
    policies = hpref_policies(name)
    cmd = [
        hpref_bin(), "rl", str(RECIPE), "--policies", policies,
        "--set", f'run.output_dir="{work}"', "--set", f'run.name="{name}"',
        "--set", f'rl.prompts.path="{HELPFUL}"',
        "--set", f'rl.reward.path="{reward}"', "--set", f'rl.eval_scorer.path="{scorer}"',
        "--set", f"rl.num_rollouts={rollouts}", "--set", f"rl.eval_interval={rollouts}",
        "--set", f"rl.save_interval={rollouts}",
    ]  # fmt: skip
    if name.endswith("-vllm"):
        cmd += ["--set", 'rl.engine.name="vllm"']
    if "-dpo" in name:
        from benchmarks.online_dpo_trl import hpref_overrides

        cmd += hpref_overrides(dpo_prompts)
    if eval_prompts:
        cmd += ["--set", f"rl.rollout.eval_prompts={eval_prompts}"]
    measured = run_measured(cmd, work / f"{name}.log", timeout=4 * 3600)
    if measured["rc"] != 0:
        raise SystemExit(f"{name} failed: see {measured['log']}")
    write_json(work / f"{name}-measured.json", measured)
    return hpref_result(work / name, policies, rollouts, measured)


def hpref_policies(name: str) -> str:
    return "a,b" if name.startswith("hpref-2") else "a"


def hpref_result(run: Path, policies: str, rollouts: int, measured: dict) -> dict:
    """The numbers of one hpref run folder. Seconds per update: the leader's loop time up to its last
    update (`elapsed_s` of its last training row) over the updates, so the final eval is not counted,
    as TRL's timed `train()` has none; also the median gap between consecutive updates (steady state:
    generation of the next rollout overlaps training on this one)."""
    summary = read_json(run / "rl_summary.json")
    leader = [json.loads(line) for line in (run / "metrics" / "a.jsonl").read_text().splitlines()]
    times = [r["elapsed_s"] for r in leader if not r.get("eval")]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    out = {
        **measured,
        "seconds_per_update": times[-1] / rollouts,
        "seconds_per_update_steady": statistics.median(gaps) if gaps else times[-1],
        "drive_s": summary["drive_s"],
        "loop_to_last_update_s": times[-1],
    }
    for p in policies.split(","):
        rows = [json.loads(line) for line in (run / "metrics" / f"{p}.jsonl").read_text().splitlines()]
        train = [r for r in rows if not r.get("eval")]
        ev = [r for r in rows if r.get("eval")][-1]
        out[p] = {
            "reward_first": train[0]["reward_mean"],
            "reward_last": train[-1]["reward_mean"],
            "reward_last_quarter": statistics.mean(
                r["reward_mean"] for r in train[-max(1, len(train) // 4) :]
            ),
            "reward_first_quarter": statistics.mean(
                r["reward_mean"] for r in train[: max(1, len(train) // 4)]
            ),
            "train_s_median": statistics.median(r["train_s"] for r in train),
            "gen_tokens_per_s_median": statistics.median(r["gen_tokens_per_s"] for r in train),
            # seconds the engine spent generating each rollout (its tokens over its tokens per s)
            "gen_s_median": statistics.median(r["gen_tokens"] / r["gen_tokens_per_s"] for r in train),
            # the engine's log-probs against the trainer's (GRPO; online DPO samples without them)
            "engine_trainer_logprob_diff": statistics.mean(
                r.get("engine_trainer_logprob_diff", 0.0) for r in train
            ),
            **{k: v for k, v in ev.items() if k.startswith("eval_")},
        }
        if "judged_pairs" in train[0]:  # online DPO: its loss, accuracy (reward_mean is pairwise)
            from benchmarks.online_dpo_trl import hpref_fields

            out[p].update(hpref_fields(train))
    out["leaderboard"] = summary["leaderboard"]
    return out


def recipe_defaults() -> dict:
    """The shipped recipe's policy defaults: TRL trains at the same learning rate and KL coefficient
    (TRL's `beta`: its k3 KL to the reference in the loss, as GRPO's `kl_coef` in `algorithm`)."""
    import tomllib

    return tomllib.loads(RECIPE.read_text())["rl"]["defaults"]


def run_trl(name: str, rollouts: int, reward: Path, work: Path, dpo_prompts: int) -> dict:
    """`trl-bf16` / `trl-fp32`: TRL's GRPOTrainer (`benchmarks.rl_trl`); `trl-dpo-bf16` / `trl-dpo-fp32`:
    its OnlineDPOTrainer (`benchmarks.online_dpo_trl`)."""
    from hpref.builtin.prompts import PairwisePromptsConfig, build_pairwise
    from hpref.data.prompts import conversation_messages
    from hpref.models.hf import gguf_folder, smollm2_file

    dpo = name.startswith("trl-dpo-")
    precision = name.rsplit("-", 1)[1]
    per_update = dpo_prompts if dpo else 8
    # the recipe's prompt stream, in hpref's order: policy a's rollout r answers prompts [Pr, Pr + P)
    source = build_pairwise(
        PairwisePromptsConfig(path=str(HELPFUL), eval_fraction=0.05, max_prompt_chars=1000)
    )
    prompts = [conversation_messages(p) for p in source.train_prompts(0, 0, rollouts * per_update)]
    spec = {
        "model_path": str(gguf_folder(smollm2_file(), "causal-lm")),
        "prompts": prompts,
        "reward": "benchmarks.rl_real:trl_reward",
        "group_size": 2 if dpo else 4,
        "prompts_per_update": per_update,
        "num_updates": rollouts,
        "max_new_tokens": 64,
        "temperature": 1.0,
        "lr": float(recipe_defaults()["lr"]),
        "beta": float(recipe_defaults().get("algorithm", {}).get("kl_coef", 0.0)),
        "lora": {
            "r": 16,
            "alpha": 32,
            "dropout": 0.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        },  # fmt: skip
        "bf16": precision == "bf16",
        "gradient_checkpointing": False,
        "threads": os.cpu_count() or 1,
        "seed": 0,
        "output_dir": str(work / name),
    }
    if dpo:
        from benchmarks import online_dpo_trl

        spec.update(beta=online_dpo_trl.BETA, loss_type=online_dpo_trl.LOSS_TYPE)
    spec_file = write_json(work / f"{name}.json", spec)
    result_file = work / f"{name}-result.json"
    env = {**os.environ, REWARD_ENV: str(reward), "PYTHONPATH": str(REPO)}
    module = "benchmarks.online_dpo_trl" if dpo else "benchmarks.rl_trl"
    measured = run_measured(
        python_module(module, str(spec_file), "--out", str(result_file)),
        work / f"{name}.log",
        env=env,
        timeout=4 * 3600,
    )
    if measured["rc"] != 0:
        raise SystemExit(f"{name} failed: see {measured['log']}")
    write_json(work / f"{name}-measured.json", measured)
    return any_trl_result(name, read_json(result_file), measured)


def any_trl_result(name: str, got: dict, measured: dict) -> dict:
    if name.startswith("trl-dpo-"):
        from benchmarks import online_dpo_trl

        return online_dpo_trl.trl_result(got, measured)
    return trl_result(got, measured)


def trl_result(got: dict, measured: dict) -> dict:
    rewards = got["mean_reward_per_update"]
    quarter = max(1, len(rewards) // 4)
    return {
        **measured,
        "seconds_per_update": got["wall_s"] / len(got["seconds_per_update"]),
        "seconds_per_update_steady": statistics.median(got["seconds_per_update"]),
        "drive_s": got["wall_s"],
        "loop_to_last_update_s": got["wall_s"],
        "a": {
            "reward_first": rewards[0],
            "reward_last": rewards[-1],
            "reward_first_quarter": statistics.mean(rewards[:quarter]),
            "reward_last_quarter": statistics.mean(rewards[-quarter:]),
        },
        "trl": {k: got[k] for k in ("trl_version", "settings") if k in got},
    }


def table(results: dict[str, dict], rollouts: int, eval_prompts: int = 0) -> list[str]:
    grpo = [name for name in results if "-dpo" not in name]  # DPO: `benchmarks.online_dpo_trl.table`
    lines = [
        "| contender | wall (s) | loop to last update (s) | s / update | median s between updates "
        "| leader's generation s (share of a step) | peak PSS GiB (RSS) | load | reward, first -> last 1/4 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ] if grpo else []  # fmt: skip
    for name, r in results.items():
        if name not in grpo:
            continue
        policies = [p for p in ("a", "b") if p in r]
        rewards = "; ".join(
            f"{p}: {r[p]['reward_first_quarter']:+.3f} -> {r[p]['reward_last_quarter']:+.3f}"
            for p in policies
        )
        gen = r.get("a", {}).get("gen_s_median")
        generating = f"{gen:.1f} ({gen / r['seconds_per_update_steady']:.0%})" if gen else "-"
        lines.append(
            f"| {name} | {r['wall_s']:.0f} | {r['loop_to_last_update_s']:.0f} | "
            f"{r['seconds_per_update']:.1f} | {r['seconds_per_update_steady']:.1f} | {generating} | "
            f"{r.get('peak_pss_gib', float('nan')):.2f} ({r['peak_rss_gib']:.2f}) | "
            f"{r['load_mean']:.2f} | {rewards} |"
        )
    evals = []
    for name, r in results.items():
        for p in ("a", "b"):
            e = r.get(p, {})
            if "eval_reward" not in e:
                continue
            evals.append(
                f"| {name} {p} | {e['eval_reward_start']:+.3f} -> {e['eval_reward']:+.3f} | "
                f"{e['eval_scorer_start']:+.3f} -> {e['eval_scorer']:+.3f} | "
                f"{e.get('eval_scorer_win_rate_vs_start', float('nan')):.3f} | "
                f"{e['eval_answer_tokens_start']:.1f} -> {e['eval_answer_tokens']:.1f} | "
                f"{e.get('eval_kl', 0):.4f} |"
            )
    if evals:
        lines += [
            "",
            f"Held-out eval after {rollouts} updates ({eval_prompts or 32} prompts, greedy; start -> end):",
            "",
            "| run, policy | training reward | second scorer | win vs start (scorer) | answer tokens | KL |",
            "| --- | --- | --- | ---: | --- | ---: |",
            *evals,
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=40, help="updates per policy")
    parser.add_argument("--contenders", default="hpref-2,hpref-1,trl-bf16")
    parser.add_argument("--reward", type=Path, default=REPO / "runs" / "minilm-reward-helpful-f0-export")
    parser.add_argument("--scorer", type=Path, default=REPO / "runs" / "minilm-reward-helpful-f1-export")
    parser.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    parser.add_argument("--dpo-prompts", type=int, default=8, help="online DPO: prompts per update")
    parser.add_argument("--eval-prompts", type=int, default=0, help="hpref's eval prompts (0: the recipe's)")
    parser.add_argument("--work", type=Path, default=None, help="keep runs here (default: a temp folder)")
    parser.add_argument(
        "--reread", action="store_true", help="rebuild the table from the runs already in --work, run nothing"
    )
    args = parser.parse_args(argv)
    if not HELPFUL.is_file():
        print(f"skipped: the HH-RLHF files are not in {HELPFUL.parent}")
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="hpref-rl-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if not args.reread:
        reward = ensure_export(args.reward, 0, work)
        scorer = ensure_export(args.scorer, 1, work)
    results: dict[str, dict] = {}
    for name in args.contenders.split(",") if args.reread else []:
        measured = read_json(work / f"{name}-measured.json")
        if name.startswith("hpref-"):
            results[name] = hpref_result(work / name, hpref_policies(name), args.rollouts, measured)
        else:
            results[name] = any_trl_result(name, read_json(work / f"{name}-result.json"), measured)
    for name in [] if args.reread else args.contenders.split(","):
        print(f"running {name} ...", flush=True)
        if name in HPREF_CONTENDERS:
            results[name] = run_hpref_rl(
                name, args.rollouts, reward, scorer, work, args.dpo_prompts, args.eval_prompts
            )
        elif name in TRL_CONTENDERS:
            results[name] = run_trl(name, args.rollouts, reward, work, args.dpo_prompts)
        else:
            raise SystemExit(f"unknown contender {name}")
        print(f"{name}: {results[name]['seconds_per_update']:.1f} s / update", flush=True)
    lines = table(results, args.rollouts, args.eval_prompts)
    if "hpref-1" in results and "hpref-2" in results:
        ratio = results["hpref-2"]["loop_to_last_update_s"] / (
            2 * results["hpref-1"]["loop_to_last_update_s"]
        )
        lines += ["", f"two policies at once / one after the other (loop time): {ratio:.2f}"]
    if "hpref-1" in results and "hpref-1-vllm" in results:
        ratio = results["hpref-1-vllm"]["seconds_per_update"] / results["hpref-1"]["seconds_per_update"]
        lines += [f"hpref-1-vllm / hpref-1 seconds per update: {ratio:.2f}"]
    for trl in [n for n in results if n.startswith("trl-") and "-dpo" not in n]:
        if "hpref-1" in results:
            ratio = results["hpref-1"]["seconds_per_update"] / results[trl]["seconds_per_update"]
            lines += [f"hpref-1 / {trl} seconds per update: {ratio:.2f}"]
    dpo = {name: r for name, r in results.items() if "-dpo" in name}
    if dpo:
        from benchmarks import online_dpo_trl

        lines += ["", f"Online DPO, {args.dpo_prompts} prompts x 2 answers per update:", ""]
        lines += online_dpo_trl.table(dpo)
    print("\n".join(lines))
    if args.out:
        write_json(args.out, {"rollouts": args.rollouts, "results": results, "table": lines})
    return 0


if __name__ == "__main__":
    sys.exit(main())
