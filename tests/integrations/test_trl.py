"""hpref exports inside TRL (the `bench` extra's TRL): the pairwise judge's numbers and rules, and
the GRPO reward's, in process. The real `OnlineDPOTrainer` and `GRPOTrainer` runs are the docs
page's snippets (test_trl_verl_page.py), their values read back from TRL's own logs."""

from __future__ import annotations

import random

import pytest

from hpref.data.prompts import battle_with_answers

from .conftest import tiny_policy

pytest.importorskip("trl")

PROMPT = "What is 12 + 30?"
ANSWERS = ["The answer is 42.", "41", "I cannot assist with this request."]


@pytest.fixture(scope="module")
def judge(tiny_exports):
    from hpref.integrations.trl import HprefJudge

    return HprefJudge(tiny_exports["judge"], device="cpu")


def test_the_judge_averages_both_orders_and_ranks_ties_first(judge, tiny_exports):
    """Each pair's probabilities are the export's two orders averaged (so swapping the completions
    swaps p_first and p_second exactly), ranks follow p_first >= p_second, scores are P(first) + half
    tie, and a conversational prompt reads as its string; with one order (`swap=False`)
    `shuffle_order` shows pairs in random order and maps them back. Wrong if one order only were
    judged (the position bias kept), a tie went to the second completion unlike TRL's `first >=
    second`, a shuffled pair's probabilities kept the shown order, or message lists read
    differently from strings."""
    from hpref.integrations.trl import HprefJudge

    scorer = judge.backend.scorer
    ab, ba = scorer.judge_pairs(
        [battle_with_answers((PROMPT,), *ANSWERS[:2]), battle_with_answers((PROMPT,), *ANSWERS[1::-1])]
    )
    want = tuple((x + y) / 2 for x, y in zip(ab, (ba[1], ba[0], ba[2]), strict=True))
    assert ab != pytest.approx(want, abs=1e-4)  # the judge has a position bias for averaging to cancel

    prompts = [PROMPT, [{"role": "user", "content": PROMPT}]]
    pairs = [ANSWERS[:2], [[{"role": "assistant", "content": ANSWERS[1]}], ANSWERS[0]]]
    ranks = judge.judge(prompts, pairs)
    first, second = judge.last_probabilities
    assert first == pytest.approx(want, abs=1e-6)
    assert second == pytest.approx((want[1], want[0], want[2]), abs=1e-6)
    assert ranks == [0 if p[0] >= p[1] else 1 for p in (first, second)] and sorted(ranks) == [0, 1]
    assert judge.judge(prompts, pairs, return_scores=True) == pytest.approx(
        [first[0] + first[2] / 2, second[0] + second[2] / 2]
    )
    assert judge.judge([PROMPT], [[ANSWERS[2], ANSWERS[2]]]) == [0]  # equal: the first, as TRL ranks

    # one order only (swap=False): shuffle_order shows some pairs reversed and maps them back
    one_order = HprefJudge(tiny_exports["judge"], device="cpu", swap=False)
    pairs = [ANSWERS[:2]] * 16
    random.seed(0)  # the judge shuffles with Python's global generator: seeded, this is deterministic
    one_order.judge([PROMPT] * 16, pairs, shuffle_order=True)
    shown = one_order.last_probabilities
    assert all(
        p == pytest.approx(ab, abs=1e-6) or p == pytest.approx((ba[1], ba[0], ba[2]), abs=1e-6) for p in shown
    )
    assert 0 < sum(p == pytest.approx(ab, abs=1e-6) for p in shown) < 16  # both orders were shown
    one_order.judge([PROMPT] * 2, pairs[:2], shuffle_order=False)
    assert one_order.last_probabilities == [pytest.approx(ab, abs=1e-6)] * 2

    # TRL 1.x OnlineDPOTrainer's layout: first completions, then second ones, prompts = 2 * prompts
    rewards = judge.reward_func()(prompts=[PROMPT, PROMPT], completions=ANSWERS[:2])
    assert rewards == pytest.approx([want[0] + want[2] / 2, want[1] + want[2] / 2], abs=1e-6)
    with pytest.raises(ValueError, match="OnlineDPOTrainer's batch"):
        judge.reward_func()(prompts=[PROMPT, "other"], completions=ANSWERS[:2])


def test_any_export_judges_and_rewards_a_policy_folder_is_refused(tiny_exports, tmp_path):
    """A reward model judges with its own tie model (as `hpref rl`'s online DPO reads it) and
    rewards with its scalar, grouped by prompt whatever the order of the batch; a judge rewards
    with its within-group win probability. A causal-LM folder is refused in one line naming it.
    Wrong if interleaved prompts were scored as one group, or a policy folder loaded as a judge."""
    from hpref.builtin.rewards import JudgeConfig, JudgeReward
    from hpref.errors import UserError
    from hpref.integrations.trl import HprefJudge, HprefReward

    reference = JudgeReward(JudgeConfig(path=str(tiny_exports["reward"])))
    other = ("Say hi.",)
    [judged] = HprefJudge(tiny_exports["reward"], device="cpu").probabilities([PROMPT], [ANSWERS[:2]])
    [want] = reference.judge_answers([(PROMPT,)], [tuple(ANSWERS[:2])])
    assert judged == pytest.approx(want, abs=1e-6) and judged[2] > 0.0

    for kind in ("reward", "judge"):
        reward = HprefReward(tiny_exports[kind], device="cpu")
        assert reward.__name__ == f"hpref_{kind}"
        scorer = reward.backend.scorer
        [mine, theirs] = scorer.score_groups([(PROMPT,), other], [ANSWERS, ["Hi!", "No."]])
        got = reward(
            prompts=[PROMPT, other[0], PROMPT, other[0], PROMPT],
            completions=[ANSWERS[0], "Hi!", ANSWERS[1], "No.", ANSWERS[2]],
        )
        assert got == pytest.approx([mine[0], theirs[0], mine[1], theirs[1], mine[2]], abs=1e-5)

    model, tokenizer = tiny_policy()
    model.save_pretrained(tmp_path / "policy")
    with pytest.raises(UserError, match=rf"HprefJudge: no exported preference model at {tmp_path}/policy"):
        HprefJudge(tmp_path / "policy")
