"""The grpo algorithm's estimators (`advantage = "grpo" | "rloo" | "reinforce++"`) and the trainer's
entropy and advantage-spread metrics, in-process on the tiny policy (no Ray): what each estimator
trains on, REINFORCE++'s step whatever the micro-batching, the entropy `completion_logprobs` gives on
every path, and the recipe's refusals. The two-rank path is `test_trainer_group.py`'s (its one-rank
vs group comparison covers `entropy` and the advantage spread)."""

from __future__ import annotations

import math

import pytest

from hpref.errors import RecipeError
from hpref.recipe.rl import parse_rl_section
from hpref.rl.algorithms.registry import build_algorithm, check_algorithms
from hpref.rl.rollout_types import rollout_of_tokens
from tests.rl.tiny import TINY

torch = pytest.importorskip("torch")

REWARDS = [1.0, 0.0, 0.2, 0.9, 0.5, 0.4]
ROLLOUT = {
    "rollout_id": 0,
    "group_size": 2,
    "temperature": 1.0,
    "rewards": REWARDS,
    "prompt_ids": [[1, 5, 6, 7, 3, 4, 5, 6, 7]] * 2
    + [[1, 8, 3, 4, 5, 6, 7]] * 2
    + [[1, 9, 10, 3, 4, 5, 6, 7]] * 2,
    "completions": [[20, 21], [22], [23, 24, 25], [26], [27, 28], [29, 30, 31, 2]],
}
ROLLOUT["logprobs"] = [[-1.0 - 0.1 * t for t in range(len(c))] for c in ROLLOUT["completions"]]


def _config(policy=None, **defaults):
    return parse_rl_section(
        {
            "rollout": {"group_size": 2, "prompts_per_rollout": 3, "max_new_tokens": 4},
            "defaults": {"model": TINY, "lr": 1e-2, **defaults},
            "policies": {"a": policy or {}},
        },
        "test",
    )


def test_each_estimator_gives_its_advantages_and_grpo_stays_the_default():
    """grpo (the default) keeps GRPO's group-normalised numbers; rloo trains on the reward less the
    mean of the group's other answer (for a group of two: twice the centred reward); reinforce++
    hands the raw rewards to its per-token step. Wrong if a policy without `advantage` changed
    estimator, or an estimator read another's numbers."""
    from hpref.rl.algorithms.objectives import group_advantages

    rollout = rollout_of_tokens(**ROLLOUT)
    grpo = build_algorithm("a", _config().policies["a"])
    default = grpo.prepare(rollout, None)
    assert grpo.config.advantage == "grpo"
    torch.testing.assert_close(default.values, group_advantages(torch.tensor(REWARDS), 2))
    # a group of two differing answers under GRPO: -+1/sqrt(2); six of them: unbiased std sqrt(6/5 x 1/2)
    s = 1 / math.sqrt(2)
    spread = {"advantage_std": math.sqrt(0.6), "advantage_min": -s, "advantage_max": s}
    assert default.metrics == pytest.approx(spread, abs=1e-4)
    rloo = build_algorithm("a", _config(algorithm={"advantage": "rloo"}).policies["a"]).prepare(rollout, None)
    # 1 - 0, 0 - 1 | 0.2 - 0.9, 0.9 - 0.2 | 0.5 - 0.4, 0.4 - 0.5
    assert rloo.values.tolist() == pytest.approx([1.0, -1.0, -0.7, 0.7, 0.1, -0.1], abs=1e-6)
    assert rloo.metrics["advantage_max"] == pytest.approx(1.0) and rloo.metrics[
        "advantage_min"
    ] == pytest.approx(-1.0)
    plus = build_algorithm("a", _config(algorithm={"advantage": "reinforce++"}).policies["a"]).prepare(
        rollout, None
    )
    assert plus.values.tolist() == pytest.approx(REWARDS) and plus.metrics == {}


def test_a_reinforce_pp_step_is_the_same_whatever_the_micro_batching(monkeypatch):
    """REINFORCE++'s advantages are normalised over the whole rollout, so its step (loss, weights,
    advantage spread) is the same with every group in one micro-batch, one group per micro-batch,
    or every row padded alone; the KL is in the reward (kl_coef 0.1 against the frozen start), and
    the whole-step normalisation leaves the advantages' std at 1. The step also reports the
    policy's entropy on its answers. Wrong if micro-batches (or ranks) were normalised apart."""
    import hpref.rl.trainer.actor as trainer_module
    from hpref.rl.trainer.actor import TrainerActor

    def stepped(budget, share):
        monkeypatch.setattr(trainer_module, "shares_prefix", lambda model: share)
        cfg = _config(algorithm={"advantage": "reinforce++", "kl_coef": 0.1}, micro_batch_tokens=budget)
        trainer = TrainerActor("a", cfg.policies["a"], 1)
        assert trainer.reference is not None  # the KL reward's reference
        return trainer.train(rollout_of_tokens(**ROLLOUT)), trainer.model

    one_stats, model = stepped(4096, True)
    one = model.state_dict()
    assert one_stats["micro_batches"] == 1
    assert one_stats["advantage_std"] == pytest.approx(1.0, abs=1e-6)
    assert one_stats["advantage_min"] < 0 < one_stats["advantage_max"]
    # a random-init policy is near uniform over its vocabulary: entropy near ln V, no token below 0.672
    vocab = model.config.vocab_size
    assert 0.9 * math.log(vocab) < one_stats["entropy"] <= math.log(vocab) + 1e-4
    assert one_stats["low_entropy_share"] == 0.0
    for budget, share in ((16, True), (16, False)):  # one group, then one padded row, per micro-batch
        stats, other = stepped(budget, share)
        assert stats["micro_batches"] == (3 if share else 6)
        for key in ("loss", "advantage_std", "advantage_min", "advantage_max", "entropy"):
            assert stats[key] == pytest.approx(one_stats[key], abs=1e-5), key
        other = other.state_dict()
        for key, value in one.items():  # Adam moves each weight by ~lr (1e-2): a wrong step shows
            torch.testing.assert_close(other[key], value, atol=1e-5, rtol=1e-5)


def test_completion_logprobs_entropy_is_the_sampling_distributions_on_every_path():
    """The entropy `completion_logprobs` returns beside the log-probs is `Categorical(logits /
    temperature).entropy()` at each answer position, zero elsewhere, from a `pad_batch`, a
    `group_batch` (answers on the prompt's KV cache) and a model that gives full logits (the megatron
    trainer's path), and asking for it leaves the log-probs as they were. Wrong if it were read at
    the wrong positions, temperature or path."""
    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig
    from hpref.rl.policy import completion_logprobs, group_batch, pad_batch

    model, tok = build_policy_model(PolicyModelConfig(**TINY))
    prompts = [p for p in ([5, 6, 7, 8, 9], [10, 11]) for _ in range(2)]
    answers = [[20, 21, 22], [23], [24, 25, 26, 27], [28, 29]]
    padded, grouped = (
        pad_batch(prompts, answers, tok.pad_token_id),
        group_batch(prompts, answers, 2, tok.pad_token_id),
    )

    class FullLogits(torch.nn.Module):  # not a transformers model: completion_logprobs reads its logits
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask):
            return self.lm(input_ids=input_ids, attention_mask=attention_mask)

    with torch.no_grad():
        mask = padded["mask"].bool()
        logits = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits[:, :-1]
        want = torch.distributions.Categorical(logits=logits[mask] / 0.7).entropy()
        for lm, batch in ((model, padded), (model, grouped), (FullLogits(model), padded)):
            logprobs, entropy = completion_logprobs(lm, batch, 0.7, entropy=True)
            assert entropy.shape == batch["mask"].shape
            assert float(entropy[~batch["mask"].bool()].abs().sum()) == 0.0
            torch.testing.assert_close(entropy[batch["mask"].bool()], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logprobs, completion_logprobs(lm, batch, 0.7))


def test_an_estimator_is_the_grpo_algorithms_and_a_bad_one_is_refused_naming_the_key():
    """`advantage` is a key of the grpo algorithm's table: online DPO's table with one, and an
    unknown estimator, are refused when the recipe is read, each in one line naming
    `rl.policies.<id>.algorithm.advantage`; reinforce++ at kl_coef 0 (OpenRLHF allows it: plain
    batch-normalised REINFORCE) runs without a reference. `hpref components algorithm` lists GRPO's
    settings, exactly the keys a policy's table refuses as moved (`GRPO_KEYS`). Wrong if a
    misplaced estimator were ignored, or the listing and the refusal named different keys."""
    from hpref.plugins import component_listing
    from hpref.recipe.rl_policy import GRPO_KEYS
    from hpref.rl.algorithms.grpo import GrpoConfig
    from hpref.rl.protocols import PreparesBatches

    with pytest.raises(RecipeError, match=r"^test: rl.policies.a.algorithm.advantage: unknown key; valid"):
        _config({"algorithm": {"name": "online-dpo", "advantage": "rloo"}})
    with pytest.raises(
        RecipeError, match=r"test: rl.policies.a.algorithm.advantage: .*'grpo', 'rloo' or 'reinforce\+\+'"
    ):
        _config({"algorithm": {"advantage": "ppo"}})
    dpo = _config({"algorithm": "online-dpo"})
    plain = _config(algorithm={"advantage": "reinforce++"})
    check_algorithms(plain, ["a"], "test")
    grpo = build_algorithm("a", plain.policies["a"])
    assert not grpo.wants_reference() and isinstance(grpo, PreparesBatches)
    assert not isinstance(build_algorithm("a", dpo.policies["a"]), PreparesBatches)
    listed = {c["name"]: c for c in component_listing(["algorithm"])}["grpo"]["parameters"]
    assert [p["name"] for p in listed] == list(GrpoConfig.model_fields)
    # every setting but those added after the move (they never lived in a policy's table)
    assert set(GrpoConfig.model_fields) - {"turn_advantages"} == set(GRPO_KEYS)
    key = next(p for p in listed if p["name"] == "advantage")
    assert key["default"] == "grpo" and "reinforce++" in key["type"] and "rloo" in key["description"]
    kl = next(p for p in listed if p["name"] == "kl_coef")
    assert kl["default"] == 0.0 and kl["type"] == "float"


def test_per_turn_advantages_credit_what_came_at_and_after_each_turn_grouped_by_position():
    """AT-GRPO's per-turn groups with reward-to-go (`objectives.turn_advantages`), a group of three
    episodes: A took two turns (0.5 for its first, episode total 1.5), B one (0.0), C two (0.5 each,
    total 2.0). Returns: A [1.5, 1.0], B [0.0], C [2.0, 1.5]; turn 0 compares all three, turn 1 A and
    C only (B never had one: 0). Rows of equal turns with no per-turn rewards get `group_advantages`
    at every turn. Wrong: a turn credited with rewards that came before it, a turn compared with
    episodes that never reached it, or a per-turn path that changes an equal-turn rollout."""
    from hpref.rl.algorithms.objectives import group_advantages, token_turn_values, turn_advantages

    rewards = torch.tensor([1.5, 0.0, 2.0])
    steps = [[0.5, 0.0], [0.0], [0.5, 0.5]]
    grpo = turn_advantages(rewards, steps, 3)
    first = torch.tensor([1.5, 0.0, 2.0])
    expected0 = (first - first.mean()) / (first.std() + 1e-6)
    assert torch.allclose(grpo[:, 0], expected0) and grpo[1, 1] == 0.0
    assert grpo[0, 1] == pytest.approx(-0.7071, abs=1e-3) and grpo[2, 1] == pytest.approx(0.7071, abs=1e-3)
    rloo = turn_advantages(rewards, steps, 3, leave_one_out=True)
    assert torch.allclose(rloo, torch.tensor([[0.5, -0.5], [-1.75, 0.0], [1.25, 0.5]]))
    even = torch.tensor([1.0, 0.0, 0.2, 0.9])
    per_turn = turn_advantages(even, [[0.0, 0.0]] * 4, 2)
    assert torch.equal(per_turn[:, 0], group_advantages(even, 2)) and torch.equal(
        per_turn[:, 1], per_turn[:, 0]
    )
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    spread = token_turn_values(torch.tensor([[2.0, -1.0], [3.0, 0.0]]), mask)
    assert spread.tolist() == [[2.0, 2.0, 0.0, 0.0, -1.0, -1.0, -1.0, 0.0], [3.0] + [0.0] * 7]
