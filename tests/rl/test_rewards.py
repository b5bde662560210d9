"""Reward components: the rule reward against the arena's judge, pairwise averaging, registration."""

from __future__ import annotations

import pytest

from hpref.builtin.rewards import JudgeConfig, RuleConfig, build_rule, pairwise_rewards
from hpref.data import synthetic
from hpref.plugins import load_plugins

PROMPT = ("What is 12 + 30?",)


def test_rule_utility_rewards_the_correct_answer():
    reward = build_rule(RuleConfig())
    [[right, wrong, refusal]] = reward.score_groups(
        [PROMPT], [["The answer is 42.", "The answer is 41.", "I cannot assist with this request."]]
    )
    # correctness is worth W_CORRECT; a refusal costs W_REFUSAL (plus tiny length bonuses)
    assert right - wrong == pytest.approx(synthetic.W_CORRECT, abs=1e-9)
    assert refusal < wrong
    assert right == pytest.approx(synthetic.answer_utility(PROMPT, "The answer is 42."))


def test_rule_pairwise_is_mean_win_plus_half_tie():
    reward = build_rule(RuleConfig(mode="pairwise"))
    answers = ["42", "41", "42"]
    [scores] = reward.score_groups([PROMPT], [answers])
    u = [synthetic.answer_utility(PROMPT, a) for a in answers]
    pa, _, pt = synthetic.davidson(u[0], u[1])
    qa, _, qt = synthetic.davidson(u[0], u[2])
    assert scores[0] == pytest.approx(((pa + pt / 2) + (qa + qt / 2)) / 2)
    # equal answers tie in expectation: the two correct ones score the same, the wrong one less
    assert scores[0] == pytest.approx(scores[2]) and scores[1] < scores[0]


def test_pairwise_rewards_of_one_answer_is_neutral():
    assert pairwise_rewards(1, lambda i, j: 1.0) == [0.5]
    assert pairwise_rewards(3, lambda i, j: float(i > j)) == [0.0, 0.5, 1.0]


def test_rule_reward_accepts_a_user_function(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def score(prompt, answer):\n    return float(len(answer))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = build_rule(RuleConfig(function="my_reward:score"))
    assert reward.score_groups([PROMPT], [["ab", "abcd"]]) == [[2.0, 4.0]]


def test_rewards_are_registered_as_builtin_components():
    registry = load_plugins()
    assert registry.get("reward", "rule").plugin == "hpref.builtin.rewards"
    assert registry.get("reward", "judge").config is JudgeConfig
    for comp in (registry.get("reward", "rule"), registry.get("reward", "judge")):
        assert all(row["description"] for row in comp.parameters()), comp.name


def test_rewards_module_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, hpref.builtin.rewards; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory):
    pytest.importorskip("torch")
    from hpref.builtin.models import TinyLlamaConfig, build_tiny_llama

    cache = tmp_path_factory.getbasetemp() / "hpref-cache"
    mp = pytest.MonkeyPatch()
    mp.setenv("HPREF_CACHE", str(cache))
    try:
        model = build_tiny_llama(
            TinyLlamaConfig(
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                intermediate_size=64,
                vocab_size=300,
                tokenizer_texts=300,
                head_dropout=0.0,
            )
        )
        return model.save_pretrained(tmp_path_factory.mktemp("judge"))
    finally:
        mp.undo()


def test_judge_reward_is_symmetric_and_a_probability(judge_folder):
    from hpref.builtin.rewards import build_judge

    reward = build_judge(JudgeConfig(path=str(judge_folder), max_length=400))
    groups = [["The answer is 42.", "The answer is 42."], ["42", "I cannot assist with this request.", "41"]]
    same, mixed = reward.score_groups([PROMPT, PROMPT], groups)
    # judged in both orders, two identical answers tie exactly: (pa + pb + tie) / 2 = 0.5 each
    assert same == pytest.approx([0.5, 0.5], abs=1e-5)
    # every pair's two win probabilities sum to 1, so a group's rewards average to exactly 0.5
    assert sum(mixed) / 3 == pytest.approx(0.5, abs=1e-5)
    assert all(0.0 <= r <= 1.0 for r in mixed)
