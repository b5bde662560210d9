"""The plugin contract: every hook a plugin (built-in or third-party) may implement.

Components are registered through a callback rather than returned, so one hook implementation can
register any number of them and errors point at the exact `register(...)` call:

    from hpref.hookspecs import hookimpl

    @hookimpl
    def register_schedulers(register):
        register(name="step-decay", config=StepDecayConfig, build=build_step_decay)

`register(name, config, build, description=None)`:
    name        the component's name as recipes spell it (`[scheduler] name = "step-decay"`)
    config      a pydantic model class: the component's parameters, with defaults and descriptions.
                Recipe keys beside `name` are validated against it (unknown keys are an error).
    build       a callable taking the validated config instance (plus keyword arguments documented
                per kind below) and returning the component. It is only called when a run needs it,
                so heavy imports (torch, transformers) belong inside it, not at module level.
    description one line for `hpref components`; defaults to the first line of build's docstring.

Third-party packages expose their hook implementations through the `hpref` entry-point group:

    [project.entry-points.hpref]
    my_plugin = "my_package.hpref_plugin"
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("hpref")
hookimpl = pluggy.HookimplMarker("hpref")


@hookspec
def register_model_families(register) -> None:
    """Register model families: `register(spec)` with one `hpref.families.ModelFamilySpec` each.

    A spec lists its `[model]` components (`ModelBuilder(name, config, build)`, `build` as in
    `register_models` below) and says how its models are parallelised (`parallelize`; None: hpref's
    FSDP2), what they do themselves (`capabilities`: `hpref.protocols` Protocols such as
    `ReducesOwnGradients`, `ViewsCheckpoint`, `LoadsPlainState`) and what the family supports
    (`FamilySupport`: LoRA, head kinds, poolings, the sequence-classifier export, parallelisms).
    The built-in families (`transformers` in `hpref.builtin.models`, `megatron-core` in
    `hpref.builtin.megatron`) register through this hook. A model's built object has the attributes
    of `hpref.protocols.PreferenceModel` (`head_kind`, `paired`, `pooling`, `fresh_head`, ...).
    """


@hookspec
def register_models(register) -> None:
    """Register model components (`[model]`), each in a family of its own with the default
    `hpref.families.ModelFamilySpec` (FSDP2, LoRA, every head kind); `register_model_families`
    declares more. A model built here that lacks one of `PreferenceModel`'s judge attributes
    (`head_kind`, `paired`, `pooling`, `fresh_head`, ...) is given the judge's value.

    `build(config, *, num_labels=3, device="cpu", meta=False)` returns a
    `hpref.models.PreferenceModel` (or an `nn.Module` with the same members):

    - `forward(input_ids [T], cu_seqlens int32 [n+1], position_ids [T], *, max_seqlen=None)
      -> logits float32 [n, num_labels]` for one packed, padding-free micro-batch (positions restart
      at 0 per sequence);
    - `blocks()`: the transformer blocks, for `fully_shard` and activation checkpointing;
    - `tokenizer`, `backbone_config`, `max_position_embeddings`, `flops_per_token(seq_len)`;
    - `meta=True` allocates nothing; after sharding, `load_pretrained_weights(device=...,
      broadcast_from_rank0=...)` fills the weights (`pretrained_state_dict()` is the full CPU dict);
    - `save_pretrained(folder, state_dict=None)` writes an HF-style folder that
      `PreferenceModel.from_pretrained(folder)` reads back. State-dict keys: `backbone.<HF key>`, `head.*`.
    """


@hookspec
def register_datasets(register) -> None:
    """Register dataset components (`[dataset.train]`, `[dataset.eval]`).

    `build(config, seed)` returns a source of battles (built-ins: `hpref.data.base.BattleSource`):
      battles() -> Iterator[hpref.data.Battle]   streams the selected battles, in a fixed order
      summary                                    rows read / used / skipped (reason -> count) / in
                                                 other folds; complete once battles() is exhausted
      fingerprint() -> str (optional)            identity of the stream (data bytes + settings); the
                                                 token cache keys on it and skips sources without one
    `seed` is the run seed (built-ins use it for the pairwise A/B coin and as the synthetic arena's
    generator seed when the recipe sets none; never for the folds, so every run sees one eval fold).
    Subclass `hpref.data.base.DatasetConfig` for the shared `on_error`, `folds` / `fold` / `split`
    (grouped by prompt, stratified by label), `limit` and `split_seed` parameters.
    """


@hookspec
def register_schedulers(register) -> None:
    """Register learning-rate schedulers (`[scheduler]`).

    `build(config, total_steps)` returns `multiplier(step: int) -> float`, the factor applied to
    the optimizer's base learning rate at optimizer step `step` (0-based) of `total_steps`.
    """


@hookspec
def register_optimizers(register) -> None:
    """Register optimizers (`[optimizer]`, default `adamw`).

    `build(config, model)` returns a `torch.optim.Optimizer` (see `hpref.protocols.Optimizer`) over
    `model`'s trainable parameters (`requires_grad`: with LoRA only the adapters, the head and what
    else trains). It is called after sharding, so the parameters are FSDP2 DTensor shards, and its
    param groups' `lr` are the base rates the `[scheduler]` multiplies. Its `state_dict()` goes into
    every checkpoint and `load_state_dict()` restores it on resume. Example: a Kahan-summation AdamW
    for pure-bf16 weights; `hpref.builtin.optimizers.param_groups` gives the built-in grouping (head
    learning rate, no decay on biases and norms).
    """


@hookspec
def register_formatters(register) -> None:
    """Register prompt formatters (`[formatter]`).

    `build(config, tokenizer, max_length)` returns an object with `encode(battle) -> list[int]`: one
    view of the battle, at most `max_length` ids, ending where a judge would give its verdict (the
    last token is classified). Callers encode `battle.swapped()` for the swapped view. `tokenizer` is
    a Hugging Face fast tokenizer. Optional, used when present: `encode_many(battles)` returning
    objects with `ids`, `truncated`, `full_length` (batched tokenization, truncation statistics) and
    `fingerprint() -> str` (the token cache key). A formatter for a reward model sets `paired = True`
    and returns `split` too: ids[:split] and ids[split:] are two sequences (A's and B's). See
    `hpref.data.formatting.JudgeFormatter` and `AnswersFormatter`.
    """


@hookspec
def register_prompts(register) -> None:
    """Register prompt sources for `hpref rl` (`[rl.prompts]`).

    `build(config)` returns an object with `train_prompts(seed, first, count)` (prompt i of the
    stream depends only on (seed, i): every policy answers the same prompts at a rollout, and a
    resume replays nothing), `eval_prompts(seed, count)` (held out from training), `source` (a name
    for messages) and `ground_truth` (True only when a reward's `true_utility` means something for
    these prompts). A prompt is a tuple of turns: user, assistant, ..., user. See
    `hpref.rl.protocols.PromptSource` and `hpref.builtin.prompts`.
    """


@hookspec
def register_rewards(register) -> None:
    """Register reward components for `hpref rl` (`[rl.reward]`, or each of `[rl.rewards.<name>]`).

    `build(config)` returns an object with
    `score_groups(prompts, groups, opponents=None) -> list[list[float]]`: `groups[i]` are one
    policy's answers to `prompts[i]` (a GRPO group), the result has the same shape. A reward that
    sets `wants_opponents = True` also gets `opponents[i]`, other policies' answers to the same
    prompt, to judge against (cross-policy judging). Optional: `true_utility(prompt, answer)` when
    the reward knows the ground truth (synthetic arena), for the metrics that reveal reward hacking,
    and `pairwise = True` when a group's scores are win probabilities against each other rather than
    one score per answer (evals then compare a policy's answer with its start's directly instead of
    reading two scores as a Bradley-Terry preference; `hpref.rl.rollout.evaluation.scorer_report`). A prompt
    is a tuple of turns: user, assistant, ..., user. The same components serve as `[rl.eval_scorer]`.
    A reward that sets `wants_rows = True` is also given `rows=` (`rows[i]`: the prompt file's row
    of `prompts[i]`, its columns beside the conversation's: a reference answer, a label).
    A reward online DPO can train on also has `judge_answers(prompts, pairs)` -> one (P(first),
    P(second), P(tie)) per answer pair (`hpref.rl.protocols.PairJudge`) and says so with the class
    attribute `judges_pairs = True` on its config, which `hpref rl` checks before any actor starts.
    """


@hookspec
def register_engines(register) -> None:
    """Register inference engines for `hpref rl` (`[rl.engine]`):
    `register(name=..., config=..., build=...)`.

    `config` is a pydantic class that inherits `hpref.rl.protocols.EngineConfigBase`, so it has
    every attribute of the `hpref.rl.protocols.EngineConfig` protocol (the Ray resources of the
    engine's actor, the dtype the plan counts, whether it serves a shared base's adapters, the
    sampling knobs it takes, its checks before any actor starts) with a default, and overrides
    those it has. `build(config, *, policy, model, env)` (and `adapters=` on a shared base) runs
    inside the engine's Ray actor and returns an `hpref.rl.protocols.Engine`: `generate` and
    `generate_batch` answer with `hpref.rl.rollout_types.Generation`s, `generate_batch` takes
    `GenerationRequest`s, and the weight-update steps, the weight channel and sleep / wake are as
    that protocol says. `model` is the policy's `hpref.recipe.rl.PolicyModelConfig` (its `path` is
    a transformers folder, e.g. the warm-up checkpoint); `env` holds cache/offline variables to apply.
    """


@hookspec
def register_algorithms(register) -> None:
    """Register RL algorithms for `hpref rl` (a policy's `algorithm = "<name>"`, or a table with the
    name and the config's parameters).

    `build(config, policy)` (`policy`: the policy's `hpref.recipe.rl.PolicyConfig`) runs in the
    policy's trainer and in the rollout executor and returns an `hpref.rl.protocols.Algorithm`: what
    its rollouts must carry (a reward per answer; with `needs_preferences`, a three-way verdict per
    answer pair from the reward's `judge_answers`), which rows a step trains on and with what
    per-row values (`prepare`), and the loss and metric sums of one micro-batch (`loss`,
    `summarise`). Built-ins: `grpo` (`hpref.rl.algorithms.grpo`) and `online-dpo`
    (`hpref.rl.algorithms.online_dpo`);
    `plugins/hpref-example` adds one from outside hpref.
    """


@hookspec
def register_environments(register) -> None:
    """Register RL environments for `hpref rl` (`[rl.environment] name = "<name>"`, its parameters
    beside the name).

    `build(config)` runs in the rollout executor and returns an `hpref.rl.protocols.Environment`:
    `start(prompt, row, seed)` begins an `Episode`, which says which role acts next, takes that
    role's turn (its text and tokens) and answers with the next observation or the end, and gives
    each role's reward at the end (or leaves the scoring to the run's rewards). With several roles,
    several policies play each episode (`[rl.environment] roles`); optional capabilities, asked with
    `isinstance`: `OpensPerRole` (each role starts from a conversation of its own), `JudgedInPairs`
    (two roles' last answers judged as a pair by the run's rewards) and `SharedTurn` (one role's first
    turn shared by a start's episodes). Built-ins: `single-turn` (the default: one prompt, one
    answer), `tool` (the policy calls tools written in its answer), `signal`, `debate` and
    `propose-solve` (`hpref.rl.environments`); `plugins/hpref-example` adds one from outside hpref.
    """


@hookspec
def register_tools(register) -> None:
    """Register tools for the `tool` RL environment (`[rl.environment] name = "tool"`, `tools =
    ["<name>", ...]`).

    `build(config)` (the config's defaults: a recipe names a tool, it gives it no parameters) runs
    in the rollout executor when the environment is built and returns an `hpref.rl.protocols.Tool`:
    its `name` (the one registered), a one-line `description`, the `argument` the short call form
    `<name>...</name>` passes, and `run(arguments) -> str`, which raises `ValueError` with a message
    the policy reads for wrong arguments. It runs on a worker thread under the environment's
    `time_limit_s`, which stops the waiting, not the tool: a tool bounds its own work. Built-in:
    `calculator` (`hpref.rl.environments.calculator`).
    """


@hookspec
def register_trainer_backends(register) -> None:
    """Register what an `hpref rl` trainer runs a policy on (a policy's `trainer_backend`).

    `build(config)` returns an `hpref.rl.protocols.TrainerBackend`: the causal LM it trains, how a
    trainer group shards it and splits the data, and its weights in the transformers layout for the
    engines and saves. Built-ins: `transformers` and `megatron` (`hpref.rl.trainer.backends`).
    """


@hookspec
def register_loggers(register) -> None:
    """Register metric loggers (`[logging] loggers = ["<name>"]`, `--log <name>` on `hpref train` and
    `hpref rl`; a logger's parameters in `[logging.<name>]`).

    `build(config, run)` runs on rank 0 / the leader only (`run`: `hpref.builtin.loggers.RunInfo`:
    `run_dir`, `resume_step` (None for a fresh run; a resumed run must not show the steps after it
    twice), `config` (the resolved recipe and hpref version), `name`) and returns an object with
    `log(values, step, axis)` (`values`: stable name -> float, e.g. `train/loss`, `<policy>/reward_mean`;
    `axis`: the group's step name, `train/step` or `<policy>/rollout`) and `close()`. A config class
    may define `check(run_dir)`, called before the run starts, raising `hpref.errors.UserError` for
    what would fail later (a package not installed, a folder not writable). Built-ins: `jsonl`,
    `tensorboard`, `wandb` (`hpref.builtin.loggers`).
    """


@hookspec
def register_commands(app) -> None:
    """Add subcommands to the `hpref` Typer app (`@app.command()` or `app.add_typer(...)`).

    Keep imports inside the command functions: `hpref --help` loads every plugin.
    """
