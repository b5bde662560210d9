"""The engine side of a weight sync: how much an engine's resident set grows while it takes one
sync of SmolLM2-135M-Instruct in buckets, as the trainer sends it (issue #51, point 6).

    .venv/bin/python -m benchmarks.rl_sync_memory [--bucket-mb 64] [--policy DIR] [--dtype float32]
        [--engine transformers|vllm] [--tp 2]

What runs, in a fresh process: the engine is built and answers one prompt (the libraries' first
allocations, not measured), its freed memory is returned, the kernel's peak-RSS mark is reset
(`/proc/self/clear_refs`), then one sync: `begin_update`, each bucket received the way the weight
channel receives it (a fresh flat buffer of the bucket's size, cut into views, handed to
`load_weights`), `commit_update`. Reported: the model's weights, the peak growth over the resident
set before the sync (VmHWM), in MiB, as a multiple of the weights and of the bucket, and the time.
`--engine vllm --tp N`: vLLM (its CPU build here) at tensor parallel N, whose model lives in N
worker processes of its own: the growth is the sum over the engine's process and every worker's
(each reset and read alike; the sum bounds what they held at once from above). The values the
transformers engine then serves are checked against those sent; vLLM's are not read back (its
workers hold them fused and sharded), only its answer after the sync.

Before #51 the engine kept every received bucket until the commit (a second copy of the weights);
it now writes each to a stage file (`hpref.rl.engines.staging`) and reads them back one tensor at
a time. To measure the tree before the change, run this file with that tree's `src` first on
`PYTHONPATH`. Linux only (the resettable peak-RSS mark).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor

MIB = 2**20


def _status(field: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(f"{field}:"))


def _reset_peak(pid: int | str = "self") -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")


def _engine(name: str, model: object, dtype: str, tp: int) -> object:
    """A fresh engine of `name` in this process (vLLM's tensor-parallel workers in their own)."""
    if name == "transformers":
        from hpref.rl.engines.transformers_engine import EngineActor

        return EngineActor("a", model)
    from hpref.recipe.rl import RLConfig, resolve_engine
    from hpref.rl.engines.vllm_engine import VLLMEngine

    settings = {"name": "vllm", "dtype": dtype, "tensor_parallel_size": tp}
    config = resolve_engine(RLConfig.model_validate({"policies": {"a": {}}, "engine": settings}).engine)
    return VLLMEngine("a", model, config)


def measure(
    policy: str | None, bucket_mb: int, dtype: str, engine_name: str = "transformers", tp: int = 1
) -> dict:
    """One sync into a fresh engine, in this (fresh) process."""
    import psutil
    import torch

    from hpref.memory import release_freed_memory
    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig

    model = PolicyModelConfig(path=policy) if policy else PolicyModelConfig(name="smollm2")
    engine = _engine(engine_name, model, dtype, tp)
    engine.generate([("hello there",)], 1, 2, 1.0)
    # new values for every weight, under the names and shapes the trainer sends; tied ones
    # (SmolLM2's embedding and head) share theirs, as the trainer's weights do
    by_storage: dict[int, torch.Tensor] = {}
    sent = {
        n: by_storage.setdefault(t.data_ptr(), torch.randn(t.shape).to(getattr(torch, dtype)))
        for n, t in build_policy_model(model)[0].state_dict().items()
    }
    weights = sum(t.numel() * t.element_size() for t in by_storage.values())  # tied ones once
    largest = max(t.numel() * t.element_size() for t in by_storage.values())
    capacity = bucket_mb * MIB // torch.empty((), dtype=getattr(torch, dtype)).element_size()
    release_freed_memory()
    pids = ["self", *(p.pid for p in psutil.Process().children(recursive=True))]  # vLLM's workers
    for pid in pids:
        _reset_peak(pid)
    settled = {pid: _status("VmRSS", pid) for pid in pids}
    started = time.perf_counter()
    engine.begin_update(1)
    layout: list[tuple[str, tuple[int, ...]]] = []
    used = 0

    def receive() -> None:  # the channel's receive: a fresh buffer per bucket, cut into views
        sizes = [math.prod(shape) for _, shape in layout]
        flat = torch.empty(sum(sizes), dtype=getattr(torch, dtype))
        views, offset = {}, 0
        for (name, shape), size in zip(layout, sizes, strict=True):
            flat[offset : offset + size].copy_(sent[name].reshape(-1))
            views[name] = flat[offset : offset + size].view(shape)
            offset += size
        engine.load_weights(views)

    for name, tensor in sent.items():
        if layout and used + tensor.numel() > capacity:
            receive()
            layout, used = [], 0
        layout.append((name, tuple(tensor.shape)))
        used += tensor.numel()
    if layout:
        receive()
    assert engine.commit_update() == 1
    seconds = time.perf_counter() - started
    grown = {pid: _status("VmHWM", pid) - settled[pid] for pid in pids}
    peak = sum(grown.values())
    # per process (its title: vLLM names its engine core and workers), for a tensor-parallel engine
    names = {pid: "engine" if pid == "self" else psutil.Process(pid).name() for pid in pids}
    per_process = {f"{names[pid]} ({pid})": round(g / MIB, 1) for pid, g in grown.items()}
    if engine_name == "transformers":
        live = engine.model.state_dict()
        assert all(torch.equal(live[n].to(t.dtype), t) for n, t in sent.items()), "it loaded other values"
    assert engine.generate([("hello there",)], 1, 2, 1.0).tokens > 0  # serving the new version
    if engine_name == "vllm":  # its engine core's processes, which would keep this one from ending
        engine.llm.llm_engine.engine_core.shutdown()
    return {
        "engine": engine_name if tp == 1 else f"{engine_name} tp={tp} ({len(pids)} processes)",
        "weights_mib": weights / MIB,
        "bucket_mib": bucket_mb,
        "peak_growth_mib": peak / MIB,
        "x_weights": peak / weights,
        "x_bucket": peak / (bucket_mb * MIB),
        "largest_tensor_mib": largest / MIB,
        "sync_s": seconds,
        "per_process_mib": per_process,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--policy", default=None, help="a causal-LM folder instead of SmolLM2")
    parser.add_argument("--dtype", default="float32", help="the engine's weight dtype")
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--tp", type=int, default=1, help="vLLM's tensor_parallel_size")
    parser.add_argument("--out", default=None, help="write the result (JSON) here")
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("skipped: needs Linux's resettable peak RSS (/proc/self/clear_refs)")
        return 0
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = pool.submit(measure, args.policy, args.bucket_mb, args.dtype, args.engine, args.tp).result(
            timeout=900
        )
    print(
        f"{got['engine']}: weights {got['weights_mib']:.0f} MiB, bucket {got['bucket_mib']} MiB: "
        "the engine's peak grew "
        f"{got['peak_growth_mib']:.0f} MiB during the sync ({got['x_weights']:.2f}x the weights, "
        f"{got['x_bucket']:.2f}x a bucket; the largest tensor, which a bucket can't split, is "
        f"{got['largest_tensor_mib']:.0f} MiB), {got['sync_s']:.2f} s"
    )
    if len(got["per_process_mib"]) > 1:
        print("  by process (MiB):", ", ".join(f"{k} {v:.0f}" for k, v in got["per_process_mib"].items()))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(got, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
