"""The TRL side of `benchmarks.rl_real`'s online-DPO contenders: TRL's `OnlineDPOTrainer` on the same
prompts, reward and budget as `hpref rl` with `algorithm = "online-dpo"` (issue #38).

    .venv/bin/python -m benchmarks.online_dpo_trl SPEC.json [--out RESULT.json]

Runs `run_trl_online_dpo(spec)` and prints its result as one JSON line (the last line of stdout), also
written to `--out` when given. Run it in a process of its own: the peak RSS is the process's.

SPEC (written by `benchmarks.rl_real.run_trl` for a `trl-dpo-*` contender): `model_path` (a local
causal-LM folder with its tokenizer and chat template), `prompts` (chat message lists ending with a
user turn, consumed in order, `prompts_per_update` per optimizer step), `reward` ("module:function"
taking the prompts and the plain answer texts, returning one float per answer), `prompts_per_update`,
`num_updates`, `max_new_tokens`, `temperature`, `lr`, `beta`, `loss_type` ("sigmoid" or "ipo"),
`lora` (or null: full fine-tune), `bf16`, `gradient_checkpointing`, `threads`, `seed`, `output_dir`,
`max_length` (optional, default 2048).

One online-DPO update per `prompts_per_update` prompts x 2 answers, as hpref's `online-dpo` with
`rl.rollout.group_size = 2` does (TRL 1.16 semantics, read from
`trl/experimental/online_dpo/online_dpo_trainer.py` / `online_dpo_config.py`):

- Batch: `per_device_train_batch_size = prompts_per_update`, `gradient_accumulation_steps = 1`:
  `training_step` gets P prompts, samples 2 answers to each (TRL's `num_generations` is fixed at 2),
  scores the 2P answers and takes one optimizer step on the P pairs. Everything is on-policy (TRL has
  no staleness; hpref's recipe allows its trainer one version of lag, see `benchmarks.rl_real`).
- Generation: TRL's own `model.generate` on the training model (no vLLM), do_sample, `temperature`,
  `top_p = 1`, `top_k = 0` (off), no `min_p`, no repetition penalty, `use_cache` on (off only under
  gradient checkpointing), a completion cut after its first eos (`truncate_right`), at most
  `max_new_tokens` tokens; no `missing_eos_penalty` (hpref has none).
- Judge: the reward function scores each of the 2P answers alone; TRL takes the higher-scored answer
  of a prompt as chosen (`first >= second`: a tie goes to the first sample), a hard 0/1 label.
  hpref's `online-dpo` asks the same export for the pair's three-way verdict instead (Davidson's
  P(first), P(second), P(tie) from the two scores and the export's tie strength) and its sigmoid loss
  takes it as a soft label (`P(first) + P(tie) / 2`): the same objective family, not the same labels.
- Loss: `loss_type = "sigmoid"` is standard DPO, `-log sigmoid(beta * ((log pi(c) - log ref(c)) -
  (log pi(r) - log ref(r))))` with each answer's log-probs summed over its tokens, the mean over the
  P pairs (hpref: the same, summed over pairs / pairs); `beta` the spec's.
- Reference: with LoRA (`peft_config`) TRL builds no reference model: it runs the same model inside
  `disable_adapter()` under `torch.no_grad()` (hpref: the adapters off, the same). Without LoRA it
  deep-copies the start (`create_reference_model`).
- Log-probs at temperature 1 (TRL's `_forward` does not divide the logits by the sampling
  temperature; hpref's online DPO neither), over the left-padded prompt + right-padded completion; TRL
  left-truncates sequences longer than `max_length` (its default 512): set to 2048 here so no prompt
  is cut, as hpref cuts none (the recipe keeps prompts under 1,000 characters).
- Dropout off in the policy (`disable_dropout`, TRL's default; hpref's LoRA has dropout 0).
- Data: transformers' `train_sampling_strategy = "sequential"` (TRL's OnlineDPOTrainer has no
  `shuffle_dataset`; the Trainer's default sampler is random), so update u answers prompts
  [u * P, (u + 1) * P), as hpref's rollout u does. The order the reward function saw (P prompts, then
  the same P again: TRL's block layout of the two samples) is checked after the run.
- Optimizer: `torch.optim.AdamW` (`optim = "adamw_torch"`, hpref's), betas (0.9, 0.99), no weight
  decay, constant learning rate without warmup, gradient clipping at norm 1.

Timing: as `benchmarks.rl_trl`, a callback takes `time.perf_counter()` at `on_step_begin` and
`on_step_end`; between the two lie generation, the policy's and the reference's forward passes,
decoding, the reward, the loss, backward, clipping and the optimizer step (TRL generates inside
`training_step`). The generation and reward calls are also timed on their own (the trainer's
`_generate` / `_calculate_rewards_from_functions` wrapped on the instance, nothing else changed).
Peak RSS: the process's RSS sampled every 50 ms in a thread, over the whole call.

The driver-side helpers (`hpref_overrides`, `hpref_fields`, `trl_result`, `table`) are also here, so
`benchmarks.rl_real` stays the GRPO driver it was plus a few dispatch lines.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.rl_trl import (  # noqa: E402
    _load,
    _PeakRss,
    _timed,
    checkpointing_kwargs,
    lora_config,
    shared_trainer_args,
    step_timer,
)

#: the DPO settings both sides train with: standard DPO (hpref's default is the tie-aware "davidson")
LOSS_TYPE = "sigmoid"
BETA = 0.1
#: answers per prompt: TRL's OnlineDPOTrainer samples exactly 2; hpref's rl.rollout.group_size
GROUP = 2

_SETTINGS = (
    "use_cpu",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_new_tokens",
    "max_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "use_vllm",
    "missing_eos_penalty",
    "loss_type",
    "beta",
    "disable_dropout",
    "train_sampling_strategy",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "optim",
    "adam_beta1",
    "adam_beta2",
    "weight_decay",
    "max_grad_norm",
    "max_steps",
    "seed",
    "dataloader_num_workers",
)


def run_trl_online_dpo(spec: dict[str, Any]) -> dict[str, Any]:
    """One TRL online-DPO run as `spec` describes (see the module docstring); returns timings, scores,
    the DPO loss per update, peak RSS and the TRL settings used."""
    import torch

    torch.set_num_threads(int(spec["threads"]))
    rss = _PeakRss()
    import_began = time.perf_counter()

    import huggingface_hub.constants
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY = True
    setup_began = time.perf_counter()  # setup: the config, model, tokenizer, dataset and trainer

    per_update = int(spec["prompts_per_update"])
    updates = int(spec["num_updates"])
    prompts = list(spec["prompts"])[: updates * per_update]
    if len(prompts) < updates * per_update:
        raise ValueError(
            f"{updates} updates of {per_update} prompts need {updates * per_update}, got {len(prompts)}"
        )

    user_reward = _load(spec["reward"])
    seen: list[list[dict]] = []  # the prompts of every reward call, to check TRL's order afterwards

    def reward(prompts: list, completions: list, **_: Any) -> list[float]:
        # Conversational data: TRL hands each completion as [{"role": "assistant", "content": text}]
        # (decoded with skip_special_tokens); the spec's reward takes the plain text.
        seen.extend(prompts)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(r) for r in user_reward(prompts, texts)]

    reward.__name__ = "reward"

    peft_config = lora_config(spec)

    args = OnlineDPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=True,
        # TRL's defaults are bf16=True and gradient_checkpointing=True: both from the spec. On the CPU
        # bf16 is accelerate's autocast around the forward passes, the weights stay fp32.
        bf16=bool(spec["bf16"]),
        **checkpointing_kwargs(OnlineDPOConfig, bool(spec["gradient_checkpointing"])),
        model_init_kwargs={"dtype": "float32"},  # the model is loaded by TRL, in fp32
        # one optimizer step per P prompts x 2 answers
        per_device_train_batch_size=per_update,
        gradient_accumulation_steps=1,
        max_steps=updates,
        # sampling: plain temperature sampling, nothing filtered, no prompt truncated
        max_new_tokens=int(spec["max_new_tokens"]),
        max_length=int(spec.get("max_length", 2048)),
        temperature=float(spec["temperature"]),
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        use_vllm=False,
        missing_eos_penalty=None,
        # the loss
        loss_type=str(spec["loss_type"]),
        beta=[float(spec["beta"])],
        disable_dropout=True,
        # the prompts in the spec's order
        train_sampling_strategy="sequential",
        **shared_trainer_args(spec),
    )

    steps: list[float] = []
    logged: list[dict[str, float]] = []

    trainer = OnlineDPOTrainer(
        model=spec["model_path"],
        reward_funcs=[reward],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),  # conversational, in memory
        processing_class=AutoTokenizer.from_pretrained(spec["model_path"]),
        peft_config=peft_config,
        callbacks=[step_timer(steps, logged, "objective/scores")],
    )
    trainer.remove_callback(PrinterCallback)  # keep stdout for the JSON result
    generate_s: list[float] = []
    reward_s: list[float] = []
    trainer._generate = _timed(generate_s, trainer._generate)
    trainer._calculate_rewards_from_functions = _timed(reward_s, trainer._calculate_rewards_from_functions)
    setup_s = time.perf_counter() - setup_began
    rss_before_train = rss.now()

    began = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - began
    peak = rss.stop()

    def strip(messages: list[dict]) -> list[tuple]:  # Arrow adds the other rows' keys as None
        return [(m["role"], m["content"]) for m in messages]

    expected = []
    for u in range(updates):  # TRL's block layout: the P prompts for the first samples, then again
        batch = [strip(p) for p in prompts[u * per_update : (u + 1) * per_update]]
        expected += batch + batch
    if [strip(p) for p in seen] != expected:
        raise RuntimeError("TRL did not consume the prompts in the spec's order, P at a time, twice each")

    model = trainer.model
    return {
        "seconds_per_update": steps,
        "seconds_per_update_median": statistics.median(steps) if steps else None,
        "generate_s_per_update": generate_s,
        "reward_s_per_update": reward_s,
        "wall_s": wall,
        "setup_s": setup_s,
        "import_s": setup_began - import_began,
        # the reward model's mean score of the update's 2P answers, and the DPO numbers
        "mean_reward_per_update": [log["objective/scores"] for log in logged],
        "loss_per_update": [log.get("loss") for log in logged],
        "accuracy_per_update": [log.get("rewards/accuracies") for log in logged],
        "margin_per_update": [log.get("rewards/margins") for log in logged],
        # TRL's objective/kl: log pi - log ref summed over every completion position, its padding
        # included (not masked), so not hpref's KL to the start; kept in the JSON, not in the table
        "kl_per_update": [log.get("objective/kl") for log in logged],
        "contain_eos_per_update": [log.get("val/contain_eos_token") for log in logged],
        "peak_rss_gib": peak / 2**30,
        "rss_before_train_gib": rss_before_train / 2**30,
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "settings": {
            **{name: getattr(args, name) for name in _SETTINGS},
            "num_generations": trainer.num_generations,
            "reference": "adapters off" if trainer.ref_model is None else "a copy of the start",
            "lora": spec.get("lora"),
            "model_dtype": str(next(model.parameters()).dtype),
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "mixed_precision": str(trainer.accelerator.mixed_precision),
        },
    }


# --------------------------------------------------------------------------------------------------
# driver side (`benchmarks.rl_real`): hpref's settings, the results and their table


def hpref_overrides(prompts_per_update: int) -> list[str]:
    """`hpref rl rl-smollm2 --set ...` for online DPO on TRL's terms: every policy's algorithm standard
    DPO at `BETA`, answers in pairs, `prompts_per_update` prompts per rollout (this table replaces
    the recipe's GRPO one, kl_coef and measure_kl with it: DPO keeps its reference and reports the
    KL anyway)."""
    algorithm = f'{{ name = "online-dpo", loss_type = "{LOSS_TYPE}", beta = {BETA} }}'
    settings = [
        f"rl.defaults.algorithm={algorithm}",
        f"rl.rollout.group_size={GROUP}",
        f"rl.rollout.prompts_per_rollout={prompts_per_update}",
    ]
    return [arg for s in settings for arg in ("--set", s)]


def _quarters(values: list[float]) -> tuple[float, float]:
    quarter = max(1, len(values) // 4)
    return statistics.mean(values[:quarter]), statistics.mean(values[-quarter:])


def hpref_fields(train: list[dict]) -> dict[str, float]:
    """An hpref online-DPO policy's DPO numbers from its training rows (`loss`, `rewards_accuracy`,
    `kl`); its `reward_mean` is the pairwise reward (mean P(win) + P(tie) / 2, ~0.5 by construction)."""
    if not train or "loss" not in train[0]:
        return {}
    loss = _quarters([r["loss"] for r in train])
    out = {"loss_first_quarter": loss[0], "loss_last_quarter": loss[1]}
    accuracy = [r["rewards_accuracy"] for r in train if "rewards_accuracy" in r]
    if accuracy:
        out["accuracy_last_quarter"] = _quarters(accuracy)[1]
    if "kl" in train[-1]:
        out["kl_last"] = train[-1]["kl"]
    return out


def trl_result(got: dict, measured: dict) -> dict:
    """A `trl-dpo-*` contender's numbers, in `benchmarks.rl_real.hpref_result`'s layout."""
    rewards = _quarters(got["mean_reward_per_update"])
    loss = _quarters(got["loss_per_update"])
    return {
        **measured,
        "seconds_per_update": got["wall_s"] / len(got["seconds_per_update"]),
        "seconds_per_update_steady": statistics.median(got["seconds_per_update"]),
        "drive_s": got["wall_s"],
        "loop_to_last_update_s": got["wall_s"],
        "a": {
            "reward_first_quarter": rewards[0],
            "reward_last_quarter": rewards[1],
            "loss_first_quarter": loss[0],
            "loss_last_quarter": loss[1],
            "accuracy_last_quarter": _quarters(got["accuracy_per_update"])[1],
            "kl_last": got["kl_per_update"][-1],
            "gen_s_median": statistics.median(got["generate_s_per_update"]),
        },
        "trl": {k: got[k] for k in ("trl_version", "settings") if k in got},
    }


def table(results: dict[str, dict]) -> list[str]:
    """The online-DPO rows: wall per update, memory, load, the DPO loss, and hpref / TRL ratios."""
    if not results:
        return []
    lines = [
        "| contender | wall (s) | loop to last update (s) | s / update | median s between updates "
        "| generation s | peak PSS GiB (RSS) | load | DPO loss, first -> last 1/4 | accuracy, last 1/4 "
        "| TRL: mean score, first -> last 1/4 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    nan = float("nan")
    for name, r in results.items():
        a = r.get("a", {})
        gen = a.get("gen_s_median")
        scores = f"{a['reward_first_quarter']:+.3f} -> {a['reward_last_quarter']:+.3f}" if "trl" in r else "-"
        lines.append(
            f"| {name} | {r['wall_s']:.0f} | {r['loop_to_last_update_s']:.0f} | "
            f"{r['seconds_per_update']:.1f} | {r['seconds_per_update_steady']:.1f} | "
            f"{f'{gen:.1f}' if gen else '-'} | "
            f"{r.get('peak_pss_gib', nan):.2f} ({r['peak_rss_gib']:.2f}) | {r['load_mean']:.2f} | "
            f"{a.get('loss_first_quarter', nan):.4f} -> {a.get('loss_last_quarter', nan):.4f} "
            f"| {a.get('accuracy_last_quarter', nan):.2f} | {scores} |"
        )
    per_update = {name: r["seconds_per_update"] for name, r in results.items()}
    ratios = [
        f"{hpref} / {trl_name} seconds per update: {per_update[hpref] / per_update[trl_name]:.2f} "
        "(target <= 0.5)"
        for hpref in results
        if hpref.startswith("hpref-")
        for trl_name in results
        if trl_name.startswith("trl-")
    ]
    lines += ["", *ratios] if ratios else []
    lines += [
        "",
        f"Both sides: standard DPO (`{LOSS_TYPE}`), beta {BETA}, 2 answers per prompt, reference = the "
        "LoRA adapters off. hpref's label is the reward export's soft three-way verdict (Davidson's "
        "P(first), P(second), P(tie) from the two scores; the loss takes P(first) + P(tie) / 2); TRL's "
        "is hard (the higher score is chosen), so the two losses are not step-for-step equal.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path, help="the spec, a JSON file")
    parser.add_argument("--out", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = run_trl_online_dpo(json.loads(args.spec.read_text()))
    text = json.dumps(result, default=str)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
