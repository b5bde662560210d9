"""`hpref save` of an offline DPO run (`[dpo]`): the policy as a transformers causal-LM folder; and
the writer of that folder (`write_policy_folder`), which an rl policy's export uses too
(`hpref.save.rl_export`).

The policy is rebuilt from the run's resolved recipe (`dpo.model`, its LoRA adapters as trained),
wrapped as it trained (`hpref.models.pair_logprobs.PackedLogProbs`, so the checkpoint's keys fit), and
only what trained is read from the checkpoint (DCP reshards any world size into one; the frozen base
is the model's own). Then, as PEFT users expect:

- merged (the default): the adapters folded into the base (PEFT's `merge_and_unload`), written with
  `save_pretrained` beside the tokenizer (chat template included) and the generation config (its
  `eos_token_id` the ids hpref's engines stop at), so `AutoModelForCausalLM.from_pretrained(folder)`
  and vLLM load it as they load the base;
- `--adapter`: PEFT's adapter folder (`adapter_config.json` naming the base folder in
  `base_model_name_or_path`, `adapter_model.safetensors`) and the tokenizer:
  `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)`, or vLLM's
  `LoRARequest`.

The folder is written beside `to` under a temporary name and renamed into place (`hpref.save.target`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from loguru import logger

from hpref.errors import UserError
from hpref.exports.layout import CHECKPOINT_JSON, MODEL_CARD
from hpref.recipe import Recipe
from hpref.runfolder.layout import RECIPE, SUMMARY, TRAIN_STATE
from hpref.save.card import metrics_and_recipe


def load_policy(checkpoint_dir: Path, recipe: Recipe) -> tuple[Any, Any, Any]:
    """(causal LM with its trained weights, tokenizer, PEFT model or None) from a DPO checkpoint, on
    one CPU process."""
    import torch

    from hpref.models.causal_lm import build_policy_model
    from hpref.models.pair_logprobs import PackedLogProbs
    from hpref.runfolder.checkpoints import validate_checkpoint
    from hpref.runfolder.safe_load import CheckpointError, dcp_load

    assert recipe.dpo is not None
    lm, tokenizer = build_policy_model(recipe.dpo.model)
    peft_model = None
    if recipe.lora is not None:
        from hpref.models.lm_adapters import apply_lora_to_causal_lm

        peft_model = apply_lora_to_causal_lm(lm, recipe.lora, seed=recipe.run.seed)
    root = PackedLogProbs(lm)
    frozen = {name for name, p in root.named_parameters() if not p.requires_grad}
    template = {k: torch.empty_like(v) for k, v in root.state_dict().items() if k not in frozen}
    validate_checkpoint(checkpoint_dir, template)
    dcp_load({"model": template}, checkpoint_dir, no_dist=True)
    missing, unexpected = root.load_state_dict(template, strict=False)
    absent = sorted(set(missing) - frozen)
    if unexpected or absent:
        raise CheckpointError(
            f"{checkpoint_dir}: does not fit the recipe's policy (missing {absent[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    lm.eval()
    return lm, tokenizer, peft_model


def _eval_metrics(run_dir: Path) -> dict[str, Any]:
    summary = run_dir / SUMMARY
    if not summary.is_file():
        return {}
    data = json.loads(summary.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if k.startswith("eval_")}


def policy_card(recipe: Recipe, checkpoint: Path, step: Any, dtype: str, adapter: bool, metrics: dict) -> str:
    """The export's README: what it is, how to load it, its eval metrics and its recipe."""
    assert recipe.dpo is not None
    load = (
        "`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)` with the base "
        "named in `adapter_config.json` (`base_model_name_or_path`); vLLM: `LoRARequest`"
        if adapter
        else "`transformers.AutoModelForCausalLM.from_pretrained(folder)`, or `vllm.LLM(folder)`"
    )
    lines = [
        "---",
        "library_name: transformers" if not adapter else "library_name: peft",
        "tags: [dpo, hpref]",
        "---",
        "",
        "# hpref DPO policy",
        "",
        f"A causal LM trained with offline DPO (`loss_type = {recipe.dpo.loss_type}`, "
        f"beta {recipe.dpo.beta}).",
        "",
        f"- checkpoint: `{checkpoint}` (step {step if step is not None else '?'})",
        f"- weights: {dtype}" + (", LoRA adapter" if adapter else ", LoRA merged" if recipe.lora else ""),
        f"- load: {load}",
        "",
    ]
    return "\n".join(lines + metrics_and_recipe(metrics, recipe.to_toml()))


def write_policy_folder(
    lm: Any,
    tokenizer: Any,
    peft_model: Any,
    to: Path,
    *,
    dtype: str,
    adapter: bool,
    base_folder: str | None,
    card: str,
    info: dict[str, Any],
    overwrite: bool,
    files: dict[str, str] | None = None,
) -> Path:
    """Write a causal LM to `to` as the module docstring says: merged (the adapters of `peft_model`, if
    any, folded in) or with `adapter` PEFT's adapter folder naming `base_folder`; the tokenizer, the
    model card, `info` as `checkpoint.json` and `files` (name -> text) beside it. hpref's one
    causal-LM export: offline DPO's policy and an rl policy (`hpref.save.rl_export`). Returns `to`."""
    import torch

    from hpref.models.adapters import ADAPTER
    from hpref.models.causal_lm import stop_token_ids
    from hpref.runfolder.files import fsync_tree, write_text_atomic
    from hpref.save.target import replace_folder

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{to.name}.", suffix=".part", dir=to.parent))
    try:
        if adapter:
            assert peft_model is not None
            peft_model.peft_config[ADAPTER].base_model_name_or_path = base_folder
            peft_model.to(torch_dtype)
            # "auto" would look the base up (on the Hub) to decide; the base embeddings never train
            peft_model.save_pretrained(str(tmp), safe_serialization=True, save_embedding_layers=False)
        else:
            if peft_model is not None:
                lm = peft_model.merge_and_unload()
            # plain `generate` (and vLLM) then stop where hpref's engines stop: at the tokenizer's
            # eos and every end-of-turn id of the generation config
            lm.generation_config.eos_token_id = stop_token_ids(tokenizer, lm)
            lm.to(torch_dtype)
            lm.config.dtype = torch_dtype
            lm.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_text_atomic(tmp / MODEL_CARD, card)
        for name, text in (files or {}).items():
            write_text_atomic(tmp / name, text)
        write_text_atomic(tmp / CHECKPOINT_JSON, json.dumps(info, indent=2) + "\n")
        fsync_tree(tmp)
        replace_folder(tmp, to, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return to


def export_policy(
    checkpoint_dir: Path, to: Path, recipe: Recipe, *, dtype: str, adapter: bool, overwrite: bool
) -> Path:
    """Write the DPO policy of `checkpoint_dir` to `to` (see the module docstring); returns `to`."""
    from hpref.models.causal_lm import policy_folder

    assert recipe.dpo is not None
    if adapter and recipe.lora is None:
        raise UserError(
            f"--adapter: {checkpoint_dir} is a full fine-tuning run (its recipe has no [lora] section); "
            "export it without --adapter"
        )
    if adapter and not recipe.dpo.model.pretrained:
        raise UserError(
            "--adapter: the policy is a tiny random-init model with no base folder for the adapter to name; "
            "export it merged (without --adapter)"
        )
    lm, tokenizer, peft_model = load_policy(checkpoint_dir, recipe)
    train_state = json.loads((checkpoint_dir / TRAIN_STATE).read_text(encoding="utf-8"))
    step = train_state.get("step")
    metrics = _eval_metrics(checkpoint_dir.resolve().parent.parent)
    info = {
        "checkpoint": str(checkpoint_dir),
        "step": step,
        "dtype": dtype,
        "kind": "dpo-policy",
        "max_length": recipe.train.max_length,
    }
    if recipe.lora is not None:
        info["lora"] = "adapter" if adapter else "merged"
    write_policy_folder(
        lm,
        tokenizer,
        peft_model,
        to,
        dtype=dtype,
        adapter=adapter,
        base_folder=policy_folder(recipe.dpo.model) if adapter else None,
        card=policy_card(recipe, checkpoint_dir, step, dtype, adapter, metrics),
        info=info,
        overwrite=overwrite,
        files={RECIPE: recipe.to_toml()},
    )
    logger.info(f"exported the DPO policy of {checkpoint_dir} (step {step}, {dtype}) to {to}")
    return to
