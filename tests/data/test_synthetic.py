"""The synthetic arena: determinism, a judge that reads the text, labels drawn from the truth,
and the hardness bound on the cheap baselines."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from hpref import arena as syn
from hpref.arena.source import SyntheticArena, SyntheticArenaConfig
from hpref.builtin import datasets as builtin_datasets
from hpref.prediction.baselines import log_loss


def test_battles_are_deterministic_and_prefix_stable():
    first = list(syn.generate_battles(50, seed=7))
    assert first == list(syn.generate_battles(50, seed=7))
    assert list(syn.generate_battles(20, seed=7)) == first[:20]  # battle i depends on (seed, i) only
    assert first != list(syn.generate_battles(50, seed=8))


def test_every_prompt_is_a_task_the_judge_can_decide():
    for battle in syn.generate_battles(300, seed=0):
        assert 1 <= len(battle.prompt) <= 3
        assert len(battle.prompt) == len(battle.response_a) == len(battle.response_b)
        for turn in battle.prompt:
            assert syn.parse_task(turn) is not None, turn  # else correctness is invisible
        # The truth stored with the battle is exactly what the public judge says.
        assert battle.truth == pytest.approx(syn.judge(battle.prompt, battle.response_a, battle.response_b))
    for prompt in syn.prompts(100, seed=1):
        assert all(syn.parse_task(t) is not None for t in prompt)


def test_judge_rewards_correct_answers_and_is_swap_symmetric():
    p_a, p_b, p_tie = syn.judge("What is 12 + 30?", "The answer is 42.", "The answer is 41.")
    assert p_a > 0.8 and p_b < 0.1 and math.isclose(p_a + p_b + p_tie, 1.0)
    assert syn.judge("What is 12 + 30?", "41", "42") == pytest.approx((p_b, p_a, p_tie), abs=0.02)
    swapped = syn.judge("Which is smaller: 40 or 12?", "40", "12")
    assert swapped[1] > swapped[0]
    # Listing every capital must not count as knowing the right one (RL would learn that hack).
    assert not syn.is_correct(syn.parse_task("What is the capital of Peru?"), " ".join(syn.CITIES))
    assert syn.is_correct(syn.parse_task("What is the capital of Peru?"), "It is Lima.")
    # A refusal loses against a wrong but honest answer.
    assert syn.answer_utility("What is 1 + 1?", syn.REFUSALS[0]) < syn.answer_utility("What is 1 + 1?", "3")
    assert syn.answer_utility("Tell me a joke.", "ok") == pytest.approx(
        syn.W_LENGTH
    )  # unknown task: no credit


def test_drawn_labels_follow_the_true_probabilities():
    battles = list(syn.generate_battles(3000, seed=11))
    labels = np.array([b.label for b in battles])
    truth = np.array([b.truth for b in battles])
    # Per class, the drawn frequency matches the mean truth within 4 standard errors.
    se = np.sqrt((truth * (1 - truth)).sum(axis=0)) / len(battles)
    assert np.all(np.abs(labels.mean(axis=0) - truth.mean(axis=0)) < 4 * se + 1e-9)
    # Calibration: among battles with P(A) > 0.7, A wins about as often as predicted.
    sure = truth[:, 0] > 0.7
    assert sure.sum() > 200
    assert abs(labels[sure, 0].mean() - truth[sure, 0].mean()) < 0.05
    soft = list(syn.generate_battles(5, seed=11, labels="soft"))
    assert all(b.label == b.truth for b in soft)


def test_report_floor_and_baseline_bounds():
    arena = SyntheticArena(SyntheticArenaConfig(num_battles=3000), seed=0)
    report = arena.report()
    assert report.uniform == pytest.approx(math.log(3))
    assert report.n_train + report.n_eval == 3000 and 500 < report.n_eval < 700
    # A real gap to learn: the truth beats uniform by > 0.2 nats.
    assert report.uniform - report.bayes_floor > 0.2
    assert abs(report.bayes_floor - report.expected_entropy) < 0.05  # labels are drawn from the truth
    for name in ("length_baseline", "bow_baseline"):
        value = getattr(report, name)
        assert value > report.bayes_floor
        # Hard in the right way: a surface-feature model closes less than half of the gap.
        assert report.closed(value) < 0.5, (name, str(report))
    # ...and the bag-of-words baseline learns something beyond the label prior (style, refusals).
    assert report.bow_baseline < report.prior_baseline - 0.01
    assert 0.0 < report.closed(report.prior_baseline) < 0.3
    assert "Bayes floor" in str(report) and report.as_dict()["bow_closed"] < 0.5


def test_component_streams_folds_and_summary():
    registered = {}
    builtin_datasets.register_datasets(register=lambda **kw: registered.setdefault(kw["name"], kw))
    assert set(registered) == {"arena", "pairwise", "synthetic-arena"}
    component = SimpleNamespace(**registered["synthetic-arena"])
    config = component.config.model_validate({"num_battles": 200, "folds": 4, "fold": 0, "split": "eval"})
    arena = component.build(config, seed=5)
    held_out = list(arena.battles())
    assert arena.summary.rows_read == 200 and arena.summary.rows_used == len(held_out)
    assert arena.summary.rows_other_split == 200 - len(held_out)
    config_seeded = component.config.model_validate({"num_battles": 20, "seed": 9})
    # An explicit generator seed wins over the run seed, so changing the run seed keeps the data.
    assert list(component.build(config_seeded, seed=1).battles()) == list(syn.generate_battles(20, 9))
    assert (
        component.build(config_seeded, seed=1).fingerprint()
        == component.build(config_seeded, 2).fingerprint()
    )


def test_corpus_texts_cover_prompts_and_answers():
    texts = list(syn.corpus_texts(10, seed=0))
    battles = list(syn.generate_battles(10, seed=0))
    assert len(texts) == sum(3 * len(b.prompt) for b in battles)
    assert battles[0].prompt[0] in texts and battles[0].response_b[0] in texts


def test_skill_ceilings_run_from_style_only_to_the_bayes_floor():
    """A judge that knows every family's correctness is the true judge, so the last ceiling must be
    the Bayes floor; knowing no correctness must be clearly worse, and knowing one family must help.
    If the first fails, the utility decomposition in `_decompose` no longer adds up to
    `answer_utility`; if the others fail, the marginalisation over hidden correctness is wrong."""
    battles = list(syn.generate_battles(300, seed=11))
    ceilings = syn.skill_ceilings(battles)
    labels = np.array([b.label for b in battles])
    floor = log_loss(np.array([b.truth for b in battles]), labels)
    steps = [k for k in ceilings if "alone" not in k and k != "style only"]
    assert len(steps) == len(syn.FAMILIES) and set(steps[-1].split("+")) == set(syn.FAMILIES)
    assert ceilings[steps[-1]] == pytest.approx(floor, abs=1e-9)
    assert ceilings["style only"] > floor + 0.15
    for family in syn.FAMILIES:
        assert floor < ceilings[f"{family} alone"] < ceilings["style only"]
    assert ceilings["style only"] < math.log(3)
