"""Train-step speed of fp32 against bf16 on this machine: `python -m benchmarks.precision_step`.

It runs the real `train_step` (FSDP2 on a one-rank group, `MixedPrecisionPolicy` for bf16) on a
Llama-shaped `tiny-llama` with random packed micro-batches, alternating the two precisions so a
noisy, shared machine treats both alike, and prints the best round's tokens/s of each (on a shared
machine the best round is the one least disturbed; the median is printed too). `precision =
"auto"` is chosen from these numbers (see `hpref.train.sharding.resolve_precision`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def _model(args: argparse.Namespace, dtype: torch.dtype):
    from hpref.models.parallelize import parallelize
    from hpref.plugins import load_plugins

    component = load_plugins().get("model", "tiny-llama")
    config = component.config(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 4),
        intermediate_size=args.intermediate,
        vocab_size=2048,
        tokenizer_texts=2000,
        head_dropout=0.0,
    )
    model = component.build(config, meta=True)
    parallelize(model, param_dtype=dtype, activation_checkpointing=False)
    model.load_pretrained_weights(device="cpu")
    return model


def _batches(vocab: int, seq_len: int, tokens: int, count: int):
    from hpref.data.packing import TokenizedExample, collate

    gen = torch.Generator().manual_seed(0)
    per = tokens // seq_len
    out = []
    for _ in range(count):
        examples = [
            TokenizedExample(torch.randint(3, vocab, (seq_len,), generator=gen).tolist(), (1.0, 0.0, 0.0), i)
            for i in range(per)
        ]
        out.append(collate(examples))
    return out


def main(argv: list[str] | None = None) -> None:
    from loguru import logger

    from hpref.builtin.optimizers import AdamWConfig, build_adamw
    from hpref.train.loop import train_step

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logger.remove()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cpu")
    setups = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = _model(args, dtype)
        optimizer = build_adamw(AdamWConfig(lr=1e-5), model)
        vocab = len(model.tokenizer)
        setups[name] = (model, optimizer, _batches(vocab, args.seq_len, args.tokens, args.steps + 1))
    rates: dict[str, list[float]] = {name: [] for name in setups}
    cpu_rates: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, (model, optimizer, batches) in setups.items():
            train_step(
                model, optimizer, batches[:1], step_sequences=1, world_size=1, grad_clip=1.0, device=device
            )
            start, cpu_start = time.perf_counter(), time.process_time()
            for batch in batches[1:]:
                n = batch.num_sequences
                train_step(
                    model, optimizer, [batch], step_sequences=n, world_size=1, grad_clip=1.0, device=device
                )
            rates[name].append(args.steps * args.tokens / (time.perf_counter() - start))
            cpu_rates[name].append(args.steps * args.tokens / (time.process_time() - cpu_start))
    params = sum(p.numel() for p in setups["fp32"][0].parameters())
    result = {
        "params": params,
        "threads": torch.get_num_threads(),
        "shape": vars(args),
        "tokens_per_s": {name: max(r) for name, r in rates.items()},
        "median_tokens_per_s": {name: statistics.median(r) for name, r in rates.items()},
        "all_rounds": rates,
    }
    result["bf16_speedup"] = result["tokens_per_s"]["bf16"] / result["tokens_per_s"]["fp32"]
    # Tokens per CPU second of this process: with one thread (`--threads 1`) it ignores the time
    # the process waited for a core, so on a shared machine it is the steadier of the two ratios.
    result["cpu_tokens_per_s"] = {name: max(r) for name, r in cpu_rates.items()}
    result["bf16_cpu_speedup"] = result["cpu_tokens_per_s"]["bf16"] / result["cpu_tokens_per_s"]["fp32"]
    print(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
