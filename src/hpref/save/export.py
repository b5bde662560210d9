"""`hpref save`'s export: a training checkpoint -> a self-contained HF-style folder.

Consolidation. The trainer writes DCP checkpoints (`hpref.train.checkpoint`): tensors sharded as
they were trained, under `model.*` and `optim.*`. `save` rebuilds the model from the run's resolved
`recipe.toml` on one CPU process, loads only the `model.*` tensors into it (DCP reshards any world
size into one; `hpref.runtime.checkpoint`, the loader `hpref eval` uses too), and writes
`PreferenceModel.save_pretrained`'s folder plus a README model card.

Safe loading, never half-loaded. Finding and checking the checkpoint is the run folder's job
(`hpref.runfolder.checkpoints`: `resolve_checkpoint`, and `validate_checkpoint`, which checks the
recorded checksums, reads the DCP index through the one restricted reader of
`hpref.runfolder.safe_load` and checks that it holds every model key with the right shape); only
then is anything loaded, into a fresh state dict, and copied into the model in one
`load_state_dict`.

`save --now` (ask a live run for a checkpoint first) is `hpref.runfolder.save_trigger`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

from loguru import logger

from hpref.errors import UserError
from hpref.exports.layout import CHECKPOINT_JSON, MODEL_CARD
from hpref.runfolder.checkpoints import is_rl_run, is_rl_save, resolve_checkpoint
from hpref.runfolder.layout import METRICS, RECIPE, SUMMARY
from hpref.runfolder.safe_load import CheckpointError  # noqa: F401  (callers catch it from here)
from hpref.runtime.checkpoint import load_model_from_checkpoint, recipe_of_run
from hpref.save.card import metrics_and_recipe
from hpref.save.target import check_export_overlap, check_export_target, replace_folder

Dtype = Literal["fp32", "bf16"]


# --------------------------------------------------------------------------------------------------
# the export


def _run_metrics(run_dir: Path, step: int | None) -> dict[str, Any]:
    """The run's eval numbers for the model card: summary.json, else the last eval at or before step."""
    out: dict[str, Any] = {}
    summary = run_dir / SUMMARY
    if summary.is_file():
        data = json.loads(summary.read_text())
        if step is None or data.get("eval_step") == step:
            for key in ("eval_log_loss", "eval_accuracy", "gap_closed", "eval_step"):
                if key in data:
                    out[key] = data[key]
    metrics = run_dir / METRICS
    if not out and metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("kind") == "eval" and (step is None or record.get("step", 0) <= step):
                out = {k: record[k] for k in ("eval_log_loss", "eval_accuracy", "step") if k in record}
    return out


def reward_export_targets(pooling: str) -> str:
    """What loads a reward model's export, by its pooling: the model card's line, and `hpref save`'s.

    Each tool pools one way, and only a matching pooling scores as hpref trained: transformers'
    sequence classifier (TRL's `RewardTrainer` loads that class) reads a decoder's last non-pad token,
    or BERT's CLS token through its pooler; OpenRLHF (`get_llm_for_sequence_regression`) reads the
    last non-pad token's hidden state through a bias-free linear named by `value_head_prefix`
    ("score"), so it fits a decoder's export and not an encoder's (no pooler, no classifier bias);
    sentence-transformers mean-pools (`hpref.exports.sentence_transformers`)."""
    if pooling == "last":
        return (
            "`AutoModelForSequenceClassification` (one label), so TRL's `RewardTrainer` and OpenRLHF's "
            "`get_llm_for_sequence_regression` (value head `score`, the last non-pad token) load it "
            "and give hpref's scores"
        )
    if pooling == "first":
        return (
            "`AutoModelForSequenceClassification` (one label: BERT's CLS pooler and `classifier`), so "
            "TRL's `RewardTrainer` loads it and gives hpref's scores; not OpenRLHF, which scores the "
            "last token's hidden state with a bias-free head (no pooler): its scores would differ"
        )
    return (
        "sentence-transformers (`SentenceTransformer(folder).encode(texts)`: stock Transformer, mean "
        "Pooling and Dense modules, remote code off) and hpref; not TRL or OpenRLHF: no transformers "
        "class mean-pools this backbone, and `AutoModelForSequenceClassification` would put a new, "
        "random head on it"
    )


def model_card(
    *,
    recipe_toml: str,
    checkpoint: Path,
    step: int | None,
    dtype: str,
    metrics: dict[str, Any],
    reward: bool = False,
    sequence_classifier: bool = True,
    adapter: bool = False,
    pooling: str = "last",
) -> str:
    files = (
        "- files: `config.json` + `model.safetensors` (a transformers sequence classifier with one "
        "label: `AutoModelForSequenceClassification.from_pretrained(folder)` gives each answer's "
        "reward), tokenizer files, `head.safetensors` and `hpref_model.json` (the tie parameter "
        "`tie_log_nu` of Davidson's model, pooling)"
        if reward and sequence_classifier
        else "- files: `config.json` + `model.safetensors` (the backbone, loadable with "
        "`transformers.AutoModel.from_pretrained`), tokenizer files, `head.safetensors` (the reward "
        "`score` linear and Davidson's tie parameter), `hpref_model.json` (pooling = mean), and "
        "sentence-transformers' `modules.json`, `1_Pooling/`, `2_Dense/` (the same mean and `score`)"
        if reward
        else "- files: `config.json` + `model.safetensors` (the backbone, loadable with "
        "`transformers.AutoModel.from_pretrained`), tokenizer files, `head.safetensors` (the "
        "classification head), `hpref_model.json` (labels, pooling, head settings)"
    )
    if reward and not adapter:
        files += f"\n- pooling `{pooling}`: other tools: {reward_export_targets(pooling)}"
    if adapter:
        files = (
            "- files: `adapter_config.json` + `adapter_model.safetensors` (a PEFT LoRA adapter for the "
            "base backbone named in `hpref_adapter.json`: `peft.PeftModel.from_pretrained(AutoModel."
            "from_pretrained(base), folder)`), tokenizer files, `head.safetensors` (hpref's head) and "
            "`hpref_adapter.json` (the base model, head settings)"
        )
    what = (
        "Scores one assistant answer with its conversation (a scalar reward); two scores give P(A wins), "
        "P(B wins), P(tie) by Davidson's model."
        if reward
        else "Predicts P(A wins), P(B wins), P(tie) for two assistant answers to one conversation."
    )
    lines = [
        "---",
        "library_name: hpref",
        "tags: [preference-model, reward-model, lmsys-arena]",
        "---",
        "",
        "# hpref preference model",
        "",
        what,
        "",
        f"- checkpoint: `{checkpoint}` (step {step if step is not None else '?'})",
        f"- weights: {dtype}",
        files,
        "- load: `hpref eval RECIPE --checkpoint folder`, or in Python "
        + (
            "`hpref.evaluate.adapter_export.load_adapter_export(folder)`"
            if adapter
            else "`hpref.models.PreferenceModel.from_pretrained(folder)`"
        ),
        "",
    ]
    return "\n".join(lines + metrics_and_recipe(metrics, recipe_toml))


def save_export(
    source: str | Path,
    to: str | Path,
    *,
    step: str | int | None = "latest",
    dtype: Dtype = "fp32",
    recipe_path: str | Path | None = None,
    overwrite: bool = False,
    adapter: bool = False,
    policy: str | None = None,
) -> Path:
    """Consolidate a checkpoint into `to` (written beside it under a temporary name, fsynced, then
    renamed: a folder named `to` is always complete). Returns `to`.

    An `hpref rl` run (or one of its saves) exports its policy `policy` as a causal-LM folder
    (`hpref.save.rl_export`; `step`: latest, rollout-N or N), and only with `policy`.

    A LoRA run (`[lora]` in its recipe) is exported merged (PEFT's `merge_and_unload`: the same
    transformers folder as a fully fine-tuned model), or with `adapter` as PEFT's adapter folder
    beside hpref's head (`hpref.models.adapters.save_adapter`). A QLoRA run merges into the
    full-precision base it was quantised from: its predictions differ from the 4-bit model's by the
    quantisation error of the base.

    `to` may be new, empty, or (with `overwrite`) an earlier export, and must not overlap the run or
    checkpoint it comes from. Every failure leaves the parent folder as it was (no temporary folder).
    """
    import tempfile

    import torch

    from hpref.runfolder.files import fsync_tree, write_text_atomic

    if dtype not in ("fp32", "bf16"):
        raise UserError(f"--dtype {dtype!r}: expected bf16 or fp32")
    to = Path(os.path.abspath(to))  # `..` resolved by name: a symlink named `to` stays a link
    check_export_target(to, overwrite)
    if policy is not None or is_rl_run(Path(source)) or is_rl_save(Path(source)):
        from hpref.save.rl_export import export_rl_policy

        if recipe_path is not None:
            raise UserError(
                "--recipe: an rl policy exports from its save and the run's rl.json; drop --recipe"
            )
        return export_rl_policy(
            Path(source), to, policy=policy, step=step, dtype=dtype, adapter=adapter, overwrite=overwrite
        )
    checkpoint_dir = resolve_checkpoint(source, step)
    check_export_overlap(to, checkpoint_dir)
    recipe = recipe_of_run(checkpoint_dir, recipe_path)
    if recipe.dpo is not None:  # an offline DPO run: its policy, as a causal-LM folder
        from hpref.save.policy_export import export_policy

        return export_policy(checkpoint_dir, to, recipe, dtype=dtype, adapter=adapter, overwrite=overwrite)
    if adapter and recipe.lora is None:
        raise UserError(
            f"--adapter: {checkpoint_dir} is a full fine-tuning run (its recipe has no [lora] section); "
            "export it without --adapter"
        )
    # merged, a QLoRA run's adapters fold into the full-precision base (the standard QLoRA export:
    # a plain transformers folder), not into its 4-bit copy, which would stay bitsandbytes-packed
    loaded = load_model_from_checkpoint(checkpoint_dir, recipe, quantize=adapter)
    model = loaded.model
    from hpref.models import adapters

    if not adapter:
        adapters.merge_lora(model)  # a no-op without LoRA
    state = model.state_dict()
    if dtype == "bf16":
        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
        if hasattr(model.backbone_config, "dtype"):
            model.backbone_config.dtype = torch.bfloat16
    to.parent.mkdir(parents=True, exist_ok=True)
    # A unique name: a fixed `.tmp-NAME` would delete a user's folder of that name.
    tmp = Path(tempfile.mkdtemp(prefix=f".{to.name}.", suffix=".part", dir=to.parent))
    try:
        if adapter:
            adapters.save_adapter(
                model,
                tmp,
                base=adapters.base_pointer(recipe),
                dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
            )
        else:
            model.save_pretrained(tmp, state_dict=state)
        run_step = loaded.train_state.get("step")
        run_dir = checkpoint_dir.resolve().parent.parent
        card = model_card(
            recipe_toml=recipe.to_toml(),
            checkpoint=checkpoint_dir,
            step=run_step,
            dtype=dtype,
            metrics=_run_metrics(run_dir, run_step),
            reward=model.head_kind == "reward",
            sequence_classifier=model.exports_sequence_classifier,
            adapter=adapter,
            pooling=model.pooling,
        )
        write_text_atomic(tmp / MODEL_CARD, card)
        write_text_atomic(tmp / RECIPE, recipe.to_toml())
        info = {
            "checkpoint": str(checkpoint_dir),
            "step": run_step,
            "dtype": dtype,
            "formatter": recipe.formatter.name,
            "max_length": recipe.train.max_length,
            "labels": ["winner_model_a", "winner_model_b", "winner_tie"],
        }
        if recipe.lora is not None:
            info["lora"] = "adapter" if adapter else "merged"
        write_text_atomic(tmp / CHECKPOINT_JSON, json.dumps(info, indent=2) + "\n")
        fsync_tree(tmp)
        replace_folder(tmp, to, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(f"exported {checkpoint_dir} (step {run_step}, {dtype}) to {to}")
    if model.head_kind == "reward" and not adapter:
        logger.info(
            f"a reward model pooled by '{model.pooling}' loads in {reward_export_targets(model.pooling)}"
        )
    return to
