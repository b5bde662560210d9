"""The TRL side of `benchmarks.rl_real`: TRL's `GRPOTrainer` on the same prompts, reward and budget.

    .venv/bin/python -m benchmarks.rl_trl SPEC.json --out RESULT.json

SPEC (written by `benchmarks.rl_real.run_trl`): `model_path` (a causal-LM folder), `prompts` (chat
message lists, consumed in order, `prompts_per_update` per optimizer step), `reward`
("module:function" taking prompts and answer texts, returning one float per answer), `group_size`,
`num_updates`, `max_new_tokens`, `temperature`, `lr`, `beta`, `lora` (or null), `bf16`,
`gradient_checkpointing`, `threads`, `seed`, `output_dir`.

One GRPO update per `prompts_per_update x group_size` answers, as hpref does: per-device batch = that
many answers, no gradient accumulation, one generation per step (`steps_per_generation = 1`), one pass
(`num_iterations = 1`), TRL's `dapo` loss (token-level mean over the batch, hpref's "token-mean"),
advantages scaled by the group's std (`scale_rewards = "group"`, hpref's default), the clip range
[1 - 0.2, 1 + 0.28] (hpref's `clip_low` / `clip_high`), constant learning rate, AdamW betas
(0.9, 0.99), no weight decay, gradient clipping at 1, no dataset shuffling (the prompts in hpref's
order), TRL's own transformers generation (no vLLM) on the CPU. Timed per update from the step's
start to its end (TRL generates inside the step), with the process's peak RSS sampled every 50 ms.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def run_trl_grpo(spec: dict[str, Any]) -> dict[str, Any]:
    import psutil
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(spec["threads"]))
    process = psutil.Process()
    peak = [process.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    setup_start = time.perf_counter()
    user_reward = _load(spec["reward"])

    def reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
        # conversational data: each completion is a message list ending with the assistant's answer
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        return user_reward(prompts, texts)

    reward.__name__ = "reward"
    answers = int(spec["prompts_per_update"]) * int(spec["group_size"])
    lora = spec.get("lora")
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora.get("dropout", 0.0),
            target_modules=lora["target_modules"],
            task_type="CAUSAL_LM",
        )
    args = GRPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=True,
        bf16=bool(spec["bf16"]),
        gradient_checkpointing=bool(spec["gradient_checkpointing"]),
        per_device_train_batch_size=answers,
        gradient_accumulation_steps=1,
        num_generations=int(spec["group_size"]),
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=int(spec["max_new_tokens"]),
        temperature=float(spec["temperature"]),
        top_p=1.0,
        learning_rate=float(spec["lr"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=float(spec["beta"]),
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        max_steps=int(spec["num_updates"]),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        seed=int(spec["seed"]),
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    dataset = Dataset.from_dict(
        {"prompt": spec["prompts"][: int(spec["num_updates"]) * int(spec["prompts_per_update"])]}
    )

    steps: list[float] = []
    rewards: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.began = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            steps.append(time.perf_counter() - self.began)

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **__: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[Timer()],
    )
    setup_s = time.perf_counter() - setup_start
    began = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - began
    stop.set()
    sampler.join()
    return {
        "seconds_per_update": steps,
        "seconds_per_update_median": statistics.median(steps) if steps else None,
        "wall_s": wall,
        "setup_s": setup_s,
        "mean_reward_per_update": rewards,
        "peak_rss_gib": peak[0] / 2**30,
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "settings": {
            k: getattr(args, k)
            for k in (
                "bf16",
                "gradient_checkpointing",
                "per_device_train_batch_size",
                "num_generations",
                "steps_per_generation",
                "num_iterations",
                "loss_type",
                "scale_rewards",
                "epsilon",
                "epsilon_high",
                "beta",
                "max_completion_length",
                "learning_rate",
            )
        },  # fmt: skip
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = run_trl_grpo(json.loads(args.spec.read_text()))
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "mean_reward_per_update"}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
