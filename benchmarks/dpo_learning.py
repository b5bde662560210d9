"""Does offline DPO teach SmolLM2 the preference? A held-out scorer compares the DPO policy's greedy
answers with its start's (issue #38, "learning").

    .venv/bin/python -m benchmarks.dpo_learning [--steps 120] [--prompts 64] [--scorer DIR] [--work DIR]

1. `hpref train dpo-smollm2` on half of HH-RLHF helpful-base (2 folds by prompt: fold 0's training
   half, the same pairs `recipes/rl-smollm2.toml`'s training reward learns from), `--steps` optimizer
   steps, then `hpref save` (LoRA merged: a transformers causal-LM folder).
2. `--prompts` prompts of the other half (the DPO never saw them, nor any answer to them), answered
   greedily (at most 64 new tokens) by the start (SmolLM2-135M-Instruct) and by the DPO export, each
   through hpref's transformers engine (`hpref.rl.engines.transformers_engine.EngineActor`, the chat template
   applied).
3. The scorer, `runs/minilm-reward-helpful-f1-export` (a MiniLM reward model trained with hpref on
   the other half: the same preference, from pairs the DPO never trained on; trained here if missing,
   as `benchmarks.rl_real.ensure_export` does), judges each (DPO answer, start answer) pair in both
   orders (`ExportScorer.judge_job`, swap-averaged): win = P(DPO preferred) + P(tie) / 2.

Reports the mean win rate with its standard error over prompts (> 0.5 by more than two standard
errors: the DPO policy's answers are preferred), the share of prompts where the DPO answer wins
outright, the answers' mean lengths (a win that is only length shows here), and the DPO run's last
eval (implicit-reward accuracy on held-out pairs). Writes the answers and scores to `--work`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import REPO, run_measured, write_json
from benchmarks.rl_real import HELPFUL, ensure_export, hpref_bin

RECIPE = REPO / "recipes" / "dpo-smollm2.toml"


def train_and_export(steps: int, work: Path) -> Path:
    """The DPO run on fold 0's training half, exported; returns the export folder."""
    runs, export = work / "runs", work / "dpo-smollm2-export"
    data = [f"dataset.{split}.{key}={value}" for split in ("train", "eval") for key, value in (
        ("path", f'"{HELPFUL}"'), ("folds", 2), ("fold", 0))]  # fmt: skip
    cmd = [
        hpref_bin(),
        "train",
        str(RECIPE),
        "--set",
        f'run.output_dir="{runs}"',
        "--set",
        f"train.max_steps={steps}",
        # no eval pass over the held-out half (~1,200 pairs, longer than the training here): the
        # judged answers below are this benchmark's eval
        "--set",
        "train.eval_interval=0",
        "--set",
        "train.eval_steps=0",
    ]
    for setting in data:
        cmd += ["--set", setting]
    trained = run_measured(cmd, work / "dpo-train.log", timeout=4 * 3600)
    if trained["rc"] != 0:
        raise SystemExit(f"hpref train failed: see {trained['log']}")
    saved = run_measured(
        [hpref_bin(), "save", str(runs / "dpo-smollm2"), "--to", str(export)], work / "dpo-save.log"
    )
    if saved["rc"] != 0:
        raise SystemExit(f"hpref save failed: see {saved['log']}")
    print(
        f"DPO: {steps} steps in {trained['wall_s']:.0f} s (load {trained['load_mean']:.2f}), exported",
        flush=True,
    )
    return export


def held_out_prompts(count: int) -> list[tuple[str, ...]]:
    """The first `count` distinct prompts (at most 1,000 characters, as rl-smollm2's) of fold 0's
    held-out half: the conversation before the final answer of each pair."""
    from hpref.data.prompts import prompt_of_battle
    from hpref.plugins import load_plugins

    component = load_plugins().get("dataset", "pairwise")
    config = component.config.model_validate({"path": str(HELPFUL), "folds": 2, "fold": 0, "split": "eval"})
    seen, out = set(), []
    for battle in component.build(config, 0).battles():
        prompt = prompt_of_battle(battle)
        if prompt in seen or sum(map(len, prompt)) > 1000:
            continue
        seen.add(prompt)
        out.append(prompt)
        if len(out) == count:
            break
    return out


def greedy_answers(model: dict, prompts: list[tuple[str, ...]]) -> tuple[list[str], list[int]]:
    from hpref.recipe.rl import PolicyModelConfig
    from hpref.rl.engines.transformers_engine import EngineActor

    engine = EngineActor("a", PolicyModelConfig(**model))
    texts, lengths = [], []
    for start in range(0, len(prompts), 16):
        out = engine.generate(prompts[start : start + 16], 1, 64, 1.0, greedy=True)
        texts += out.texts
        lengths += [len(c) for c in out.completions]
    return texts, lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="DPO optimizer steps (8 pairs each)")
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts answered and judged")
    parser.add_argument("--scorer", type=Path, default=REPO / "runs" / "minilm-reward-helpful-f1-export")
    parser.add_argument("--export", type=Path, default=None, help="a DPO export to judge (skips training)")
    parser.add_argument("--work", type=Path, default=None, help="keep runs and answers here")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="hpref-dpo-learning-"))
    work.mkdir(parents=True, exist_ok=True)
    scorer_path = ensure_export(args.scorer, 1, work)
    export = args.export or train_and_export(args.steps, work)
    prompts = held_out_prompts(args.prompts)
    start, start_len = greedy_answers({"name": "smollm2"}, prompts)
    tuned, tuned_len = greedy_answers({"path": str(export)}, prompts)

    from hpref.builtin.scoring import ExportScorer

    scorer = ExportScorer.load(str(scorer_path), formatter="pab", max_length=512, micro_batch_tokens=16384)
    verdicts = scorer.run(
        [scorer.judge_job(p, a, b, swap=True) for p, a, b in zip(prompts, tuned, start, strict=True)]
    )
    wins = [p_a + 0.5 * p_tie for p_a, _p_b, p_tie in verdicts]
    mean = statistics.fmean(wins)
    se = statistics.stdev(wins) / math.sqrt(len(wins))
    result = {
        "prompts": len(prompts),
        "win_rate": mean,
        "standard_error": se,
        "outright_wins": sum(p_a > p_b for p_a, p_b, _ in verdicts) / len(verdicts),
        "identical_answers": sum(a == b for a, b in zip(tuned, start, strict=True)) / len(prompts),
        "tokens_dpo": statistics.fmean(tuned_len),
        "tokens_start": statistics.fmean(start_len),
        "export": str(export),
        "scorer": str(scorer_path),
    }
    write_json(work / "dpo-learning.json", result)
    with (work / "dpo-learning-answers.jsonl").open("w") as f:
        for p, a, b, v in zip(prompts, tuned, start, verdicts, strict=True):
            f.write(json.dumps({"prompt": p, "dpo": a, "start": b, "verdict": v}) + "\n")
    print(json.dumps(result, indent=2))
    print(f"DPO policy over its start: win rate {mean:.3f} +/- {se:.3f} ({len(prompts)} held-out prompts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
