"""Reward components: the rule reward against the arena's judge, pairwise averaging, registration."""

from __future__ import annotations

import pytest

from hpref import arena as synthetic
from hpref.builtin.rewards import JudgeConfig, RuleConfig, build_rule, pairwise_rewards
from hpref.plugins import load_plugins
from tests.rl.tiny import TINY

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
        model = build_tiny_llama(TinyLlamaConfig(**TINY, head_dropout=0.0))
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


@pytest.fixture(scope="module")
def exported_judge(tmp_path_factory):
    """A judge as `hpref rl` users get one: a trainer checkpoint consolidated by `hpref save`."""
    pytest.importorskip("torch")
    from hpref.save import export
    from tests.evaluate.conftest import make_run

    mp = pytest.MonkeyPatch()
    mp.setenv("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))
    try:
        run_dir = tmp_path_factory.mktemp("judge-run") / "tiny"
        make_run(run_dir)
        return export.save_export(run_dir, tmp_path_factory.mktemp("export") / "judge")
    finally:
        mp.undo()


def test_judge_scores_answers_against_other_policies(exported_judge):
    # Wrong if opponents (another policy's answers to the same prompt) were ignored, judged in one
    # order only, or counted with a weight other than one comparison each.
    from hpref.builtin.rewards import build_judge
    from hpref.data.records import Battle

    reward = build_judge(JudgeConfig(path=str(exported_judge), max_length=320))
    assert reward.wants_opponents and reward.opponent_answers == 2
    group = ["The answer is 42.", "41"]
    opponents = ["I cannot assist with this request.", "Sure! The answer is 42."]
    [scores] = reward.score_groups([PROMPT], [group], [opponents])
    everyone = group + opponents

    def win(i, j):  # both orders, as the symmetric judge does: P(i first wins) and P(i second wins)
        [(fa, _, ft), (_, bb, bt)] = reward.judge_pairs(
            [
                Battle("f", PROMPT, (everyone[i],), (everyone[j],)),
                Battle("b", PROMPT, (everyone[j],), (everyone[i],)),
            ]
        )
        return ((fa + ft / 2) + (bb + bt / 2)) / 2

    want = [sum(win(i, j) for j in range(4) if j != i) / 3 for i in range(2)]
    assert scores == pytest.approx(want, abs=1e-6)
    # without opponents the same judge only compares the group: the cross-policy terms matter
    # (this tiny untrained judge is near 0.5 everywhere, so the difference is small but real)
    [alone] = reward.score_groups([PROMPT], [group])
    assert alone == pytest.approx([win(0, 1), win(1, 0)], abs=1e-6)
    assert abs(alone[0] - scores[0]) > 1e-5
    # an opponent that wrote the very same answer ties exactly: it adds 0.5, whatever the judge
    [(same,)] = [reward.score_groups([PROMPT], [[group[0]]], [[group[0]]])[0]]
    assert same == pytest.approx(0.5, abs=1e-6)


def test_cross_policy_is_pairwise_only_and_can_be_turned_off():
    # Wrong if a utility reward asked for opponents it cannot use, or cross_policy = false did not
    # stop the executor from generating them.
    assert build_rule(RuleConfig(mode="pairwise")).wants_opponents
    assert not build_rule(RuleConfig(mode="utility")).wants_opponents
    assert not build_rule(RuleConfig(mode="pairwise", cross_policy=False)).wants_opponents
    # rule pairwise against an opponent: a correct answer beats a wrong opponent more than a tie
    reward = build_rule(RuleConfig(mode="pairwise"))
    [[vs_wrong]] = reward.score_groups([PROMPT], [["42"]], [["41"]])
    [[vs_right]] = reward.score_groups([PROMPT], [["42"]], [["42"]])
    assert vs_wrong > 0.9 and vs_right == pytest.approx(0.5)


def test_a_judge_path_without_an_export_is_one_line_naming_the_key(tmp_path, monkeypatch):
    # Wrong if a missing judge (or eval scorer) surfaced only inside the executor actor, after Ray
    # had started; the recipe itself still reads (a shipped recipe names an export its user makes).
    from hpref.errors import RecipeError
    from hpref.recipe import recipe_from_dict
    from hpref.rl import launch

    def no_ray(_address):
        raise AssertionError("Ray was started before the reward exports were checked")

    monkeypatch.setattr(launch, "connect_ray", no_ray)
    judge = {"name": "judge", "path": str(tmp_path / "nope")}
    for key, section in (("rl.reward", {"reward": judge}), ("rl.eval_scorer", {"eval_scorer": judge})):
        recipe = recipe_from_dict(
            {"run": {"name": "r", "output_dir": str(tmp_path)}, "rl": {"policies": {"a": {}}, **section}}
        )
        with pytest.raises(RecipeError) as err:
            launch.run_rl(recipe, ["a"])
        assert str(err.value).startswith(f"recipe: {key}.path: no exported preference model at {tmp_path}")
        assert not (tmp_path / "r").exists()


def test_judge_reward_on_a_reward_model_scores_each_answer_alone(tmp_path_factory):
    """A reward-model export scores each answer with its conversation, G sequences for G answers
    (no pairs, no opponents): the reward of an answer is its score alone, whatever the rest of its
    group. Wrong if the answers were judged in pairs (G^2 cost) or paired with another group's."""
    pytest.importorskip("torch")
    import torch

    from hpref.builtin.models import TinyLlamaConfig, build_tiny_llama
    from hpref.builtin.rewards import build_judge
    from hpref.data.formatting import AnswersConfig, AnswersFormatter
    from hpref.data.records import Battle

    mp = pytest.MonkeyPatch()
    mp.setenv("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))
    try:
        model = build_tiny_llama(TinyLlamaConfig(**TINY, head="reward"))
        with torch.no_grad():
            model.head.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
        folder = model.save_pretrained(tmp_path_factory.mktemp("reward"))
    finally:
        mp.undo()
    reward = build_judge(JudgeConfig(path=str(folder), max_length=200))
    assert reward.scalar and not reward.wants_opponents
    answers = ["42", "I cannot assist with this request.", "41"]
    calls = []
    forward = reward.model.forward
    reward.model.forward = lambda ids, cu, *a, **k: calls.append(cu.numel() - 1) or forward(ids, cu, *a, **k)
    (scores,) = reward.score_groups([PROMPT], [answers])
    assert sum(calls) == 4  # 3 answers: two by two, the odd one with itself
    alone = reward.score_groups([PROMPT], [answers[1:2]])[0]
    assert scores[1] == pytest.approx(alone[0], abs=1e-5)
    f = AnswersFormatter(AnswersConfig(), model.tokenizer, 200)
    e = f.encode_many([Battle("x", PROMPT, (answers[0],), (answers[2],))])[0]
    cu = torch.tensor([0, e.split, len(e.ids)], dtype=torch.int32)
    positions = torch.cat([torch.arange(e.split), torch.arange(len(e.ids) - e.split)])
    with torch.no_grad():
        logits = model(torch.tensor(e.ids), cu, positions)[0]
    assert [scores[0], scores[2]] == pytest.approx(logits[:2].tolist(), abs=1e-5)
