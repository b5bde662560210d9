"""A run on real-schema data (an arena file, no known floor) prints and records its eval log loss
beside the cheap baselines a Kaggle user compares against (issue #12 item 2)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from hpref.arena import generate_battles
from hpref.data.readers import write_arena_file
from hpref.data.records import Battle
from hpref.prediction.baselines import cheap_baselines
from tests.train.conftest import RECIPE

pytestmark = pytest.mark.slow


def _battle(i: int, label) -> Battle:
    return Battle(str(i), ("q",), ("a" * (5 + i % 7),), ("b" * (5 + i % 3),), label)


def test_the_baselines_are_the_numbers_they_claim():
    """Label prior: the train shares scored on eval (here 3/4 A, 1/4 B on train; eval all A ->
    -ln 0.75). Length: a model that sees only lengths learns 'longer wins' when that is the rule.
    If this fails the printed baselines mislead the user about what the model adds."""
    train = [_battle(i, (1.0, 0.0, 0.0) if i % 4 else (0.0, 1.0, 0.0)) for i in range(40)]
    evaluation = [_battle(i, (1.0, 0.0, 0.0)) for i in range(40, 48)]
    cheap = cheap_baselines(train, evaluation, bow=False)
    assert cheap.prior == pytest.approx(-math.log(0.75), abs=1e-9)
    assert cheap.bow is None and cheap.label_shares == (1.0, 0.0, 0.0)

    def longer_wins(i: int) -> Battle:
        la, lb = 3 + i % 11, 3 + (i * 7) % 13
        label = (1.0, 0.0, 0.0) if la > lb else (0.0, 1.0, 0.0) if lb > la else (0.0, 0.0, 1.0)
        return Battle(str(i), ("q",), ("x " * la,), ("y " * lb,), label)

    train = [longer_wins(i) for i in range(300)]
    evaluation = [longer_wins(i) for i in range(300, 400)]
    cheap = cheap_baselines(train, evaluation)
    assert cheap.length < 0.5 * cheap.prior  # lengths explain these labels; the prior cannot


def test_a_baseline_of_noise_falls_back_to_the_label_prior_instead_of_overfitting():
    """Answers of 30-400 random words and random labels: no feature says anything, so a baseline
    must print about the label prior (its penalty chosen by cross-validation), never worse than
    uniform. Before #23 the bag-of-words one printed 1.16 here and 1.33 on real LMSYS battles: a
    'baseline' that any model beats says nothing about the model."""
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(800)]
    classes = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))

    def noise(i: int) -> Battle:
        answer = lambda: " ".join(rng.choice(words) for _ in range(rng.randrange(30, 400)))  # noqa: E731
        return Battle(str(i), ("q",), (answer(),), (answer(),), classes[rng.randrange(3)])

    battles = [noise(i) for i in range(600)]
    cheap = cheap_baselines(battles[:400], battles[400:])
    assert cheap.bow is not None
    for value in (cheap.length, cheap.style, cheap.bow):
        assert value < cheap.prior + 0.005 and value < math.log(3) + 0.005


def test_the_style_baseline_sees_layout_that_lengths_cannot():
    """Answers of the same length where the one laid out as a list wins, and where two answers that
    both decline draw: the length baseline can only guess the prior, the style baseline must learn
    both rules. If it failed, a user would compare their model with a weaker reference than the
    answer-format features every LMSYS competitor fitted."""
    import random

    rng = random.Random(1)
    listed = "- word word\n- word word\n- word word\n" + "word " * 3
    plain = listed.replace("\n", " ").replace("- ", "x ")  # as many characters and words
    refusal = "I'm sorry, but I can't help with that request here."

    def battle(i: int) -> Battle:
        kind = rng.randrange(3)
        if kind == 2:  # both decline: a tie
            return Battle(str(i), ("q",), (refusal,), (refusal,), (0.0, 0.0, 1.0))
        a_lists = kind == 0
        a, b = (listed, plain) if a_lists else (plain, listed)
        return Battle(str(i), ("q",), (a,), (b,), (1.0, 0.0, 0.0) if a_lists else (0.0, 1.0, 0.0))

    battles = [battle(i) for i in range(500)]
    cheap = cheap_baselines(battles[:400], battles[400:], bow=False)
    assert cheap.style < 0.2 and cheap.length > cheap.style + 0.5


def test_on_real_arena_votes_every_baseline_beats_uniform_and_length_beats_the_prior():
    """The 999 real LMSYS battles in ../shared, fold 0 of 5 by prompt: arena votes favour longer
    answers, so the length baseline must beat the label prior, and the bag-of-words one must not
    fall below uniform. Skips without ../shared."""
    from hpref.data.readers import ArenaConfig, ArenaReader
    from tests.conftest import SHARED

    path = SHARED / "data" / "lmsys-arena-kaggle-sample-a.csv.gz"
    if not path.is_file():
        pytest.skip("needs ../shared/data/lmsys-arena-kaggle-sample-a.csv.gz")
    train, evaluation = (
        list(ArenaReader(ArenaConfig(path=str(path), folds=5, fold=0, split=split), 0).battles())
        for split in ("train", "eval")
    )
    cheap = cheap_baselines(train, evaluation)
    assert len(evaluation) == 201 and cheap.prior == pytest.approx(1.095, abs=0.002)
    assert cheap.length < cheap.prior - 0.02  # 1.059 measured
    assert cheap.bow < math.log(3) - 0.02  # 1.046 measured (1.39 before cross-validation)
    assert cheap.style < cheap.length - 0.02  # 1.020 measured: layout says more than length alone


def test_a_run_on_an_arena_file_reports_the_cheap_baselines(tmp_path):
    """If this fails, a user training on real votes sees a log loss with nothing to read it
    against (uniform is not a baseline: the label prior alone beats it)."""
    from hpref.train import run_train

    battles = list(generate_battles(120, seed=3))
    # real votes carry no generating distribution: drop it, so no Bayes floor can be computed
    data = write_arena_file(tmp_path / "votes.csv", [dataclasses.replace(b, truth=None) for b in battles])
    recipe = RECIPE.format(name="arena", output_dir=(tmp_path / "runs").as_posix())
    head, _, rest = recipe.partition("[dataset.train]")
    _, _, tail = rest.partition("[optimizer]")
    datasets = (
        f'[dataset.train]\nname = "arena"\npath = "{data.as_posix()}"\nfolds = 4\nsplit = "train"\n\n'
        f'[dataset.eval]\nname = "arena"\npath = "{data.as_posix()}"\nfolds = 4\nsplit = "eval"\n\n'
    )
    (tmp_path / "arena.toml").write_text(head + datasets + "[optimizer]" + tail)
    assert run_train(tmp_path / "arena.toml", ["train.max_steps=2"], nproc_per_node=1) == 0
    summary = json.loads((tmp_path / "runs" / "arena" / "summary.json").read_text())
    baselines = summary["baselines"]
    assert {"prior", "length", "style", "bow", "n_train", "n_eval"} <= set(baselines)
    assert baselines["n_eval"] == 30 and np.isfinite(baselines["length"])
    assert baselines["prior"] < math.log(3)  # the synthetic votes are not uniform

    # each baseline's eval predictions sit beside the model's, for the same battles, and blend
    # with them through hpref eval, with an out-of-fold figure for the fitted weights
    from hpref.evaluate.command import EvalRequest, eval_command
    from hpref.prediction.files import read_predictions

    run = tmp_path / "runs" / "arena"
    model = read_predictions(run / "predictions.csv")
    for name in ("prior", "length", "style", "bow"):
        baseline = read_predictions(run / "predictions" / f"baseline-{name}.csv")
        assert sorted(baseline.ids) == sorted(model.ids) and len(model.ids) == 30
    prior = read_predictions(run / "predictions" / "baseline-prior.csv")
    assert np.allclose(prior.probs, prior.probs[0])  # one distribution: the train split's shares
    out = tmp_path / "blend.csv"
    members = [run / "predictions.csv", run / "predictions" / "baseline-length.csv"]
    assert (
        eval_command(EvalRequest(None, data=data, out=out, ensemble=members, fit_weights=True, plot=False))
        == 0
    )
    metrics = json.loads(out.with_name("blend.metrics.json").read_text())
    assert metrics["cross_fitted_log_loss"] >= metrics["log_loss"] - 1e-9 and len(metrics["weights"]) == 2
    # the run's own summary blends the model with the style baseline the same way (cross-fitted)
    style = [run / "predictions.csv", run / "predictions" / "baseline-style.csv"]
    assert (
        eval_command(EvalRequest(None, data=data, out=out, ensemble=style, fit_weights=True, plot=False)) == 0
    )
    metrics = json.loads(out.with_name("blend.metrics.json").read_text())
    assert summary["blend_with_style"] == pytest.approx(metrics["cross_fitted_log_loss"], abs=1e-9)
