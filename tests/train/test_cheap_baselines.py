"""A run on real-schema data (an arena file, no known floor) prints and records its eval log loss
beside the cheap baselines a Kaggle user compares against (issue #12 item 2)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from hpref.arena import generate_battles
from hpref.data.baselines import cheap_baselines
from hpref.data.readers import write_arena_file
from hpref.data.records import Battle
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
    assert {"prior", "length", "bow", "n_train", "n_eval"} <= set(baselines)
    assert baselines["n_eval"] == 30 and np.isfinite(baselines["length"])
    assert baselines["prior"] < math.log(3)  # the synthetic votes are not uniform
