"""TRL's `DPOTrainer` on the benchmark's pairs, one process (so its peak RSS is its own):
`python -m benchmarks.dpo_trl_worker SPEC OUT` (written and read by `benchmarks.dpo_trl`).

The same model folder, pairs, LoRA, optimiser, schedule, batch and steps as the hpref run, so the two
loss curves can be compared step by step:
- the adapters are hpref's own (`apply_lora_to_causal_lm`, the same seed): LoRA's A matrices start
  random, and two different draws would part the curves from step 2 for no reason but the draw;
  `DPOTrainer` takes a `PeftModel` as it comes and, with no `ref_model`, computes the reference
  with the adapters off, as hpref does;
- the pairs are read in the order hpref's sampler trains on them (the driver wrote them so) by a
  sequential sampler, so step k of both sees the same pairs;
- AdamW with TRL's (transformers') defaults, which the driver also gives hpref; a constant LR, grad
  clip 1; dropout off (TRL's default, and hpref's).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import read_json, write_json


def main(spec_path: str, out_path: str) -> None:
    spec = read_json(Path(spec_path))
    torch.manual_seed(spec["seed"])
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from hpref.models.lm_adapters import apply_lora_to_causal_lm
    from hpref.recipe import LoraSection

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    lora = LoraSection(r=spec["lora_r"], alpha=spec["lora_alpha"], dropout=0.0)
    model = apply_lora_to_causal_lm(model, lora, seed=spec["seed"])
    rows = [json.loads(line) for line in Path(spec["pairs"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])

    class InHprefOrder(DPOTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    args = DPOConfig(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=1,
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=spec["beta"],
        loss_type=["sigmoid"],
        max_length=spec["max_length"],
        bf16=spec["bf16"],
        gradient_checkpointing=spec["gradient_checkpointing"],
        padding_free=spec.get("padding_free", False),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=spec["seed"],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_dropout=True,
    )
    trainer = InHprefOrder(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h and "train_runtime" not in h]
    write_json(
        Path(out_path),
        {
            "train_s": train_s,
            "losses": losses,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "logged": [{k: v for k, v in h.items() if isinstance(v, int | float)} for h in history],
        },
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
