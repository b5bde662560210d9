"""torch.compile on and off for the part of a decoder block it can compile on a CPU (issue #51,
point 5): the RMSNorm and gated MLP of one SmolLM2-135M block (576 wide, MLP 1,536), forward and
backward, eager against `torch.compile(dynamic=True)` (inductor), interleaved (A, B, B, A, ...), a
different packed length each round as an RL trainer's micro-batches have.

    .venv/bin/python -m benchmarks.compile_block [--tokens 900] [--rounds 6] [--threads 2]
        [--precision fp32|bf16]

Attention is left out: hpref's varlen CPU attention (`hpref.models.attention`) reads the segment
boundaries as Python ints, so a compiled block would specialise on them and recompile per batch
(there it is compiled only on the GPU path). Prints the compile time, each mode's median ms per
forward + backward and the ratio; the figure in benchmarks/README.md is this module's output.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=900, help="packed tokens per step (varied by round)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="steps per round and mode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    args = parser.parse_args(argv)

    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, hidden_act="silu")

    class NormAndMlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.mlp = LlamaRMSNorm(args.hidden), LlamaMLP(config)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(self.norm(x))

    eager = NormAndMlp()
    twin = NormAndMlp()
    twin.load_state_dict(eager.state_dict())
    compiled = torch.compile(twin, dynamic=True)
    bf16 = args.precision == "bf16"

    def step(model: torch.nn.Module, tokens: int) -> None:
        x = torch.randn(1, tokens, args.hidden, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = model(x)
        y.float().pow(2).mean().backward()

    started = time.perf_counter()
    step(compiled, args.tokens)
    step(compiled, args.tokens + 100)  # the dynamic-shape graph, compiled once for every length
    compile_s = time.perf_counter() - started
    timings: dict[str, list[float]] = {"eager": [], "compiled": []}
    for round_ in range(args.rounds):
        order = [("eager", eager), ("compiled", compiled)]
        tokens = args.tokens - 100 + 37 * round_
        for name, model in order if round_ % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            for _ in range(args.steps):
                step(model, tokens)
            timings[name].append((time.perf_counter() - started) / args.steps)
    eager_s, compiled_s = statistics.median(timings["eager"]), statistics.median(timings["compiled"])
    where = f"~{args.tokens} tokens, {args.precision}, {args.threads} threads"
    print(f"norm + MLP of a {args.hidden}-wide block, {where}")
    print(f"compile (first two steps): {compile_s:.1f} s")
    print(f"eager    {eager_s * 1e3:7.1f} ms per forward + backward")
    print(f"compiled {compiled_s * 1e3:7.1f} ms per forward + backward  ({eager_s / compiled_s:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
