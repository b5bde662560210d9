"""One train step, both sides, the same pairs: where hpref's and TRL's MiniLM reward steps spend time.

    .venv/bin/python -m benchmarks.step_vs_trl [--data FILE] [--limit 64] [--steps 4] [--rounds 3]
                                               [--profile] [--top 20] [--trl-fp32] [--json FILE]

hpref: `minilm-reward` built as a rank of `hpref train` builds it (`benchmarks.profile_step`: FSDP2,
bf16 autocast, packed micro-batches, its optimizer), stepping through its own step plans. TRL: the
model `RewardTrainer` trains (`AutoModelForSequenceClassification`, one label, BERT's pooler, dropout
off as `RewardConfig.disable_dropout` does, no gradient checkpointing: TRL at its fastest here), fed
the SAME pairs of each step through TRL's own collator (`DataCollatorForPreference`: chosen then
rejected, right-padded to the longest of the 2 x batch), Bradley-Terry loss, grad clip 1, AdamW with
the same groups (`benchmarks.hf_worker.optimizer_and_schedule`), bf16 autocast (`--trl-fp32`: none).
Rounds alternate the two sides over the same steps. Per side: seconds a step, real tokens (and TRL's
padded positions) per second; `--profile` adds torch.profiler's top ops by self CPU time for one round
of each side. Needs ../shared (skips without it) and `hpref[minilm]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _long_pairs(data: Path, min_tokens: int, work: Path) -> Path:
    """The rows of `data` whose chosen and rejected texts both tokenize to >= min_tokens (MiniLM)."""
    import gzip

    from transformers import AutoTokenizer

    from hpref.models.hf import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
    opener = gzip.open if data.suffix == ".gz" else open
    with opener(data, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    kept = [
        r for r in rows
        if min(len(tokenizer(r[k])["input_ids"]) for k in ("chosen", "rejected")) >= min_tokens
    ]  # fmt: skip
    out = work / "long.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    print(f"{len(kept)} of {len(rows)} pairs have both answers >= {min_tokens} tokens", flush=True)
    return out


def _trl_side(setup, lr: float, head_lr: float, bf16: bool):
    import torch
    from transformers import AutoModelForSequenceClassification

    from benchmarks.hf_worker import optimizer_and_schedule
    from hpref.models.hf import minilm_path

    model = AutoModelForSequenceClassification.from_pretrained(str(minilm_path()), num_labels=1)
    model.config.pad_token_id = setup.filler_token_id
    for module in model.modules():  # what RewardConfig.disable_dropout does
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.train()
    spec = {"lr": lr, "head_lr": head_lr, "betas": [0.9, 0.99], "weight_decay": 0.0, "warmup_fraction": 0.1}
    optimizer, schedule = optimizer_and_schedule(model, spec, total_steps=1000)
    return model, optimizer, schedule, bf16


def _trl_batch(setup, plan):
    """The step's pairs through TRL's own collator (chosen ids then rejected ids, right-padded together)."""
    from trl.trainer.reward_trainer import DataCollatorForPreference

    indices = [i for mbs in plan.micro_batches for mb in mbs for i in mb if i >= 0]
    examples = [setup.train_data.examples[i] for i in indices]
    pairs = [{"chosen_ids": list(e.ids[: e.split]), "rejected_ids": list(e.ids[e.split :])} for e in examples]
    batch = DataCollatorForPreference(pad_token_id=setup.filler_token_id)(pairs)
    return batch["input_ids"], batch["attention_mask"]


def _trl_step(side, batch) -> None:
    import torch

    model, optimizer, schedule, bf16 = side
    ids, mask = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        scores = model(input_ids=ids, attention_mask=mask).logits.float().squeeze(-1)
    half = scores.shape[0] // 2
    loss = -torch.nn.functional.logsigmoid(scores[:half] - scores[half:]).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)


def _top_ops(prof, top: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    return [
        {
            "op": e.key,
            "self_ms": round(e.self_cpu_time_total / 1e3, 1),
            "share": round(e.self_cpu_time_total / total, 3),
            "calls": e.count,
        }
        for e in rows[:top]
    ]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.real_pairwise import DEFAULT_DATA, split_by_prompt, write_recipe

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.step_vs_trl", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--limit", type=int, default=64, help="train pairs to build the steps from")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per side per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="only pairs whose answers both have at least this many tokens with their conversation: "
        "near-uniform lengths, where TRL's padding costs little and each side's per-token speed shows",
    )
    parser.add_argument("--trl-fp32", action="store_true", help="TRL without bf16 autocast")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.data.is_file():
        print(f"skipped: {args.data} is absent (this benchmark needs ../shared)")
        return 0

    import torch
    import torch.distributed as dist
    from loguru import logger

    from benchmarks.profile_step import _build, _step

    logger.remove()
    work = Path(tempfile.mkdtemp(prefix="hpref-step-vs-trl-"))
    data = _long_pairs(args.data, args.min_tokens, work) if args.min_tokens else args.data
    train, evaluation, _, _ = split_by_prompt(data, work, args.limit)
    recipe = write_recipe("hpref-reward", train, evaluation, work)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    setup, plans = _build(str(recipe), [])
    optim = setup.recipe.optimizer
    trl = _trl_side(setup, optim.lr, optim.head_lr or optim.lr, bf16=not args.trl_fp32)
    steps = plans[1 : 1 + args.steps]
    batches = [_trl_batch(setup, plan) for plan in steps]
    _step(setup, plans[0])  # warm-up of both: first-call allocations, oneDNN primitive caches
    _trl_step(trl, _trl_batch(setup, plans[0]))
    real = sum(p.num_tokens for p in steps)
    padded = sum(ids.numel() for ids, _ in batches)
    sides = {
        "hpref": lambda: [_step(setup, plan) for plan in steps],
        "trl": lambda: [_trl_step(trl, batch) for batch in batches],
    }
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    profiles = {}
    for r in range(args.rounds):
        for name, run in sides.items():
            start = time.perf_counter()
            if args.profile and r == 0:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    run()
                profiles[name] = _top_ops(prof, args.top)
            else:
                run()
            seconds[name].append((time.perf_counter() - start) / len(steps))
    # the profiled round aside: the profiler's own cost is in it
    timed = {n: s[1:] if args.profile and len(s) > 1 else s for n, s in seconds.items()}
    medians = {n: statistics.median(s) for n, s in timed.items()}
    result = {
        "steps": len(steps),
        "pairs_per_step": setup.recipe.train.batch_size,
        "threads": torch.get_num_threads(),
        "trl_precision": "fp32" if args.trl_fp32 else "bf16 autocast",
        "real_tokens_per_step": real / len(steps),
        "trl_padded_positions_per_step": padded / len(steps),
        "load_1min": round(os.getloadavg()[0], 2),
        **{
            f"{n}_s_per_step": {"median": round(medians[n], 3), "all": [round(x, 3) for x in s]}
            for n, s in timed.items()
        },
    }
    result["hpref_over_trl"] = round(medians["hpref"] / medians["trl"], 3)
    result["real_tokens_per_s"] = {n: round(real / len(steps) / m) for n, m in medians.items()}
    result["trl_padded_positions_per_s"] = round(padded / len(steps) / medians["trl"])
    if profiles:
        result["profile_top_ops"] = profiles
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
