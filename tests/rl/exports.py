"""What the tests of `hpref save RL_RUN --policy` compare: a run's recorded greedy eval answers, and an
exported policy's own greedy answers to the same prompts, as a user gets them with transformers."""

from __future__ import annotations

import json
from pathlib import Path


def recorded_answers(run_dir: Path, save: str, player: str) -> list[tuple[tuple[str, ...], str]]:
    """(prompt turns, greedy answer) of `player` at the eval named `save` (`rollout-000002`), as the
    run's engine answered and `metrics/eval_answers/` keeps them."""
    path = run_dir / "metrics" / "eval_answers" / f"{save}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(tuple(r["prompt"]), r["answer"]) for r in rows if r["player"] == player]


def greedy_answers(
    model, tokenizer, prompts: list[tuple[str, ...]], max_new_tokens: int, repetition_penalty: float = 1.0
) -> list[str]:
    """Plain transformers greedy decoding of each prompt laid out by the tokenizer's chat template:
    what someone who downloaded the export would run (no hpref code in the way), with the run's
    repetition penalty (transformers' own, the form hpref's engines apply)."""
    import torch

    out = []
    for turns in prompts:
        messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
        ]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            tokens = model.generate(
                **ids,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                repetition_penalty=repetition_penalty,
            )
        out.append(tokenizer.decode(tokens[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    return out


def check_merged(merged: dict, base: dict, adapter_dir: Path) -> int:
    """Check that the state dict `merged` is `base` plus the LoRA delta `B @ A * alpha / r` of the
    PEFT adapter folder `adapter_dir` on every adapted linear, and `base` elsewhere (fp32 rounding);
    returns how many deltas were non-zero (0: the adapter never moved, and the check proved little)."""
    import torch
    from safetensors.torch import load_file

    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    deltas = {
        key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight"): (
            adapter[key.replace(".lora_A.", ".lora_B.")].float() @ adapter[key].float()
        )
        * config["lora_alpha"]
        / config["r"]
        for key in adapter
        if ".lora_A." in key
    }
    assert merged.keys() == base.keys() and deltas.keys() <= base.keys()
    for key, value in base.items():
        want = value.float() + deltas[key] if key in deltas else value.float()
        torch.testing.assert_close(merged[key].float(), want, rtol=0, atol=1e-6, msg=key)
    return sum(int(delta.abs().max() > 0) for delta in deltas.values())
