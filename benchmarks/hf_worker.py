"""The baselines, one per process (so its peak RSS is its own): `python -m benchmarks.hf_worker SPEC OUT`.

- `trainer`: HF `Trainer` + `AutoModelForSequenceClassification` (3 labels, hard-label cross
  entropy) + `DataCollatorWithPadding` (dynamic padding), the usual Kaggle LMSYS baseline. It
  trains on exactly the token ids hpref's formatter produced (written by `benchmarks.run`).
- `trl`: TRL's `RewardTrainer` on chosen/rejected token ids (1 label, Bradley-Terry loss). With
  `spec["lora"]` the model is wrapped by PEFT first (what `RewardTrainer(peft_config=...)` does; done
  here so the optimizer below is built over the adapters): LoRA on every linear layer inside the
  transformer blocks, the classifier (and BERT's pooler) trained in full, as hpref's `[lora]` does.

Both use AdamW with hpref's groups (head LR, no decay on biases and norms), a linear schedule with
the same warmup fraction, the same grad clip, batch, epochs and compute dtype as the hpref run.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import read_json, write_json


def build_model(spec: dict, num_labels: int):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if spec["arch"] == "llama":
        config = AutoConfig.from_pretrained(spec["config_dir"], num_labels=num_labels)
        model = AutoModelForSequenceClassification.from_config(config)
        state = torch.load(spec["init_state"], weights_only=True)  # hpref's seeded backbone: same init
        missing, unexpected = model.model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
    else:
        model = AutoModelForSequenceClassification.from_pretrained(spec["config_dir"], num_labels=num_labels)
    model.config.pad_token_id = spec["pad_token_id"]
    return model


def wrap_lora(model, lora: dict):
    """PEFT LoRA with hpref's defaults: adapters on the block's linear layers (not BERT's pooler,
    which trains in full beside the score layer), alpha = 2 r, no adapter dropout."""
    from peft import LoraConfig, TaskType, get_peft_model

    linears = "query|key|value|dense|q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"
    blocks = rf".*\.(layer|layers)\.\d+\..*\.({linears})"
    pooler = ["pooler"] if getattr(getattr(model, "bert", None), "pooler", None) is not None else []
    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,  # adds the classifier / score layer to modules_to_save
        r=lora["r"],
        lora_alpha=lora.get("alpha") or 2 * lora["r"],
        lora_dropout=lora.get("dropout", 0.0),
        target_modules=blocks,
        modules_to_save=pooler,
    )
    return get_peft_model(model, config)


def optimizer_and_schedule(model, spec: dict, total_steps: int):
    from transformers import get_linear_schedule_with_warmup

    head_names = ("score.", "classifier.")
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:  # LoRA: the frozen base
            continue
        name = name.removeprefix("base_model.model.")  # PEFT's wrapper prefix
        groups.setdefault((name.startswith(head_names), p.ndim >= 2), []).append(p)
    param_groups = [
        {
            "params": ps,
            "lr": (spec["head_lr"] or spec["lr"]) if head else spec["lr"],
            "weight_decay": spec["weight_decay"] if decayed else 0.0,
        }
        for (head, decayed), ps in sorted(groups.items())
    ]
    opt = torch.optim.AdamW(param_groups, lr=spec["lr"], betas=tuple(spec["betas"]), eps=1e-8, foreach=True)
    warmup = int(math.ceil(spec["warmup_fraction"] * total_steps))
    return opt, get_linear_schedule_with_warmup(opt, warmup, total_steps)


def main(spec_path: str, out_path: str) -> None:
    from datasets import Dataset

    spec = read_json(Path(spec_path))
    torch.manual_seed(spec["seed"])
    data = torch.load(spec["data"], weights_only=False)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = spec["pad_token_id"]
    reward = spec["mode"] == "trl"
    model = build_model(spec, 1 if reward else 3)
    if spec.get("lora"):
        model = wrap_lora(model, spec["lora"])
    batch = spec["batch_size"]
    n_train = len(data["train"]["chosen_ids" if reward else "input_ids"])
    total_steps = math.ceil(n_train / batch) * spec["epochs"]
    optimizers = optimizer_and_schedule(model, spec, total_steps)
    common = dict(
        output_dir=spec["work_dir"],
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=spec["eval_batch_size"],
        num_train_epochs=spec["epochs"],
        max_grad_norm=spec["grad_clip"],
        bf16=spec["bf16"],
        logging_steps=10,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=spec["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if spec.get("gradient_checkpointing") is not None:  # None: the trainer's own default
        common["gradient_checkpointing"] = spec["gradient_checkpointing"]
    if reward:
        from trl import RewardConfig, RewardTrainer

        args = RewardConfig(**common, max_length=spec["max_length"], center_rewards_coefficient=None)
        train = Dataset.from_dict(data["train"])
        trainer = RewardTrainer(
            model=model, args=args, train_dataset=train, processing_class=tokenizer, optimizers=optimizers
        )
    else:
        from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

        args = TrainingArguments(**common, remove_unused_columns=True)
        train = Dataset.from_dict(data["train"])
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train,
            data_collator=DataCollatorWithPadding(tokenizer),
            optimizers=optimizers,
        )
    t = time.perf_counter()
    result = trainer.train()
    train_s = time.perf_counter() - t
    out = {"train_s": train_s, "train_loss": result.training_loss, "steps": result.global_step}
    # what a user keeps: the trained weights (a PEFT model writes its adapter folder only)
    saved = Path(spec["work_dir"]) / "final"
    trainer.save_model(str(saved))
    out["saved_bytes"] = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())

    # Eval: the model's forward on padded batches (longest first is not the HF default; keep order).
    model.eval()
    ev = data["eval"]
    eval_bs = spec["eval_batch_size"]
    t = time.perf_counter()
    scores = []
    dtype_ctx = (
        torch.autocast("cpu", dtype=torch.bfloat16) if spec["bf16"] else torch.autocast("cpu", enabled=False)
    )
    with torch.inference_mode(), dtype_ctx:
        if reward:
            for key in ("chosen_ids", "rejected_ids"):
                part = []
                for i in range(0, len(ev[key]), eval_bs):
                    enc = tokenizer.pad({"input_ids": ev[key][i : i + eval_bs]}, return_tensors="pt")
                    part.append(model(**enc).logits.float()[:, 0])
                scores.append(torch.cat(part))
        else:
            for i in range(0, len(ev["input_ids"]), eval_bs):
                enc = tokenizer.pad({"input_ids": ev["input_ids"][i : i + eval_bs]}, return_tensors="pt")
                scores.append(model(**enc).logits.float())
    eval_s = time.perf_counter() - t
    if reward:
        chosen, rejected = scores
        # equal scores (bf16 rounds coarsely) count half, as in benchmarks.run.pairwise_scores
        out["eval_accuracy"] = float(
            ((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).mean()
        )
        out["eval_log_loss"] = float(-torch.nn.functional.logsigmoid(chosen - rejected).mean())
        out["eval_rows"] = len(chosen)
        # each eval pair's own outcome, in the data's order: the benchmark pairs them with hpref's
        out["eval_hits"] = ((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).tolist()
    else:
        logits = torch.cat(scores)
        labels = torch.tensor(ev["labels"])
        out["eval_log_loss"] = float(torch.nn.functional.cross_entropy(logits, labels))
        out["eval_accuracy"] = float((logits.argmax(-1) == labels).float().mean())
        out["eval_rows"] = len(labels)
    out["eval_s"] = eval_s
    out["eval_rows_per_s"] = out["eval_rows"] / eval_s
    out["threads"] = torch.get_num_threads()
    write_json(Path(out_path), out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
