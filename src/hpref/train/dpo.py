"""Offline DPO in `hpref train`: a recipe with `[dpo]` trains a causal-LM policy on pairs with a DPO
family objective (`hpref.models.dpo_loss`), through the same loop, run folder, checkpoints, resume,
metrics and summary as a preference model (`hpref.train.loop.fit`; this module is its
`TrainObjective`).

One step. The step's pairs are packed by the same planner (`hpref.data.packing`): a pair is one
example of two sequences (prompt + answer A, prompt + answer B), so both of a pair's sequences are in
one micro-batch, token-budgeted, balanced over ranks, with the same number of micro-batches on every
rank. For each micro-batch the policy's answer log-probs come from one packed forward
(`hpref.models.pair_logprobs`), the reference's from one more without gradient, and the per-pair loss
is weighted `world_size / step_pairs` (FSDP2 averages gradients over ranks): the gradient is that of
the mean loss over the step's pairs whatever the packing and the number of ranks.

The reference. With LoRA it is the policy with its adapters off (PEFT's `disable_adapter`): no second
model. A full fine-tune keeps a frozen copy of the starting weights, sharded like the policy. Each
pair's reference log-probs are computed once, in the micro-batch of the first step that trains on it,
and cached by row (`ReferenceCache`), so later epochs skip the reference forward; the cache is each
rank's own and travels in its checkpoint file, so a resumed run uses the very numbers an uninterrupted
one would.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from hpref.data.packing import StepPlan, StepSampler, collate, filler, plan_eval
from hpref.models.dpo_loss import dpo_loss, mean_metrics, pair_metrics
from hpref.models.pair_logprobs import PackedLogProbs, answer_positions
from hpref.recipe import Recipe
from hpref.recipe.loading import DpoSection
from hpref.train.dpo_data import PairData

#: `pair_metrics`' keys, in the order their sums travel in one all-reduce
METRIC_KEYS = (
    "loss",
    "pairs_n",
    "rewards_chosen",
    "rewards_rejected",
    "rewards_margin",
    "rewards_accuracy",
    "logps_chosen",
    "logps_rejected",
    "decisive_n",
    "tie_reward_gap",
    "ties_n",
)


@dataclass
class ReferenceCache:
    """Reference log-probs (answer A, answer B) of each pair this rank has seen, by row."""

    values: dict[int, tuple[float, float]] = field(default_factory=dict)

    def state_dict(self) -> dict[str, list]:
        rows = sorted(self.values)
        # JSON floats round-trip exactly (Python writes the shortest repr), so a resumed run reads back
        # the very float32 values
        return {"rows": rows, "logps": [list(self.values[r]) for r in rows]}

    def load_state_dict(self, state: dict[str, list]) -> None:
        self.values = {
            int(r): (float(a), float(b)) for r, (a, b) in zip(state["rows"], state["logps"], strict=True)
        }


@dataclass
class DpoObjective:
    """What `fit` calls instead of the preference model's step and eval (`hpref.train.loop`)."""

    settings: DpoSection
    train: PairData
    eval: PairData | None
    #: the context a reference forward runs in: the adapters off (LoRA), else nothing
    reference_mode: Any
    reference_model: torch.nn.Module | None = None  # full fine-tune: the frozen start
    cache: ReferenceCache = field(default_factory=ReferenceCache)
    eval_cache: ReferenceCache = field(default_factory=ReferenceCache)

    @property
    def has_eval(self) -> bool:
        return self.eval is not None

    # ---------------------------------------------------------------------------------------- pieces
    def _micro_batch(self, data: PairData, indices: Sequence[int], filler_id: int, device: torch.device):
        """(packed batch, `predict_at`, `sequence_of`) of one micro-batch (`answer_positions`); a filler
        is two 1-token sequences with no answer token."""
        pad = filler(filler_id, paired=True)
        batch = collate([data.examples[i] if i >= 0 else pad for i in indices]).to(device)
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
        prompts = [p for i in indices for p in ((data.prompt_lengths[i],) * 2 if i >= 0 else (1, 1))]
        at, of = answer_positions(lengths, prompts)
        return batch, at.to(device), of.to(device)

    def _logps(self, model: torch.nn.Module, batch: Any, at: torch.Tensor, of: torch.Tensor) -> torch.Tensor:
        """`[n, 2]`: each example's answer A and B log-probs."""
        out = model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen, at, of)
        return out.reshape(-1, 2)

    def _reference(
        self,
        model: torch.nn.Module,
        cache: ReferenceCache,
        indices: Sequence[int],
        batch: Any,
        at,
        of,
        *,
        run: bool,
    ) -> torch.Tensor:
        """`[n, 2]` reference log-probs of the micro-batch's examples: cached, or (`run`) computed on this
        very packing, the uncached ones stored."""
        if run:
            with torch.no_grad(), self.reference_mode():
                reference = self.reference_model if self.reference_model is not None else model
                computed = self._logps(reference, batch, at, of).float()
            for k, i in enumerate(indices):
                if i >= 0 and i not in cache.values:
                    cache.values[i] = (float(computed[k, 0]), float(computed[k, 1]))
        return torch.tensor(
            [cache.values[i] if i >= 0 else (0.0, 0.0) for i in indices],
            dtype=torch.float32,
            device=at.device,
        )

    @staticmethod
    def _needs_reference(
        micro: Sequence[Sequence[int]], cache: ReferenceCache, device: torch.device, group: Any = None
    ) -> bool:
        """Collective: whether any rank lacks a cached reference for a pair of this step. A sharded
        model's forward is collective (FSDP2 gathers each unit's weights), so when one rank needs a
        reference forward, every rank runs one at every micro-batch of the step."""
        missing = any(i >= 0 and i not in cache.values for mb in micro for i in mb)
        need = torch.tensor([float(missing)], device=device)  # on the device: NCCL reduces no CPU tensor
        if dist.is_initialized():
            dist.all_reduce(need, group=group)
        return bool(need.item())

    def _loss(self, logps: torch.Tensor, ref: torch.Tensor, labels: torch.Tensor):
        s = self.settings
        return dpo_loss(
            logps[:, 0],
            logps[:, 1],
            ref[:, 0],
            ref[:, 1],
            labels,
            beta=s.beta,
            loss_type=s.loss_type,
            label_smoothing=s.label_smoothing,
            tie_strength=s.tie_strength,
        )

    @staticmethod
    def _sums(out: Any, labels: torch.Tensor, logps: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        from hpref.models.dpo_loss import DpoLoss

        kept = DpoLoss(out.loss[real], out.reward_a[real], out.reward_b[real])
        m = pair_metrics(kept, labels[real], logps[real, 0], logps[real, 1])
        return torch.tensor([m[k] for k in METRIC_KEYS], dtype=torch.float64, device=labels.device)

    # ------------------------------------------------------------------------------------ the seam
    def train_step(self, setup: Any, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward/backward this rank's micro-batches of `plan`, clip, step. Returns (this rank's summed
        per-pair loss, the global grad norm before clipping, this rank's `METRIC_KEYS` sums)."""
        from hpref.train.loop import set_gradient_sync

        model, device = setup.model, setup.device
        rank, world, group = setup.data_rank_and_size
        scale = world / plan.num_sequences
        loss_sum = torch.zeros((), device=device)
        sums = torch.zeros(len(METRIC_KEYS), dtype=torch.float64, device=device)
        micro = plan.for_rank(rank)
        run_reference = self._needs_reference(micro, self.cache, device, group)
        for k, indices in enumerate(micro):
            set_gradient_sync(model, k == len(micro) - 1)
            batch, at, of = self._micro_batch(self.train, indices, setup.filler_token_id, device)
            # the policy first: PEFT's `disable_adapter` marks the adapters frozen while it lasts, and
            # FSDP2 fixes each parameter's gradient dtype at its first forward, so a run whose first
            # forward were the reference's would reduce the adapters' bf16 gradients into fp32 masters
            logps = self._logps(model, batch, at, of)
            ref = self._reference(model, self.cache, indices, batch, at, of, run=run_reference)
            out = self._loss(logps, ref, batch.labels)
            per_pair = out.loss * batch.weights
            (per_pair.sum() * scale).backward()
            loss_sum += per_pair.detach().sum()
            sums += self._sums(out, batch.labels, logps.detach(), batch.weights > 0)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), setup.recipe.train.grad_clip or math.inf
        )
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, sums

    def interval_metrics(self, sums: torch.Tensor, group: Any = None) -> dict[str, float]:
        """Collective: the interval's metric sums over ranks -> TRL's DPO means (`mean_metrics`)."""
        total = sums.clone()
        dist.all_reduce(total, group=group)
        return mean_metrics(dict(zip(METRIC_KEYS, total.tolist(), strict=True)))

    @staticmethod
    def log_suffix(record: dict[str, Any]) -> str:
        """What the console line adds after the loss: the implicit rewards' accuracy and margin (and
        the tie gap with ties); the rest is in `metrics.jsonl`."""
        shown = (("rewards_accuracy", "acc"), ("rewards_margin", "margin"), ("tie_reward_gap", "tie gap"))
        return "".join(f" {name} {record[key]:.3f}" for key, name in shown if key in record)

    @torch.no_grad()
    def evaluate(self, setup: Any, step: int, epoch: int, metrics: Any) -> dict[str, float]:
        """Collective: the DPO metrics on `dataset.eval` (every pair once, no gradient), written as an
        `eval` record of `metrics.jsonl` and logged; returns them, `eval_`-prefixed."""
        assert self.eval is not None
        t = time.perf_counter()
        rank, world, group = setup.data_rank_and_size
        plan = plan_eval(
            self.eval.lengths, world_size=world, micro_batch_tokens=setup.recipe.train.micro_batch_tokens
        )
        was_training = setup.model.training
        setup.model.eval()
        sums = torch.zeros(len(METRIC_KEYS), dtype=torch.float64, device=setup.device)
        run_reference = self._needs_reference(plan.for_rank(rank), self.eval_cache, setup.device, group)
        for indices in plan.for_rank(rank):
            batch, at, of = self._micro_batch(self.eval, indices, setup.filler_token_id, setup.device)
            logps = self._logps(setup.model, batch, at, of)  # the policy first, as in `train_step`
            ref = self._reference(setup.model, self.eval_cache, indices, batch, at, of, run=run_reference)
            sums += self._sums(self._loss(logps, ref, batch.labels), batch.labels, logps, batch.weights > 0)
        setup.model.train(was_training)
        result = {f"eval_{k}": v for k, v in self.interval_metrics(sums, group).items()}
        seconds = time.perf_counter() - t
        metrics.write(
            {
                "kind": "eval",
                "step": step,
                "epoch": epoch,
                **result,
                "eval_pairs": len(self.eval.battles),
                "eval_seconds": seconds,
            }
        )
        logger.info(
            f"eval step {step}: loss {result['eval_loss']:.4f}"
            + (
                f", reward accuracy {result['eval_rewards_accuracy']:.3f}, "
                f"margin {result['eval_rewards_margin']:.3f}"
                if "eval_rewards_accuracy" in result
                else ""
            )
            + (f", tie gap {result['eval_tie_reward_gap']:.3f}" if "eval_tie_reward_gap" in result else "")
            + f" ({len(self.eval.battles)} pairs, {seconds:.1f}s)"
        )
        return result

    def rank_state(self) -> dict[str, Any]:
        return {"dpo_reference": self.cache.state_dict()}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if "dpo_reference" in state:
            self.cache.load_state_dict(state["dpo_reference"])


# --------------------------------------------------------------------------------------------------
# setup


def build_dpo_setup(recipe: Recipe, info: Any):
    """The DPO run's parts: policy (+ LoRA) -> pairs -> sharded policy (and, for a full fine-tune, the
    sharded frozen reference) -> optimizer, sampler, scheduler; a `TrainSetup` whose `objective` is
    a `DpoObjective`."""
    from hpref.components import Components
    from hpref.models.attention import register_varlen_attention
    from hpref.models.causal_lm import build_policy_model
    from hpref.models.pair_logprobs import disable_dropout, lm_flops_per_token, shard_causal_lm
    from hpref.models.precision import ProbeShape, resolve_precision
    from hpref.runtime.peak import peak_flops
    from hpref.train.data import Tokenized
    from hpref.train.dpo_data import tokenize_pairs
    from hpref.train.loop import TrainSetup

    assert recipe.dpo is not None
    settings, train_cfg = recipe.dpo, recipe.train
    parts = Components(recipe)
    lm, tokenizer = build_policy_model(settings.model)
    lm.set_attn_implementation(register_varlen_attention())
    disable_dropout(lm)
    if train_cfg.activation_checkpointing:  # recompute each block in backward (non-reentrant: FSDP2, LoRA)
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    positions = getattr(lm.config, "max_position_embeddings", None)
    if isinstance(positions, int) and train_cfg.max_length > positions:
        from hpref.errors import RecipeError

        raise RecipeError(
            f"train.max_length {train_cfg.max_length} exceeds the policy's {positions} positions"
        )

    kw = {
        "max_length": train_cfg.max_length,
        "ties": settings.ties,
        "differing_history": settings.differing_history,
    }
    train_source, eval_source = parts.source("train"), parts.source("eval")
    assert train_source is not None
    train = tokenize_pairs(train_source.battles(), tokenizer, name="dataset.train", **kw)
    evaluation = (
        tokenize_pairs(eval_source.battles(), tokenizer, name="dataset.eval", **kw) if eval_source else None
    )

    dtype = resolve_precision(train_cfg.precision, info.device, ProbeShape.of(lm.config))
    reference = None
    reference_mode: Any = nullcontext
    if recipe.lora is not None:
        from hpref.models.lm_adapters import apply_lora_to_causal_lm

        peft_model = apply_lora_to_causal_lm(lm, recipe.lora, seed=recipe.run.seed)
        reference_mode = peft_model.disable_adapter  # the base, with no second copy of it
    else:
        frozen = copy.deepcopy(lm).requires_grad_(False)
        reference = shard_causal_lm(PackedLogProbs(frozen).to(info.device), dtype)
    model = shard_causal_lm(PackedLogProbs(lm).to(info.device), dtype)
    optimizer = parts.optimizer(model)
    world = info.world_size
    sampler = StepSampler(
        lengths=train.lengths,
        rows=[e.row for e in train.examples],
        swapped=[False] * len(train.examples),
        batch_size=train_cfg.batch_size,
        world_size=world,
        micro_batch_tokens=train_cfg.micro_batch_tokens,
        seed=recipe.run.seed,
        swap="none",  # a pair's A and B are two sequences of one example; there is no B/A view to add
    )
    total_steps = sampler.steps_per_epoch() * train_cfg.epochs
    if train_cfg.max_steps is not None:
        total_steps = min(total_steps, train_cfg.max_steps)
    scheduler = parts.scheduler(optimizer, total_steps)
    peak = peak_flops(info.device, dtype)
    embeddings = sum(p.numel() for p in lm.get_input_embeddings().parameters())
    body = sum(p.numel() for p in lm.parameters()) - embeddings
    where = "the base with the adapters off" if recipe.lora is not None else "a frozen copy of the start"
    logger.info(
        f"DPO ({settings.loss_type}, beta {settings.beta}): {total_steps} steps "
        f"({sampler.steps_per_epoch()} per epoch x {train_cfg.epochs}), {train_cfg.batch_size} pairs "
        f"per step; reference = {where}"
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    objective = DpoObjective(
        settings=settings,
        train=train,
        eval=evaluation,
        reference_mode=reference_mode,
        reference_model=reference,
    )
    setup = TrainSetup(
        recipe=recipe,
        run_dir=recipe.run.run_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        train_data=Tokenized(examples=train.examples),
        eval_data=None,
        device=info.device,
        rank=info.rank,
        world_size=world,
        total_steps=total_steps,
        filler_token_id=int(pad or 0),
        peak=peak,
        backbone_flops=lambda s: lm_flops_per_token(lm.config, body, s),
        objective=objective,
    )
    return setup
