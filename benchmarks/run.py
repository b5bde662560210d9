"""One invocation, one machine: ceilings, hpref vs HF Trainer vs TRL, eval throughput, RL concurrency.

    python -m benchmarks.run [--quick] [--out benchmarks/RESULTS.md] [--keep DIR]

Every trainer runs in its own subprocess; the parent samples the peak RSS of that process tree.
See benchmarks/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import REPO, python_module, read_json, run_measured, write_json

HPREF = str(Path(sys.executable).with_name("hpref"))


# ------------------------------------------------------------------------------------------ ceilings
def matmul_flops(dtype: torch.dtype, size: int, seconds: float) -> float:
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - t))
    return best


def copy_bandwidth(nbytes: int, seconds: float) -> float:
    """Bytes moved per second (read + write) by a large fp32 tensor copy, best of a burst."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * nbytes / (time.perf_counter() - t))
    return best


def ceilings(quick: bool) -> dict:
    secs = 1.0 if quick else 3.0
    return {
        # a ceiling measured while other work ran is too low, and every MFU against it too high
        "load": os.getloadavg()[0],
        "threads": torch.get_num_threads(),
        "fp32_flops": matmul_flops(torch.float32, 2048, secs),
        "bf16_flops": matmul_flops(torch.bfloat16, 2048, secs),
        "copy_bytes_per_s": copy_bandwidth(512 * 2**20, secs),
    }


def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


# ------------------------------------------------------------------------------------------ recipes
TINY_LLAMA = (
    '[model]\nname = "tiny-llama"\nhidden_size = 128\nnum_hidden_layers = 4\n'
    "num_attention_heads = 4\nnum_key_value_heads = 2\nintermediate_size = 352\n"
)
MINILM = '[model]\nname = "minilm"\npooling = "first"\n'
#: Per backbone: model section, optimizer LRs. The pretrained MiniLM gets a fine-tuning LR for the
#: backbone and a larger one for the fresh head; the random-init tiny-llama one LR for all.
MODELS = {
    "tiny-llama": (TINY_LLAMA, "lr = 1e-3\n"),
    "minilm": (MINILM, "lr = 5e-5\nhead_lr = 1e-3\n"),
}


def synthetic_recipe(model: str, battles: int, epochs: int, nproc: int, precision: str = "fp32") -> str:
    model_toml, optim = MODELS[model]
    data = "".join(
        f'[dataset.{s}]\nname = "synthetic-arena"\nnum_battles = {battles}\n'
        f'folds = 5\nfold = 0\nsplit = "{s}"\n\n'
        for s in ("train", "eval")
    )
    return _recipe(f"bench-{model}", model_toml, data, optim, epochs, nproc, precision)


def pairwise_recipe(
    rows: int, epochs: int, nproc: int, model: str = "tiny-llama", precision: str = "fp32"
) -> str:
    path = (REPO.parent / "shared/data/hh-rlhf-harmless-base-test.jsonl.gz").resolve()
    model_toml, optim = MODELS[model]
    data = "".join(
        f'[dataset.{s}]\nname = "pairwise"\npath = "{path}"\nlimit = {rows}\n'
        f'folds = 5\nfold = 0\nsplit = "{s}"\n\n'
        for s in ("train", "eval")
    )
    return _recipe(f"bench-pairwise-{model}", model_toml, data, optim, epochs, nproc, precision)


def _recipe(
    name: str, model_toml: str, data: str, optim: str, epochs: int, nproc: int, precision: str
) -> str:
    return (
        f'[run]\nname = "{name}"\nseed = 0\n\n{model_toml}\n{data}[formatter]\nname = "pab"\n\n'
        f"[optimizer]\n{optim}weight_decay = 0.01\nbetas = [0.9, 0.99]\n\n"
        '[scheduler]\nname = "linear"\nwarmup_fraction = 0.1\n\n'
        f"[train]\nepochs = {epochs}\nbatch_size = 32\nmax_length = 512\n"
        f'micro_batch_tokens = 8192\nswap = "full"\n'
        f'eval_interval = 1\nlog_interval = 5\nprecision = "{precision}"\n\n[launch]\nnproc = {nproc}\n'
    )


# ------------------------------------------------------------------------------------- shared data
def prepare_baseline_inputs(recipe_path: Path, work: Path, *, pairwise: bool) -> dict:
    """hpref's own model, tokenizer and formatter -> the exact token ids the baselines train on."""
    from hpref.components import Components
    from hpref.data.cache import tokenize_dataset
    from hpref.models.precision import ProbeShape, resolve_precision
    from hpref.recipe import load_recipe
    from hpref.train.data import tokenize

    recipe = load_recipe(recipe_path, ["run.seed=0"])  # the sources' seed, as the baselines use
    parts = Components(recipe)
    model = parts.model(device="cpu", adapters=False)
    tok = model.tokenizer
    formatter = parts.formatter(tok)
    train_src = parts.source("train")
    eval_src = parts.source("eval")
    train = tokenize_dataset(train_src, formatter, swap=recipe.train.swap)
    evald = tokenize(eval_src.battles(), formatter, both_views=False, name="eval")
    fpt = model.flops_per_token
    out = {
        "train_tokens": sum(len(e.ids) for e in train) * recipe.train.epochs,
        "train_flops": sum(fpt(len(e.ids)) * len(e.ids) for e in train) * recipe.train.epochs,
        "train_sequences": len(train),
        "eval_rows": len(evald.battles),
        "params": sum(p.numel() for p in model.parameters()),
        "bf16": resolve_precision(
            recipe.train.precision, torch.device("cpu"), ProbeShape.of(model.backbone_config)
        )
        == torch.bfloat16,
        "eval_winners": {b.id: _argmax(b.label) for b in evald.battles},
        # the eval pairs' ids in the order the baselines score them (`_pairwise_ids`)
        "eval_ids": [b.id for b in eval_src.battles()],
    }
    tok_dir = work / "tokenizer"
    tok.save_pretrained(tok_dir)
    cfg_dir = work / "config"
    if recipe.model.name in ("minilm", "smollm2"):  # pretrained: the baseline loads the same weights
        from hpref.models.hf import gguf_folder, minilm_path, smollm2_file

        cfg_dir = minilm_path() if recipe.model.name == "minilm" else gguf_folder(smollm2_file())
        arch = "pretrained"
        init = None
    else:
        model.backbone_config.save_pretrained(cfg_dir)
        arch = "llama"
        init = work / "backbone.pt"
        torch.save({k: v.clone() for k, v in model.backbone.state_dict().items()}, init)
    if pairwise:
        data = _pairwise_ids(tok, train_src, eval_src, recipe.train.max_length)
        out["trl_train_tokens"] = sum(
            len(x) for k in ("chosen_ids", "rejected_ids") for x in data["train"][k]
        )
        out["trl_train_tokens"] *= recipe.train.epochs
        out["trl_train_flops"] = out["trl_train_tokens"] * fpt(256)  # see NOTES: mid-length attention term
    else:
        data = {
            "train": {"input_ids": [list(e.ids) for e in train], "labels": [_argmax(e.label) for e in train]},
            "eval": {
                "input_ids": [list(e.ids) for e in evald.examples],
                "labels": [_argmax(e.label) for e in evald.examples],
            },
        }
    torch.save(data, work / "data.pt")
    out["spec"] = {
        "arch": arch,
        "config_dir": str(cfg_dir),
        "init_state": str(init) if init else None,
        "tokenizer_dir": str(tok_dir),
        "pad_token_id": int(tok.pad_token_id if tok.pad_token_id is not None else 0),
        "data": str(work / "data.pt"),
        "lr": recipe.optimizer.config.lr,
        "head_lr": recipe.optimizer.config.head_lr,
        "weight_decay": recipe.optimizer.config.weight_decay,
        "betas": list(recipe.optimizer.config.betas),
        "warmup_fraction": 0.1,
        "epochs": recipe.train.epochs,
        # hpref's batch_size counts battles; with swap = "full" a step holds both views of each
        "batch_size": recipe.train.batch_size * (2 if recipe.train.swap == "full" and not pairwise else 1),
        "grad_clip": recipe.train.grad_clip,
        "bf16": out["bf16"],
        "eval_batch_size": 32,
        "max_length": recipe.train.max_length,
        "seed": 0,
        "work_dir": str(work / "hf_out"),
    }
    return out


def _argmax(label) -> int:
    return int(max(range(3), key=lambda i: label[i]))


def _pairwise_ids(tok, train_src, eval_src, max_length: int) -> dict:
    """TRL's input: each side's conversation on its own (a reward model scores one answer)."""

    def conv(prompt, answers) -> list[int]:
        text = "".join(f"User: {p}\nAssistant: {a}\n" for p, a in zip(prompt, answers, strict=False))
        ids = tok(text, add_special_tokens=True)["input_ids"]
        # keep the end (the answers) but also the first token: BOS, or the CLS an encoder pools
        return ids if len(ids) <= max_length else ids[:1] + ids[-(max_length - 1) :]

    def split(src) -> dict:
        chosen, rejected = [], []
        for b in src.battles():
            a, bb = conv(b.prompt, b.response_a), conv(b.prompt, b.response_b)
            win_a = b.label[0] >= b.label[1]
            chosen.append(a if win_a else bb)
            rejected.append(bb if win_a else a)
        return {"chosen_ids": chosen, "rejected_ids": rejected}

    return {"train": split(train_src), "eval": split(eval_src)}


# -------------------------------------------------------------------------------------------- runs
def run_hpref(recipe_path: Path, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    out_dir = work / "hpref_runs"
    cmd = [HPREF, "train", str(recipe_path), "--set", f"run.output_dir={out_dir}"]
    res = run_measured(cmd, work / "hpref_train.log")
    if res["rc"] != 0:
        return {**res, "error": f"hpref train exited {res['rc']} (log {res['log']})"}
    run_dir = next(p for p in out_dir.iterdir() if p.is_dir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    summary = read_json(run_dir / "summary.json")
    res.update(
        train_s=sum(r["seconds"] for r in train),
        hpref_tokens=sum(r["tokens"] for r in train),
        hpref_flops=sum(r["flops"] for r in train),
        hpref_mfu=summary.get("mfu"),
        hpref_peak=summary.get("peak"),
        eval_log_loss=summary.get("eval_log_loss"),
        eval_accuracy=summary.get("eval_accuracy"),
        eval_rows_per_s=(evals[-1]["eval_battles"] / evals[-1]["eval_seconds"]) if evals else None,
        run_dir=str(run_dir),
    )
    return res


def pairwise_scores(run_dir: Path, winners: dict) -> dict:
    """hpref's eval predictions read as a two-way judgement, comparable to a reward model's.

    A reward model's accuracy is `score(chosen) > score(rejected)` and its loss
    `-log sigmoid(score(chosen) - score(rejected))`; hpref's three-way head gives the same two
    numbers from `P(A wins)` against `P(B wins)`, renormalised without the tie class (pairwise data
    has no ties, so the tie mass only says how unsure the judge is). P(A) == P(B) counts half, as
    equal rewards do in `hf_worker`."""
    import csv

    ids, hits, losses = [], [], []
    with open(Path(run_dir) / "predictions.csv", newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            pa, pb = float(row["winner_model_a"]), float(row["winner_model_b"])
            win = winners[row["id"]]
            ids.append(row["id"])
            p_right = (pa if win == 0 else pb) / max(pa + pb, 1e-12)
            # an exact tie counts half, on both sides: a barely trained model, or bf16 logits (the
            # HF baselines' are; hpref's head is fp32), can give pairs exactly equal P(A) and P(B)
            hits.append(1.0 if p_right > 0.5 else 0.5 if p_right == 0.5 else 0.0)
            losses.append(-math.log(max(p_right, 1e-12)))
    return {
        "eval_accuracy_ab": sum(hits) / len(hits),
        "eval_log_loss_ab": sum(losses) / len(losses),
        "hits": dict(zip(ids, hits, strict=True)),  # per pair, for a paired comparison
    }


def run_baseline(mode: str, prep: dict, work: Path) -> dict:
    spec = dict(prep["spec"], mode=mode)
    spec_path = write_json(work / f"{mode}_spec.json", spec)
    result_path = work / f"{mode}_result.json"
    res = run_measured(
        python_module("benchmarks.hf_worker", str(spec_path), str(result_path)), work / f"{mode}.log"
    )
    if res["rc"] != 0 or not result_path.exists():
        tail = Path(res["log"]).read_text().strip().splitlines()[-1:] or ["?"]
        return {**res, "error": f"{mode} exited {res['rc']}: {tail[0][:200]}"}
    return {**res, **read_json(result_path)}


def run_rl(work: Path, rollouts: int) -> dict:
    recipe = REPO / "recipes/rl-arena.toml"
    out = {}
    for label, policies in (("a,b", "a,b"), ("a", "a"), ("b", "b")):
        folder = work / f"rl_{label.replace(',', '')}"
        cmd = [HPREF, "rl", str(recipe), "--policies", policies, "--set", f"run.output_dir={folder}"]
        cmd += ["--set", f"rl.num_rollouts={rollouts}"]
        res = run_measured(cmd, work / f"rl_{label.replace(',', '')}.log")
        tps = []
        for f in folder.glob("*/metrics/*.jsonl"):
            for line in f.read_text().splitlines():
                row = json.loads(line)
                if "gen_tokens_per_s" in row:
                    tps.append(row["gen_tokens_per_s"])
        res["gen_tokens_per_s_mean"] = sum(tps) / len(tps) if tps else None
        out[label] = res
    return out


# ------------------------------------------------------------------------------------------ report
def _f(x, fmt="{:,.0f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def train_rows(case: str, prep: dict, results: dict, peak: float) -> list[str]:
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {case} | {name} | failed: {r['error']} | | | | | | | |")
            continue
        pairwise_trl = name.startswith("TRL")
        tokens = prep["trl_train_tokens"] if pairwise_trl else prep["train_tokens"]
        flops = prep["trl_train_flops"] if pairwise_trl else prep["train_flops"]
        tps = tokens / r["train_s"]
        mfu = flops / r["train_s"] / peak
        loss = r.get("eval_log_loss_ab", r.get("eval_log_loss"))  # pairwise: hpref's two-way numbers
        acc = r.get("eval_accuracy_ab", r.get("eval_accuracy"))
        rows.append(
            f"| {case} | {name} | {_f(tps)} | {_f(r['train_s'], '{:.1f}')} | {_f(r['wall_s'], '{:.1f}')} | "
            f"{_f(r['peak_rss_gib'], '{:.2f}')} | {_f(loss, '{:.4f}')} | {_f(acc, '{:.3f}')} | "
            f"{_f(mfu * 100, '{:.2f}%')} | "
            f"{_f(r.get('eval_rows_per_s'), '{:,.0f}')} | {_f(r.get('load_mean'), '{:.1f}')} |"
        )
        r["tokens_per_s"], r["mfu"] = tps, mfu
    return rows


def write_report(
    path: Path,
    info: dict,
    ceil: dict,
    tables: list[str],
    ratios: list[str],
    rl: dict | None,
    command: str,
    notes: list[str],
) -> None:
    lines = [
        "# hpref benchmark results",
        "",
        f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- command: `{command}`",
        f"- machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, "
        f"transformers {info['transformers']}, Python {info['python']}",
        "- the machine is shared with other work: numbers are one run each, expect noise of 10-30 %",
        "",
        "## Ceilings (torch, all threads)",
        "",
        "| measure | value |",
        "|---|---|",
        f"| fp32 matmul 2048² ({ceil['threads']} threads) | {ceil['fp32_flops'] / 1e9:,.1f} GFLOP/s |",
        f"| bf16 matmul 2048² ({ceil['threads']} threads) | {ceil['bf16_flops'] / 1e9:,.1f} GFLOP/s |",
        f"| copy bandwidth (512 MiB fp32, read+write) | {ceil['copy_bytes_per_s'] / 1e9:,.1f} GB/s |",
        f"| 1-minute load average when measured | {ceil.get('load', float('nan')):.1f} |",
        "",
        "## Training (same model, data, examples, hyper-parameters)",
        "",
        "Real tokens/s = non-pad tokens trained / training time (eval and start-up excluded); wall = the "
        "whole process from launch to exit; peak RSS = the whole process tree (all ranks), sampled every "
        "50 ms; MFU = 6·N·tokens (+ attention term, `flops_per_token`) / training time / measured bf16 "
        "peak above; eval rows/s = eval battles (or pairs) scored per second; load = the machine's "
        "mean 1-minute load average during that run (2 cores: above 2, other work was competing).",
        "",
        "| case | trainer | real tok/s | train s | wall s | peak RSS GiB | eval log loss | eval acc | "
        "MFU (bf16 peak) | eval rows/s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *tables,
        "",
        "## Ratios",
        "",
        *[f"- {r}" for r in ratios],
        "",
    ]
    if rl:
        lines += [
            "## RL: two policies at once vs one after the other",
            "",
            "| run | wall s | peak RSS GiB | rollout gen tok/s (mean per rollout) |",
            "|---|---|---|---|",
        ]
        for label, r in rl.items():
            lines.append(
                f"| --policies {label} | {_f(r['wall_s'], '{:.1f}')} (rc {r['rc']}) | "
                f"{_f(r['peak_rss_gib'], '{:.2f}')} | {_f(r['gen_tokens_per_s_mean'], '{:,.0f}')} |"
            )
        seq = rl["a"]["wall_s"] + rl["b"]["wall_s"]
        lines += [
            "",
            f"- concurrent / sequential wall time: {rl['a,b']['wall_s']:.1f} / {seq:.1f} s = "
            f"{rl['a,b']['wall_s'] / seq:.2f}",
            "",
        ]
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    path.write_text("\n".join(lines))


def bench_cases(quick: bool) -> list[dict]:
    """What runs: rows = battles (synthetic, 80 % train / 20 % eval) or pairs (pairwise, same split).

    Sized so --quick takes a few minutes and the full run about 20 on the 2-core box: MiniLM
    (22.7M parameters, ~104 tokens a sequence with its WordPiece tokenizer) costs ~70 MFLOP a
    token, 60x tiny-llama, so it gets fewer battles. `precision` and `nproc` are what measured
    fastest for hpref on this machine (benchmarks/NOTES.md); the baselines use the same dtype.
    """
    tiny = dict(model="tiny-llama", precision="fp32", nproc=2)
    minilm = dict(model="minilm", precision="bf16", nproc=2)
    if quick:
        return [
            dict(tiny, kind="synthetic", rows=400, epochs=1),
            dict(minilm, kind="synthetic", rows=250, epochs=1),
            dict(tiny, kind="pairwise", rows=200, epochs=1),
        ]
    # the full run also shows what the dtype and the ranks x threads split are worth on MiniLM
    return [
        dict(tiny, kind="synthetic", rows=4000, epochs=2),
        dict(minilm, kind="synthetic", rows=1500, epochs=1, also=[(1, "bf16"), (2, "fp32")]),
        dict(tiny, kind="pairwise", rows=2000, epochs=2),
        dict(minilm, kind="pairwise", rows=1000, epochs=1),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, few hundred examples (~6 min)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/RESULTS.md")
    parser.add_argument("--keep", type=Path, default=None, help="keep the work folder here")
    parser.add_argument("--skip-rl", action="store_true")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "benchmarks.run", *(argv if argv is not None else sys.argv[1:])])
    work_root = args.keep or Path(tempfile.mkdtemp(prefix="hpref-bench-"))
    work_root.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"machine: {info}; work folder {work_root}", flush=True)
    ceil = ceilings(args.quick)
    print(f"ceilings: {ceil}", flush=True)
    peak = ceil["bf16_flops"]
    cases = bench_cases(args.quick)
    tables, ratios, notes, raw = [], [], [], {"machine": info, "ceilings": ceil}
    for c in cases:
        model, kind = c["model"], c["kind"]
        case = f"{model} {kind}"
        work = work_root / case.replace(" ", "-")
        work.mkdir(exist_ok=True)
        results = {}
        prep = None
        # the first hpref variant is the headline (ratios); the others show what the choice is worth
        for nproc, precision in [(c["nproc"], c["precision"]), *c.get("also", [])]:
            tag = f"{nproc}r-{precision}"
            recipe = work / f"recipe-{tag}.toml"
            if kind == "pairwise":
                recipe.write_text(pairwise_recipe(c["rows"], c["epochs"], nproc, model, precision))
            else:
                recipe.write_text(synthetic_recipe(model, c["rows"], c["epochs"], nproc, precision))
            if prep is None:
                print(f"[{case}] preparing shared inputs", flush=True)
                prep = prepare_baseline_inputs(recipe, work, pairwise=kind == "pairwise")
            threads = "1 thread each" if nproc > 1 else f"{os.cpu_count()} threads"
            label = f"hpref train ({nproc} rank{'s' if nproc > 1 else ''}, {threads}, {precision})"
            print(f"[{case}] {label}", flush=True)
            results[label] = run_hpref(recipe, work / tag)
            if kind == "pairwise" and "error" not in results[label]:
                results[label].update(pairwise_scores(results[label]["run_dir"], prep["eval_winners"]))
        if kind == "pairwise":
            print(f"[{case}] TRL RewardTrainer", flush=True)
            results["TRL RewardTrainer"] = run_baseline("trl", prep, work)
        else:
            print(f"[{case}] HF Trainer", flush=True)
            results["HF Trainer + dyn. padding"] = run_baseline("trainer", prep, work)
        tables += train_rows(f"{case} ({prep['params'] / 1e6:.2f}M params)", prep, results, peak)
        raw[case] = {
            "prep": {k: v for k, v in prep.items() if k not in ("spec", "eval_winners", "eval_ids")},
            "results": results,
        }
        h, b = list(results.values())[0], list(results.values())[-1]
        if "error" not in h and "error" not in b:
            ratios.append(
                f"{case}: {list(results)[0]} / {list(results)[-1]} real tokens/s = "
                f"{h['tokens_per_s'] / b['tokens_per_s']:.2f}x; "
                f"peak RSS {h['peak_rss_gib'] / b['peak_rss_gib']:.2f}x; eval log loss "
                f"{_f(h.get('eval_log_loss_ab', h.get('eval_log_loss')), '{:.4f}')} vs "
                f"{_f(b.get('eval_log_loss'), '{:.4f}')}; eval accuracy "
                f"{_f(h.get('eval_accuracy_ab', h.get('eval_accuracy')), '{:.3f}')} vs "
                f"{_f(b.get('eval_accuracy'), '{:.3f}')}; "
                f"MFU {h['mfu']:.2%} vs {b['mfu']:.2%}"
            )
        print(f"[{case}] done: {json.dumps(results, default=str)[:600]}", flush=True)
    if any(c["kind"] == "pairwise" for c in cases):
        notes.append(
            "pairwise: hpref judges chosen/rejected in one sequence (3-way head, 2 views per pair); "
            "TRL scores each side alone (1-logit Bradley-Terry). The pairwise rows give hpref's two-way "
            "numbers, the same quantities as TRL's: accuracy = P(chosen wins) > P(rejected wins), log "
            "loss = -log of P(chosen) / (P(A) + P(B)) (the tie class dropped; the data has no ties). "
            "TRL's MFU uses a 256-token attention term (its sequences are scored alone)."
        )
    notes.append(
        "hpref runs 2 ranks x 1 thread (its CPU default, FSDP2 over gloo); the baselines run 1 process "
        "with all threads. Same initial backbone weights for tiny-llama (hpref's seeded init is loaded "
        "into the HF model); the heads differ (hpref: 2-layer MLP head, HF: one linear layer)."
    )
    rl = None
    if not args.skip_rl:
        print("[rl] runs", flush=True)
        rl = run_rl(work_root, 6 if args.quick else 20)
        raw["rl"] = rl
    write_json(work_root / "raw.json", raw)
    write_report(args.out, info, ceil, tables, ratios, rl, command, notes)
    print(f"wrote {args.out} (raw numbers: {work_root / 'raw.json'})", flush=True)


if __name__ == "__main__":
    main()
