"""What `hpref train` would refuse, checked from the recipe before any process starts.

`load_recipe` validates what every command shares (keys, types, component parameters). Training
needs more: a model and training data, a `train.max_length` the model can hold, and settings this
machine can run. `check_train` is the one list of those checks: `hpref recipes check` runs it, and
`hpref train` runs it once, in the launcher, before it starts anything, so a recipe that passes the
check does not fail on them after the data and model are set up (`flash_varlen` on a machine
without CUDA used to fail in the first forward pass, exit 1).

Two kinds of check:
- about the recipe alone (the same answer on every machine): a `[model]` and `[dataset.train]`
  section, `train.max_length` within the model's positions where the model config states them;
- about this machine (`machine=True`): CUDA for `launch.backend = 'nccl'` and the CUDA-only
  attention kernels, the packages those kernels need, peft for `[lora]` and
  bitsandbytes for `lora.quantize_base = '4bit'`, `run.output_dir` not a file, and every
  dataset section buildable (its file there, readable, with the right columns). `hpref recipes
  check --portable` skips these, for a recipe written here for another machine (the GPU references).

An `hpref rl` recipe trains no judge: its checks are `hpref.rl.control.preflight.check_rl`.
"""

from __future__ import annotations

from pathlib import Path

from hpref.errors import RecipeError, UserError
from hpref.recipe import Recipe


def is_rl_recipe(recipe: Recipe) -> bool:
    """An `hpref rl` recipe: an `[rl]` section and no judge `[model]` to train."""
    return recipe.rl is not None and recipe.model is None


def check_train(recipe: Recipe, where: str | Path | None = None, *, machine: bool = True) -> None:
    """Raise `RecipeError` (one line: file, dotted key, what is wrong) for the first thing
    `hpref train` would refuse; `machine=False` leaves out what depends on this machine. An `hpref
    rl` recipe is not held to training (`hpref.rl.control.preflight.check_rl` checks it)."""
    where = str(where if where is not None else recipe._source or "recipe")
    if is_rl_recipe(recipe):
        return
    if recipe.dpo is not None:
        _check_dpo(recipe, where, machine=machine)
        if machine:
            _check_machine(recipe, where)
        return
    _check_recipe(recipe, where)
    if machine:
        _check_machine(recipe, where)


def _check_recipe(recipe: Recipe, where: str) -> None:
    if recipe.model is None:
        raise RecipeError(
            f"{where}: model: the recipe has no [model] section, and training needs one "
            "(see 'hpref components model')"
        )
    if recipe.dataset.train is None:
        raise RecipeError(
            f"{where}: dataset.train: the recipe has no [dataset.train] section, and training needs one "
            "(see 'hpref components dataset')"
        )
    _check_head(recipe, where)
    # Only where the model's own config states its positions; a pretrained backbone's comes from its
    # folder, which the worker reads (and checks) when it builds the model.
    positions = getattr(recipe.model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and recipe.train.max_length > positions:
        raise RecipeError(
            f"{where}: train.max_length: {recipe.train.max_length} exceeds the model's "
            f"{positions} positions (model.max_position_embeddings)"
        )


def _check_dpo(recipe: Recipe, where: str, *, machine: bool) -> None:
    """A DPO recipe (`[dpo]`) trains the causal LM of `dpo.model`: no judge `[model]` beside it, no
    `[rl]`, training pairs, a LoRA it can take, and (on this machine) a policy folder that holds a
    causal LM with a chat template (`hpref.models.causal_lm.causal_lm_problem`)."""
    assert recipe.dpo is not None
    if recipe.model is not None:
        raise RecipeError(
            f"{where}: model: a DPO recipe trains the causal LM of [dpo] model, and [model] "
            f"('{recipe.model.name}') is a preference model (a sequence classifier or judge); remove "
            "[model], or [dpo] to train that model instead"
        )
    if recipe.rl is not None:
        raise RecipeError(
            f"{where}: rl: [dpo] (offline DPO, hpref train) and [rl] (hpref rl) are two commands' recipes"
        )
    if recipe.dataset.train is None:
        raise RecipeError(f"{where}: dataset.train: a DPO recipe needs pairs to train on ([dataset.train])")
    model = recipe.dpo.model
    if recipe.lora is not None and recipe.lora.quantize_base != "none":
        raise RecipeError(
            f"{where}: lora.quantize_base: '{recipe.lora.quantize_base}' (QLoRA) is not supported for a DPO "
            'policy; set lora.quantize_base = "none"'
        )
    if not model.pretrained and recipe.train.max_length > model.max_position_embeddings:
        raise RecipeError(
            f"{where}: train.max_length: {recipe.train.max_length} exceeds the policy's "
            f"{model.max_position_embeddings} positions (dpo.model.max_position_embeddings)"
        )
    if machine and model.pretrained:
        from hpref.models.causal_lm import causal_lm_problem, policy_folder

        key = f"{where}: dpo.model.{'name' if model.name else 'path'}"
        try:
            folder = policy_folder(model)
        except UserError as exc:
            raise RecipeError(f"{key}: {exc}") from None
        reason = causal_lm_problem(folder)
        if reason:
            raise RecipeError(f"{key}: {folder}: {reason}")


def _check_head(recipe: Recipe, where: str) -> None:
    """A reward model reads two sequences per battle (the `answers` formatter) and is symmetric in
    A and B by construction, so swap augmentation would only double its compute."""
    assert recipe.model is not None
    reward = getattr(recipe.model.config, "head", "judge") == "reward"
    answers = recipe.formatter.name == "answers"
    if reward and not answers:
        raise RecipeError(
            f"{where}: formatter.name: a reward model (model.head = 'reward') scores each answer with "
            f"its conversation; set formatter.name = \"answers\", not '{recipe.formatter.name}'"
        )
    if answers and not reward:
        raise RecipeError(
            f"{where}: formatter.name: 'answers' makes two sequences per battle for a reward model; "
            'set model.head = "reward" or use a judge formatter (pab, papb)'
        )
    if reward and recipe.train.swap != "none":
        raise RecipeError(
            f"{where}: train.swap: a reward model scores A and B alone, so the B/A view is the A/B "
            f"view mirrored and swap = '{recipe.train.swap}' only doubles the compute; "
            'set train.swap = "none"'
        )


def _check_machine(recipe: Recipe, where: str) -> None:
    backend = recipe.launch.backend
    attention = getattr(recipe.model.config, "attention", "auto") if recipe.model is not None else "auto"
    needs_torch = backend == "nccl" or attention not in ("auto", "sdpa_segments", "sdpa_block_mask")
    if needs_torch:  # torch is imported only for the settings that ask about CUDA
        _check_cuda(recipe, where, attention)
    if recipe.lora is not None:
        _check_lora_machine(recipe, where)
    output_dir = recipe.run.output_dir.expanduser()
    for folder, key in ((output_dir, "run.output_dir"), (recipe.run.run_dir.expanduser(), "run.name")):
        if folder.exists() and not folder.is_dir():
            raise RecipeError(f"{where}: {key}: {folder} is a file, and the run folder must be a folder")
    _check_datasets(recipe, where)


def _check_cuda(recipe: Recipe, where: str, attention: str) -> None:
    import torch

    from hpref.models.attention import backend_problem

    cuda = torch.cuda.is_available()
    if recipe.launch.backend == "nccl" and not cuda:
        raise RecipeError(
            f"{where}: launch.backend: 'nccl' needs CUDA GPUs, and none is visible here "
            "(use 'auto'; or check with --portable a recipe meant for another machine)"
        )
    # The worker's device rule: CUDA unless the recipe asks for gloo.
    on_cuda = cuda and recipe.launch.backend != "gloo"
    device_type = "cuda" if on_cuda else "cpu"
    dtype = torch.float32
    if on_cuda:
        from hpref.models.precision import resolve_precision

        dtype = resolve_precision(recipe.train.precision, torch.device("cuda"))
    problem = backend_problem(attention, device_type=device_type, dtype=dtype)
    if problem is None:
        return
    if device_type == "cpu":
        problem += " (no CUDA GPU is visible)" if not cuda else " (launch.backend = 'gloo' runs on CPU)"
    raise RecipeError(f"{where}: model.attention: '{attention}' {problem}")


def _check_lora_machine(recipe: Recipe, where: str) -> None:
    """peft installed; bitsandbytes too for QLoRA's 4-bit base (it runs on CUDA and on CPU)."""
    import importlib.util

    assert recipe.lora is not None
    if importlib.util.find_spec("peft") is None:
        raise RecipeError(f"{where}: lora: LoRA adapters need the peft package: pip install 'hpref[lora]'")
    if recipe.lora.quantize_base != "none":
        from hpref.models.quantize import bitsandbytes_problem

        problem = bitsandbytes_problem(recipe.lora.quantize_base)
        if problem is not None:
            raise RecipeError(f"{where}: lora.quantize_base: {problem}")


def _check_datasets(recipe: Recipe, where: str) -> None:
    """Build each dataset source as the worker does: a reader opens its file and header here, so a
    missing file, a wrong encoding or a missing column is refused now, not after launch."""
    from hpref.plugins import load_plugins

    registry = load_plugins()
    for split in ("train", "eval"):
        section = getattr(recipe.dataset, split)
        if section is None:
            continue
        try:
            registry.get("dataset", section.name).build(section.config, recipe.run.seed)
        except UserError as exc:
            raise RecipeError(f"{where}: dataset.{split}: {exc}") from None
