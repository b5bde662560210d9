"""The TRL side of `benchmarks.rl_real`: TRL's `GRPOTrainer` on the same prompts, reward and budget.

    .venv/bin/python -m benchmarks.rl_trl SPEC.json [--out RESULT.json]

Runs `run_trl_grpo(spec)` and prints its result as one JSON line (the last line of stdout), also
written to `--out` when given. Run it in a process of its own: the peak RSS is the process's.

SPEC (written by `benchmarks.rl_real.run_trl`): `model_path` (a local causal-LM folder with its
tokenizer and chat template), `prompts` (chat message lists ending with a user turn, consumed in
order, `prompts_per_update` per optimizer step), `reward` ("module:function" taking the prompts and
the plain answer texts, returning one float per answer), `group_size`, `prompts_per_update`,
`num_updates`, `max_new_tokens`, `temperature`, `lr`, `beta`, `lora` (or null: full fine-tune),
`bf16`, `gradient_checkpointing`, `threads`, `seed`, `output_dir`.

One GRPO update per `prompts_per_update x group_size` answers, as hpref does (TRL 1.16 semantics,
read from `trl/trainer/grpo_trainer.py` / `grpo_config.py`):

- `per_device_train_batch_size = prompts_per_update * group_size`, `gradient_accumulation_steps = 1`,
  `steps_per_generation = 1` (so `generation_batch_size` = that same number), `num_iterations = 1`:
  the dataloader hands `_prepare_inputs` one generation batch per optimizer step, TRL generates and
  scores it inside `training_step` and takes one optimizer step on it. With these three at 1 TRL
  skips the "old log-probs" forward (the batch is exactly on-policy, the ratio is 1 by construction).
- `loss_type = "dapo"`: the clipped surrogate summed over every completion token of the batch and
  divided by the batch's token count, i.e. hpref's `aggregation = "token-mean"` ("grpo" would be
  hpref's "sequence-mean"); `scale_rewards = "group"` (the group's unbiased std, hpref's default);
  `epsilon = 0.2`, `epsilon_high = 0.28` (hpref's `clip_low` / `clip_high`).
- Data: `shuffle_dataset = False` is TRL's supported switch: its `RepeatSampler` then walks the rows
  in order (each repeated `num_generations` times, consecutively), so update u answers prompts
  [u * P, (u + 1) * P). The order the reward function saw is checked after the run.
- Generation: TRL's own `model.generate` (no vLLM, no continuous batching) with do_sample,
  `temperature`, `top_p = 1`, `top_k = 0` (off), `min_p` off, no repetition penalty.
- Optimizer: `torch.optim.AdamW` (`optim = "adamw_torch"`, hpref's), betas (0.9, 0.99), no weight
  decay, constant learning rate without warmup, gradient clipping at norm 1.

Timing: a callback takes `time.perf_counter()` at `on_step_begin` and `on_step_end`; between the two
lie generation, reward, loss, backward, clipping and the optimizer step (TRL generates in
`_prepare_inputs`, called from `training_step`). The generation and reward calls are also timed on
their own (the trainer's `_generate` / `_calculate_rewards` are wrapped on the instance, nothing
else changed). Peak RSS: the process's RSS sampled every 50 ms in a thread, over the whole call.
"""

from __future__ import annotations

import os

# No hub: every model, tokenizer and dataset here is local. Set before transformers / TRL / datasets
# are imported (huggingface_hub reads them at import); `run_trl_grpo` also sets the live constants,
# in case the caller imported them first. TRL >= 1.x pings telemetry when a trainer is built unless
# one of these is set.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

_SETTINGS = (
    "use_cpu",
    "bf16",
    "fp16",
    "activation_checkpointing",
    "gradient_checkpointing",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_generations",
    "generation_batch_size",
    "steps_per_generation",
    "num_iterations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "use_vllm",
    "use_transformers_continuous_batching",
    "loss_type",
    "scale_rewards",
    "epsilon",
    "epsilon_high",
    "beta",
    "mask_truncated_completions",
    "importance_sampling_level",
    "shuffle_dataset",
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


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class _PeakRss:
    """The process's peak RSS, sampled every `interval` seconds in a daemon thread."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def now(self) -> int:
        return self._process.memory_info().rss

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        return self.peak


def _timed(record: list[float], fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - began)

    return wrapper


def checkpointing_kwargs(config_cls: type, on: bool) -> dict[str, bool]:
    """Gradient checkpointing under the name this transformers takes: `gradient_checkpointing` up to
    5.2x, `activation_checkpointing` after the rename (the old name then a deprecated alias)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_cls)}
    key = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {key: on}


def shared_trainer_args(spec: dict[str, Any]) -> dict[str, Any]:
    """The TrainingArguments both TRL runners set alike: the optimizer hpref uses (transformers'
    default would be the fused AdamW), a constant lr, every step logged (for the per-update numbers),
    nothing saved, reported or printed."""
    return {
        "dataloader_num_workers": 0,
        "optim": "adamw_torch",
        "learning_rate": float(spec["lr"]),
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.99,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "seed": int(spec["seed"]),
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


def step_timer(steps: list[float], logged: list[dict[str, float]], step_key: str) -> Any:
    """A callback timing each optimizer step (`on_step_begin` to `on_step_end`) into `steps` and
    keeping each step's logs (those with `step_key`, not train()'s closing summary) in `logged`."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.began = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            steps.append(time.perf_counter() - self.began)

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **__: Any) -> None:
            if logs and step_key in logs:
                logged.append(dict(logs))

    return Timer()


def lora_config(spec: dict[str, Any]) -> Any:
    """PEFT's config of the spec's `lora` (r, alpha, dropout, target modules), or None: full fine-tune."""
    if not spec.get("lora"):
        return None
    from peft import LoraConfig

    lora = spec["lora"]
    return LoraConfig(
        r=int(lora["r"]),
        lora_alpha=lora["alpha"],
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=list(lora["target_modules"]),
        task_type="CAUSAL_LM",
    )


def run_trl_grpo(spec: dict[str, Any]) -> dict[str, Any]:
    """One TRL GRPO run as `spec` describes (see the module docstring); returns timings, rewards,
    peak RSS and the TRL settings used."""
    import torch

    torch.set_num_threads(int(spec["threads"]))
    rss = _PeakRss()
    import_began = time.perf_counter()

    import huggingface_hub.constants
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY = True
    setup_began = time.perf_counter()  # setup: the config, model, tokenizer, dataset and trainer

    group = int(spec["group_size"])
    per_update = int(spec["prompts_per_update"])
    updates = int(spec["num_updates"])
    answers = per_update * group
    prompts = list(spec["prompts"])[: updates * per_update]
    if len(prompts) < updates * per_update:
        raise ValueError(
            f"{updates} updates of {per_update} prompts need {updates * per_update}, got {len(prompts)}"
        )

    user_reward = _load(spec["reward"])
    seen: list[list[dict]] = []  # the prompts of every reward call, to check TRL's order afterwards

    def reward(prompts: list, completions: list, **_: Any) -> list[float]:
        # Conversational data: TRL hands each completion as [{"role": "assistant", "content": text}]
        # (decoded with skip_special_tokens); the spec's reward takes the plain text. TRL's extra
        # keyword arguments (completion_ids, trainer_state, log_extra, ...) are not passed on.
        seen.extend(prompts)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(r) for r in user_reward(prompts, texts)]

    reward.__name__ = "reward"  # TRL logs it as rewards/reward/mean; the total is "reward"

    peft_config = lora_config(spec)

    args = GRPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=True,
        # TRL's defaults are bf16=True and gradient_checkpointing=True (not transformers'): set both
        # from the spec. On the CPU bf16 is accelerate's autocast around the model's forward, the
        # weights stay fp32. transformers 5.25 renamed gradient_checkpointing to
        # activation_checkpointing; the one installed here may predate it (`checkpointing_kwargs`).
        bf16=bool(spec["bf16"]),
        **checkpointing_kwargs(GRPOConfig, bool(spec["gradient_checkpointing"])),
        # the model is loaded by TRL (the documented path), in fp32 whatever the folder's config says
        model_init_kwargs={"dtype": "float32"},
        # one optimizer step per generation batch of prompts_per_update x group_size answers
        per_device_train_batch_size=answers,
        gradient_accumulation_steps=1,
        num_generations=group,
        steps_per_generation=1,
        num_iterations=1,
        max_steps=updates,
        # sampling: plain temperature sampling, nothing filtered
        max_completion_length=int(spec["max_new_tokens"]),
        temperature=float(spec["temperature"]),
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        # the loss (see the module docstring)
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=float(spec["beta"]),  # 0: TRL builds no reference model
        # the prompts in the spec's order
        shuffle_dataset=False,
        **shared_trainer_args(spec),
    )

    steps: list[float] = []
    logged: list[dict[str, float]] = []

    trainer = GRPOTrainer(
        model=spec["model_path"],
        reward_funcs=[reward],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),  # conversational, in memory
        peft_config=peft_config,
        callbacks=[step_timer(steps, logged, "reward")],
    )
    trainer.remove_callback(PrinterCallback)  # keep stdout for the JSON result
    generate_s: list[float] = []
    reward_s: list[float] = []
    trainer._generate = _timed(generate_s, trainer._generate)
    trainer._calculate_rewards = _timed(reward_s, trainer._calculate_rewards)
    setup_s = time.perf_counter() - setup_began
    rss_before_train = rss.now()

    began = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - began
    peak = rss.stop()

    def strip(messages: list[dict]) -> list[tuple]:  # Arrow adds the other rows' keys as None
        return [(m["role"], m["content"]) for m in messages]

    expected = [strip(p) for p in prompts for _ in range(group)]
    if [strip(p) for p in seen] != expected:
        raise RuntimeError("TRL did not consume the prompts in the spec's order, group_size at a time")

    model = trainer.model
    return {
        "seconds_per_update": steps,
        "seconds_per_update_median": statistics.median(steps) if steps else None,
        "generate_s_per_update": generate_s,
        "reward_s_per_update": reward_s,
        "wall_s": wall,
        "setup_s": setup_s,
        "import_s": setup_began - import_began,
        "mean_reward_per_update": [log["reward"] for log in logged],
        "mean_completion_tokens_per_update": [log.get("completions/mean_length") for log in logged],
        "peak_rss_gib": peak / 2**30,
        "rss_before_train_gib": rss_before_train / 2**30,
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "settings": {
            **{name: getattr(args, name) for name in _SETTINGS},
            "lora": spec.get("lora"),
            "model_dtype": str(next(model.parameters()).dtype),
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "mixed_precision": str(trainer.accelerator.mixed_precision),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path, help="the spec, a JSON file")
    parser.add_argument("--out", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = run_trl_grpo(json.loads(args.spec.read_text()))
    text = json.dumps(result, default=str)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
