"""Where an hpref train step spends its time: `python -m benchmarks.profile_step RECIPE [options]`.

Builds the run exactly as a rank of `hpref train` does (`worker.build_setup` on a one-rank gloo
group: FSDP2, the recipe's precision, packing plan and optimizer), then times real train steps.

    # A/B: each --variant is its own setup; rounds alternate between them so a shared, noisy
    # machine disturbs all alike; best and median tokens/s per variant
    python -m benchmarks.profile_step R --variant fp32:train.precision=fp32 \
        --variant bf16:train.precision=bf16 --rounds 3 --steps 2
    # torch.profiler over the steps of one setup: the top ops by self CPU time
    python -m benchmarks.profile_step R --set train.precision=bf16 --profile

A variant is `name:key=value,key=value` with recipe overrides, plus `threads=N` (torch threads).
One rank only: it shows the compute of a step (what each of 2 ranks does on half the batch), not the
gloo collectives of a multi-rank run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _build(recipe_path: str, overrides: list[str]):
    import torch

    from hpref.recipe import load_recipe
    from hpref.runtime.distributed import DistInfo
    from hpref.train.worker import build_setup

    out_dir = tempfile.mkdtemp(prefix="hpref-prof-")
    recipe = load_recipe(recipe_path, [*overrides, f"run.output_dir={out_dir}"])
    setup = build_setup(recipe, DistInfo(0, 1, 0, torch.device("cpu"), "gloo"))
    setup.model.train()
    return setup, list(setup.sampler)


def _step(setup, plan) -> None:
    from hpref.train.loop import train_step

    train_step(
        setup.model,
        setup.optimizer,
        plan.batches(0, setup.train_data.examples, setup.filler_token_id),
        step_sequences=plan.num_sequences,
        world_size=1,
        grad_clip=setup.recipe.train.grad_clip,
        device=setup.device,
    )


def _flops(setup, plans) -> float:
    from hpref.train.progress import step_flops as _step_flops

    lengths = setup.train_data.lengths
    return sum(
        _step_flops(setup, [lengths[i] for mbs in p.micro_batches for mb in mbs for i in mb if i >= 0])
        for p in plans
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--variant", action="append", default=[], help="name:key=value,...")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from loguru import logger

    logger.remove()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    default_threads = args.threads or torch.get_num_threads()
    variants = {}
    for spec in args.variant or ["default:"]:
        name, _, rest = spec.partition(":")
        overrides, threads = list(args.overrides), default_threads
        for kv in filter(None, rest.split(",")):
            if kv.startswith("threads="):
                threads = int(kv.partition("=")[2])
            else:
                overrides.append(kv)
        torch.set_num_threads(threads)
        setup, plans = _build(args.recipe, overrides)
        _step(setup, plans[0])  # warm-up: first-call allocations, lazy inits
        variants[name] = (setup, plans, threads, overrides)
    rates: dict[str, list[float]] = {n: [] for n in variants}
    cpu_rates: dict[str, list[float]] = {n: [] for n in variants}
    tflops: dict[str, list[float]] = {n: [] for n in variants}
    prof = None
    for r in range(args.rounds):
        for name, (setup, plans, threads, _) in variants.items():
            torch.set_num_threads(threads)
            timed = [plans[1 + (r * args.steps + i) % (len(plans) - 1)] for i in range(args.steps)]
            start, cpu_start = time.perf_counter(), time.process_time()
            if args.profile and prof is None:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for plan in timed:
                        _step(setup, plan)
            else:
                for plan in timed:
                    _step(setup, plan)
            seconds = time.perf_counter() - start
            rates[name].append(sum(p.num_tokens for p in timed) / seconds)
            cpu_rates[name].append(sum(p.num_tokens for p in timed) / (time.process_time() - cpu_start))
            tflops[name].append(_flops(setup, timed) / seconds / 1e12)
    result = {
        "recipe": args.recipe,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "variants": {
            name: {
                "overrides": overrides,
                "threads": threads,
                "mean_seq_len": sum(setup.train_data.lengths) / len(setup.train_data.lengths),
                "best_tokens_per_s": max(rates[name]),
                "median_tokens_per_s": statistics.median(rates[name]),
                "best_model_tflops_per_s": max(tflops[name]),
                # per CPU second of this process: with threads=1 the steadier number on a shared box
                "best_cpu_tokens_per_s": max(cpu_rates[name]),
                "all_tokens_per_s": [round(x) for x in rates[name]],
            }
            for name, (setup, plans, threads, overrides) in variants.items()
        },
    }
    print(json.dumps(result, indent=2))
    if prof is not None:
        table = prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=55
        )
        print(table)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
