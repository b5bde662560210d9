"""Online DPO as an `hpref.rl.protocols.Algorithm` (`algorithm = "online-dpo"`): each prompt's answers
are sampled from the policy in pairs, the run's reward judges each pair three ways (a judge reads
both orders and averages them; a tie stays a tie: `PairJudge.judge_answers`), and the policy takes
the DPO-family loss of `hpref.models.dpo_loss` on the judged pairs against its start (the
reference: the base with the adapters off for LoRA, a frozen copy otherwise) — Guo et al., 2024
("Direct Language Model Alignment from Online AI Feedback"), TRL's `OnlineDPOTrainer`.

With `pairs = "cross"` and several policies, each answer is paired with another policy's answer to the
same prompt (the executor's opponents, `RolloutExecutor._opponents`): the policy learns from how its
answers fare against its rivals', judged by the same judge — cross-policy DPO. The opponent's answer
is re-read in this policy's tokens, so the policies need not share a tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from hpref.errors import RecipeError
from hpref.recipe.dpo import DpoSettings, LossType
from hpref.rl.rollout_types import Rollout, TrainingRows

if TYPE_CHECKING:
    import torch

    from hpref.recipe.rl import PolicyConfig, RLConfig


class OnlineDpoConfig(DpoSettings):
    """DPO's settings (`hpref.recipe.dpo.DpoSettings`), tie-aware by default: a judge's verdicts carry
    ties and soft probabilities, which `davidson` trains on as they are."""

    loss_type: LossType = Field(
        "davidson",
        description="sigmoid = DPO (a tie counts half a win each way), ipo, or davidson = tie-aware DPO-D "
        "(Chen et al. 2024: a tie pulls the two answers' implicit rewards together)",
    )
    pairs: Literal["own", "cross"] = Field(
        "own",
        description="own = the policy's answers paired two by two; cross = each answer against another "
        "policy's answer to the same prompt (several policies)",
    )


class OnlineDpo:
    name = "online-dpo"
    needs_preferences = True

    def __init__(self, config: OnlineDpoConfig, policy: PolicyConfig) -> None:
        self.config = config
        self.cross_policy = config.pairs == "cross"

    def check(self, policy: str, config: RLConfig, policies: list[str], where: str) -> None:
        key = f"{where}: rl.policies.{policy}.algorithm"
        group = config.rollout.group_size
        if not self.cross_policy and group % 2:
            raise RecipeError(
                f"{key}: online-dpo pairs a prompt's answers two by two, and rl.rollout.group_size is "
                f"{group}; make it even (2 is online DPO's usual)"
            )
        if self.cross_policy and len(policies) < 2:
            raise RecipeError(
                f"{key}.pairs: 'cross' pairs each answer with another policy's, and only '{policy}' runs"
            )
        if self.cross_policy and config.environment.name != "single-turn":
            # the other policy's side of a pair would be its last answer alone, not its episode
            raise RecipeError(
                f"{key}.pairs: 'cross' pairs compare single answers, and rl.environment is "
                f"'{config.environment.name}' (episodes); use pairs = \"own\""
            )

    def wants_reference(self) -> bool:
        return True

    def prepare(self, rollout: Rollout, tokenizer: Any) -> TrainingRows:
        """Each judged pair as two consecutive rows sharing the prompt; an opponent's answer in this
        policy's tokens (ending in its eos, as a sampled answer does)."""
        import torch

        if not rollout.pairs:
            raise RuntimeError(
                f"online-dpo: rollout {rollout.rollout_id} of '{rollout.policy}' has no judged pairs"
            )
        own = len(rollout.completions)
        eos = tokenizer.eos_token_id
        prompts, completions, masks = [], [], []
        for first, second in rollout.pairs:
            for row in (first, second):
                prompts.append(rollout.prompt_ids[first])
                if row < own:
                    completions.append(rollout.completions[row])
                else:
                    text = rollout.opponent_texts[row - own]
                    completions.append(tokenizer.encode(text, add_special_tokens=False) + [eos])
                # an episode's observations are context: its answer is the policy's tokens alone
                masks.append(rollout.masks[row] if rollout.masks is not None else [1] * len(completions[-1]))
        sampled = [row < own for pair in rollout.pairs for row in pair]
        return TrainingRows(
            prompts=prompts,
            completions=completions,
            group=2,
            behaviour=None,  # DPO compares the policy with its reference, not with the sampler
            temperature=1.0,  # the policy's own distribution, as DPO's implicit reward reads it
            values={
                "targets": torch.tensor(rollout.verdicts, dtype=torch.float32),
                # the policy's own samples, where the k3 estimate of its KL to the start holds
                "own": torch.tensor(sampled),
            },
            whole_groups=True,
            sampled=sampled,
            masks=masks if rollout.masks is not None else None,
        )

    def loss(
        self, logprobs: torch.Tensor, batch: dict[str, Any], rows: list[int], prepared: TrainingRows
    ) -> tuple[torch.Tensor, dict[str, float]]:
        import torch

        from hpref.models.dpo_loss import answer_logprobs, dpo_loss, pair_metrics
        from hpref.rl.algorithms.objectives import k3_kl

        cfg = self.config
        mask = batch["mask"]
        answer = answer_logprobs(logprobs, mask, cfg.loss_type)
        reference = answer_logprobs(batch["ref"], mask, cfg.loss_type)
        targets = prepared.values["targets"][[r // 2 for r in rows[0::2]]].to(answer.device)
        out = dpo_loss(
            answer[0::2],
            answer[1::2],
            reference[0::2],
            reference[1::2],
            targets,
            beta=cfg.beta,
            loss_type=cfg.loss_type,
            label_smoothing=cfg.label_smoothing,
            tie_strength=cfg.tie_strength,
        )
        pairs = len(prepared.completions) // 2
        stats = pair_metrics(out, targets, answer[0::2], answer[1::2])
        with torch.no_grad():  # KL(policy || start) on the policy's own answers, as GRPO measures it
            own = mask * prepared.values["own"][rows].to(mask.device, mask.dtype)[:, None]
            stats["kl_sum"] = float((k3_kl(logprobs, batch["ref"]) * own).sum())
            stats["kl_tokens"] = float(own.sum())
        return out.loss.sum() / pairs, stats

    def summarise(self, sums: dict[str, float]) -> dict[str, float]:
        from hpref.models.dpo_loss import mean_metrics

        out = mean_metrics(sums)
        if sums.get("kl_tokens"):
            out["kl"] = sums["kl_sum"] / sums["kl_tokens"]
        return out


def build_online_dpo(config: OnlineDpoConfig, policy: PolicyConfig) -> OnlineDpo:
    """Online DPO: the policy's answers judged in pairs, three ways, by the reward; DPO against the start.

    Pairs are the policy's own answers two by two, or each against another policy's (`pairs`); the
    loss is DPO, IPO or tie-aware DPO (`loss_type`)."""
    return OnlineDpo(config, policy)
