"""The seams of `hpref rl` as `typing.Protocol`s: what a reward, an engine, an algorithm, an
environment and a trainer backend must be. A plugin's `register_*` hook (`hpref.hookspecs`) registers
a `build` that returns such an object; the rollout executor and the actors call nothing else. They
are runtime-checkable: tests/rl/test_protocols.py checks the built-ins, a plugin author theirs, with
`isinstance(obj, Engine)`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from hpref.recipe.rl import PolicyModelConfig, RLConfig
    from hpref.rl.rollout_types import (
        Generation,
        GenerationRequest,
        Rollout,
        Step,
        TrainingRows,
        Turn,
        Verdict,
    )

Prompt = tuple[str, ...]  # one conversation's turns: user, assistant, ..., user (the one to answer)


@runtime_checkable
class PromptSource(Protocol):
    """Where a run's prompts come from (`[rl.prompts]`)."""

    #: a name for messages (the file, or "synthetic arena")
    source: str
    #: True only when the reward's `true_utility` is defined for these prompts (the synthetic arena)
    ground_truth: bool

    def train_prompts(self, seed: int, first: int, count: int) -> list[Prompt]:
        """Prompts `first .. first + count - 1` of the training stream of `seed`; prompt i depends
        only on (seed, i)."""
        ...

    def eval_prompts(self, seed: int, count: int) -> list[Prompt]:
        """`count` fixed prompts, never among the training ones."""
        ...

    # Optional, for rewards that read the prompt's row (`rule`'s `function(prompt, answer, row)`): `columns:
    # tuple[str, ...]` and `row(prompt) -> dict`; without them an empty row, a reward's `columns` refused.


@runtime_checkable
class Reward(Protocol):
    """Scores GRPO groups of answers (`[rl.reward]`, or each of `[rl.rewards.<name>]`:
    `hpref.rl.rollout.rewards` sums them). A reward with `wants_rows = True` is also given
    `score_groups(..., rows=...)` (and `judge_answers(..., rows=...)`): `rows[i]`, the prompt file's
    row of `prompts[i]` (`PromptSource.row`)."""

    #: True when `score_groups` wants `opponents` (other policies' answers to the same prompts)
    wants_opponents: bool
    #: how many answers per prompt each other policy lends as opponents
    opponent_answers: int

    def score_groups(
        self,
        prompts: Sequence[Prompt],
        groups: Sequence[Sequence[str]],
        opponents: Sequence[Sequence[str]] | None = None,
    ) -> list[list[float]]:
        """One reward per answer: `groups[i]` are one policy's answers to `prompts[i]`; the result
        has the same shape. `opponents[i]`, when wanted, are the other policies' answers to it."""
        ...


@runtime_checkable
class PairJudge(Reward, Protocol):
    """A reward that also gives the three-way verdict on answer pairs, what online DPO trains on."""

    def judge_answers(self, prompts: Sequence[Prompt], pairs: Sequence[tuple[str, str]]) -> list[Verdict]:
        """(P(first preferred), P(second preferred), P(tie)) of each pair of answers to `prompts[i]`:
        a tie is a tie, and a judge reads both orders and averages them (no position bias)."""
        ...


@runtime_checkable
class Algorithm(Protocol):
    """How a policy learns from its rollouts (a policy's `algorithm`; `register_algorithms`). The
    executor builds one per policy to learn what its rollouts must carry; the trainer calls `prepare`
    once per rollout, `loss` on every micro-batch of every pass (it runs the forward and backward
    passes, clipping, the optimizer and the reductions over ranks), then `summarise` on the sums."""

    #: the registered name
    name: str
    #: the executor judges answer pairs (`PairJudge.judge_answers`) into `Rollout.pairs` / `verdicts`
    needs_preferences: bool
    #: the pairs are the policy's answers against other policies' answers to the same prompts
    cross_policy: bool

    def check(self, policy: str, config: RLConfig, policies: list[str], where: str) -> None:
        """Before any actor starts: one `RecipeError` line for a setting this algorithm cannot run
        with (the rollout's group size, the policies that run: `policies`)."""
        ...

    def wants_reference(self) -> bool:
        """Whether a step needs the starting policy's log-probs (`batch["ref"]`)."""
        ...

    def prepare(self, rollout: Rollout, tokenizer: PreTrainedTokenizerBase) -> TrainingRows:
        """The rows a step trains on and the per-row values its loss reads."""
        ...

    def loss(
        self, logprobs: torch.Tensor, batch: dict[str, Any], rows: list[int], prepared: TrainingRows
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch: `logprobs [B, T]` of `rows` (indices into `prepared`'s rows, whole groups),
        `batch["mask"]` (1 on answer tokens), `batch["ref"]` (when wanted), `batch["old"]` (the engine's,
        when `prepared.behaviour` is set). Returns its share of the step's loss (back-propagated as is:
        the micro-batches add up to the one-batch loss) and statistics as sums (over micro-batches, ranks)."""
        ...

    def summarise(self, sums: dict[str, float]) -> dict[str, float]:
        """The metrics of a step from the summed statistics of its micro-batches (over every rank)."""
        ...


@runtime_checkable
class PreparesBatches(Protocol):
    """An algorithm capability, optional (the trainer asks `isinstance`): values its loss reads that
    depend on the whole step and on the reference, such as REINFORCE++'s per-token returns normalised
    over every micro-batch of every rank (`hpref.rl.algorithms.grpo`)."""

    def prepare_batches(
        self,
        batches: list[dict[str, Any]],
        prepared: TrainingRows,
        reduce: Callable[[dict[str, float], dict[str, float]], tuple[dict[str, float], dict[str, float]]],
    ) -> None:
        """Once per rollout, after the trainer built this rank's micro-batches (`mask`, `rows`, and
        `old` / `ref` as `loss` gets them; a group's `padding` ones too, to be given values but not
        counted) and before the first pass: put what `loss` reads into each batch (and step-wide
        metrics into `prepared.metrics`). `reduce(sums, maxes)` sums and maxima of statistics over
        the group's data ranks (every rank calls it alike; on one data rank it returns them as is)."""
        ...


@runtime_checkable
class Episode(Protocol):
    """One episode of an `Environment`: the rollout asks who acts, gives that role's turn to `step`,
    and reads the rewards once `step` says it is done (or a bound of `[rl.environment]` ended it)."""

    def actor(self) -> str:
        """The role that acts next (one of the environment's `roles`)."""
        ...

    def step(self, turn: Turn) -> Step:
        """Take the acting role's turn; answer with the next observation or the end (`Step`). An
        error of the environment's own making (a tool that failed) is an observation, not an
        exception: an exception here ends the run."""
        ...

    def rewards(self) -> dict[str, float] | None:
        """Each role's reward at the end (also when a bound cut the episode short), or None: the run's
        rewards score each role's last answer. Per-turn rewards (`Step.reward`) are added to either."""
        ...

    def success(self) -> bool | None:
        """Whether the episode reached its goal, when the environment can tell (the eval's and the
        metrics' `success`); None when it cannot."""
        ...


@runtime_checkable
class OpensPerRole(Protocol):
    """An `Episode` capability, optional (asked with `isinstance`): each role starts from a conversation
    of its own (the speaker sees the target), asked when it first acts; else from the prompt."""

    def opening(self, role: str) -> Prompt: ...


@runtime_checkable
class JudgedInPairs(Protocol):
    """An `Environment` capability, optional: its two `judged_roles`' last answers are judged as a pair
    (`PairJudge.judge_answers`, both orders averaged), each role's reward P(win) + P(tie)/2 (debate)."""

    judged_roles: tuple[str, str]


@runtime_checkable
class SharedTurn(Protocol):
    """An `Environment` capability, optional: `shared_role` acts once, first, and that turn is played
    once per start for all its episodes (a proposer's problem, one solver attempt per episode): the
    role's rows are one per start, one group; `start_rewards` gives a start's episodes' rewards."""

    shared_role: str

    def start_rewards(self, episodes: Sequence[Episode]) -> list[dict[str, float]]: ...


@runtime_checkable
class Environment(Protocol):
    """What a rollout's episodes happen in (`[rl.environment]`; `register_environments`; built-ins in
    `hpref.rl.environments`). It works in text: the rollout keeps the tokens (`hpref.rl.rollout.
    episodes`). `start` depends only on its arguments: a regenerated rollout replays its episodes."""

    #: the registered name
    name: str
    #: the roles that act in its episodes (`("policy",)`: one)
    roles: tuple[str, ...]

    def start(self, prompt: Prompt, row: dict[str, Any], seed: int) -> Episode:
        """A new episode on `prompt` (its prompt file row's other columns in `row`: a `reference`,
        a label; {} when the source has none), seeded by `seed`."""
        ...


@runtime_checkable
class GroundTruthReward(Reward, Protocol):
    """A reward that also knows the truth (the synthetic arena), for the metrics that reveal reward
    hacking (`true_utility` in every rollout's row, the evals and the leaderboard)."""

    def true_utility(self, prompt: Prompt, answer: str) -> float: ...


@runtime_checkable
class Engine(Protocol):
    """Generation for one policy, with versioned weights (`[rl.engine]`).

    A weight update is three steps, so a failed transfer never leaves half-loaded weights serving:
    `begin_update(version)`, `load_weights(state)` (or `receive_weights(layout)`: a bucket through
    the weight channel; once per bucket of a sync), then `commit_update()` (or `abort_update()`).

    An engine whose config says `serves_adapters = True` also serves the LoRA policies of a shared
    base (`rl.share_base`; `build(..., adapters={policy: lora settings})`): every call on one policy
    names its `adapter` (its own weights, PEFT's names, and version), `generate_batch` answers several
    policies' requests at once; `adapter=` comes only on a shared base (a plugin may omit it).

    The sampling knobs beyond temperature and top-k (`hpref.recipe.rl_sampling`) reach `generate` as
    keywords only when on (an older plugin's `generate` works while they are off; `generate_batch`'s
    requests carry all), declared in `EngineConfig.sampling_knobs`. Greedy ignores temperature, top-k,
    top-p, min-p; an answer ends before its stop string, text and tokens (`policy.stop_string_cut`).
    """

    def generate(
        self,
        prompts: list[Prompt],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_k: int = 0,
        seed: int = 0,
        greedy: bool = False,
        adapter: str | None = None,
        *,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        stop: Sequence[str] = (),
        contexts: list[list[int]] | None = None,
    ) -> Generation:
        """`group_size` answers per prompt (`hpref.rl.rollout_types.Generation`): `prompt_ids`,
        `completions` (token ids, eos included; an answer cut at a stop string without it),
        `logprobs` (per completion token, at `temperature`), `texts`, `version`, `tokens`, `seconds`."""
        ...

    def generate_batch(self, requests: list[GenerationRequest]) -> list[Generation]:
        """`generate` of each request (`adapter` included), in request order; a request's answers
        are the same as alone, whatever else is in the batch. A request with `contexts` (an
        episode's later turns) continues those token ids as they are instead of encoding its
        prompts."""
        ...

    def weight_dtype(self) -> str:
        """The torch dtype name of the engine's weights (`float32`, `bfloat16`): syncs arrive in it."""
        ...

    def weight_channel_device(self) -> str:
        """ "cuda" when the engine takes a sync's bytes on its GPU (NCCL), else "cpu" (gloo)."""
        ...

    def connect_weight_channel(self, host: str, port: int, device: str) -> None:
        """Join the policy's trainer rank 0 in the weight channel (`hpref.rl.transport.weight_channel`)."""
        ...

    def receive_weights(self, layout: list[tuple[str, tuple[int, ...]]], adapter: str | None = None) -> None:
        """One bucket of a sync from the channel, staged like `load_weights`."""
        ...

    def sleep(self) -> None:
        """Free the engine's device memory while its colocated trainer steps (or do nothing)."""
        ...

    def wake(self) -> None: ...
    def begin_update(self, version: int, adapter: str | None = None) -> None: ...
    def load_weights(self, state: dict[str, Any], adapter: str | None = None) -> None: ...
    def commit_update(self, adapter: str | None = None) -> int: ...
    def abort_update(self, adapter: str | None = None) -> None: ...
    def get_version(self, adapter: str | None = None) -> int: ...


@runtime_checkable
class EngineConfig(Protocol):
    """What `hpref rl` reads of an engine's config (`register_engines`' `config`, from `[rl.engine]`)
    beside what the engine's own `build` reads: the placement (`hpref.rl.placement`, also `hostable`
    where present), the plan, the shared base's checks and the executor's batching read these and
    nothing else. `EngineConfigBase` declares each with its default; an engine's config inherits it."""

    #: serves several LoRA adapters over one base (`rl.share_base`): the `Engine` calls with `adapter=`
    serves_adapters: bool
    #: the names of the sampling knobs `generate` takes (`hpref.recipe.rl_sampling`); a recipe that
    #: turns on another is refused when it loads
    sampling_knobs: frozenset[str]
    #: Ray CPUs each engine actor reserves (`hpref.rl.placement.resources`)
    num_cpus: float
    #: Ray GPUs each engine actor reserves; above 0 the engines run on a GPU (`engines_on_gpu`:
    #: the weight channel's device, whether LoRA policies share a base by default)
    num_gpus: float
    #: the torch dtype name of the engine's weights, what `hpref rl --plan` counts per parameter
    dtype: str
    #: a shared base's engine is called with at most this many answers at a time (the executor's
    #: `RequestBatcher`; 0: every request waiting, in one call)
    batch_rows: int

    def check_policies(self, rl: RLConfig, policies: list[str], where: str) -> None:
        """Before any actor starts (`hpref.rl.launch.preflight`): one `RecipeError` line for a policy
        of `policies` the engine cannot run (vLLM: a head size its CPU kernels lack)."""
        ...

    def check_adapters(self, rl: RLConfig, policies: list[str], where: str) -> None:
        """Before any actor starts, when `policies` share one base (`hpref.rl.placement.shared_base.
        resolve_share_base`): one `RecipeError` line for an adapter the engine cannot serve."""
        ...


class EngineConfigBase(BaseModel):
    """The `EngineConfig` defaults, in one place: an engine's config class inherits this, overrides the
    settings it has (a field, or a `ClassVar` a recipe may not set: transformers' float32), keeps the rest."""

    model_config = ConfigDict(extra="forbid")

    serves_adapters: ClassVar[bool] = False
    sampling_knobs: ClassVar[frozenset[str]] = frozenset()
    hostable: ClassVar[bool] = False  # may run in the rollout executor's process (rl.engines_in_executor)

    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs each engine actor reserves")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs each engine actor reserves")
    dtype: str = Field("float32", description="the torch dtype of the engine's weights")
    batch_rows: int = Field(
        0, ge=0, description="a shared base's engine is called with at most this many answers (0 = all)"
    )

    def check_policies(self, rl: RLConfig, policies: list[str], where: str) -> None:
        """Every policy runs (an engine that refuses some overrides this)."""

    def check_adapters(self, rl: RLConfig, policies: list[str], where: str) -> None:
        """Every adapter of a shared base is served (an engine that refuses some overrides this)."""


@runtime_checkable
class TrainerBackend(Protocol):
    """What a policy's trainer is built on (`rl.policies.<id>.trainer_backend`), `TrainerActor`'s only
    view of it; whatever it trains, the engine and the saves see the transformers layout (`plain_items`)."""

    #: the `trainer_backend` value
    name: str
    #: the model keeps process-wide state (a process group) that `close` must release
    holds_process_state: bool

    def check(self, config: RLConfig, policies: list[str], where: str) -> None:
        """Before any actor starts: one `RecipeError` line for a policy of `policies` (those on
        this backend: `hpref.rl.trainer.backends.check_backends` groups them) this backend cannot build."""
        ...

    def build(self, model: PolicyModelConfig) -> tuple[nn.Module, PreTrainedTokenizerBase]:
        """(causal LM, tokenizer) for the policy's `model` settings."""
        ...

    def frozen_copy(self, model: nn.Module, settings: PolicyModelConfig) -> nn.Module:
        """The starting policy, for the KL reference (not yet frozen; the trainer freezes it)."""
        ...

    def compute_dtype(self, precision: str, model: nn.Module) -> torch.dtype:
        """The torch dtype the trainer's forward computes in."""
        ...

    def plain_items(self, model: nn.Module, lora: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights in the transformers layout, one (key, tensor) at a time, in one order on every
        rank (what engines load); `lora`: the model carries PEFT adapters, to be merged in. A tensor
        may be the model's own, or its FSDP2 shard (a DTensor, which the caller gathers): the
        caller copies what it keeps."""
        ...

    def data_split(self, rank: int, world_size: int) -> tuple[int, int]:
        """(data rank, data ranks) of a trainer rank in a group of `world_size`: the ranks a rollout's
        prompt groups are split over (FSDP2: all of them; tensor parallelism: fewer)."""
        ...

    def shard(
        self, model: nn.Module, device: torch.device, reshard_after_forward: bool = True
    ) -> nn.Module | None:
        """Parallelise `model` over the group's process group; returns the root the trainer calls
        as `root(batch, temperature, entropy=False)` for log-probs (`entropy=True`: and the
        entropies, as `hpref.rl.policy.completion_logprobs`), or None when `model` itself is called.
        `reshard_after_forward`: FSDP2's, for a backend that shards that way."""
        ...

    def load_plain_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Load such a state dict into `model` (strictly)."""
        ...

    def clip_grad_norm(self, model: nn.Module, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients of `params` (what the optimizer steps) to `max_norm` by the norm of the
        whole model's gradient, over every rank's shards; returns that norm (every rank the same)."""
        ...

    def gathered_state(
        self, model: nn.Module, lora: Any, optimizer: torch.optim.Optimizer, grouped: bool
    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """What a save writes, as a one-rank trainer would (every rank of a group calls it: it
        gathers; rank 0's answer is written): the weights for the model's `save_pretrained(...,
        state_dict=)` (`lora`, PEFT's handle or None: its adapters), or None for the model's own,
        and the optimizer's state dict in the one-rank layout."""
        ...

    def sliced_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], grouped: bool
    ) -> dict[str, Any]:
        """A one-rank optimizer state dict (a save's) cut into this rank's shards, for
        `optimizer.load_state_dict`."""
        ...

    def close(self, model: nn.Module) -> None:
        """Release what `build` set up beyond memory."""
        ...


@runtime_checkable
class Tool(Protocol):
    """A tool the `tool` environment's policy calls (`register_tools`): `name`, the one it is registered
    and called by; `description`, one line; `argument`, what the short form `<name>...</name>` passes;
    `run`, whose `ValueError` message the policy reads. It runs on a worker thread the time limit
    cannot stop, so it bounds its own work and keeps no state between calls."""

    name: str
    description: str
    argument: str

    def run(self, arguments: dict[str, Any]) -> str: ...
