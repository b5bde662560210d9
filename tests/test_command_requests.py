"""`hpref init`, `hpref rl-warmup` and `hpref data stats` build one frozen request each and hand it
to their command whole (issue #27), as train, eval, save, rl and serve do: wrong if the CLI went
back to forwarding options one by one, or dropped one on the way."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from hpref import cli
from hpref.recipe.catalog import resolve_recipe_path
from hpref.rl.command import WarmupRequest
from hpref.stats.command import StatsRequest
from hpref.train.command import InitRequest


def _invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), catch_exceptions=False)


@pytest.mark.parametrize("request_class", [InitRequest, WarmupRequest, StatsRequest])
def test_requests_are_frozen(request_class):
    assert dataclasses.is_dataclass(request_class)
    assert request_class.__dataclass_params__.frozen


def test_init_hands_its_request_down_whole(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr("hpref.train.command.init_command", lambda request: seen.append(request) or tmp_path)
    result = _invoke("init", "quickstart", "--set", "train.max_steps=2", "--set", "run.seed=3")
    assert result.exit_code == 0, result.output
    (request,) = seen
    assert request == InitRequest(resolve_recipe_path("quickstart"), ("train.max_steps=2", "run.seed=3"))


def test_rl_warmup_hands_its_request_down_whole(monkeypatch):
    seen = []

    def warmup_lines(request):
        seen.append(request)
        yield "a\t/somewhere"

    monkeypatch.setattr("hpref.rl.command.warmup_lines", warmup_lines)
    result = _invoke("rl-warmup", "rl-arena", "--policies", "a,b", "--set", "rl.rollouts=1")
    assert result.exit_code == 0, result.output
    assert result.output == "a\t/somewhere\n"
    (request,) = seen
    assert request == WarmupRequest(resolve_recipe_path("rl-arena"), "a,b", ("rl.rollouts=1",))


def test_data_stats_hands_its_request_down_whole(monkeypatch):
    seen = []
    monkeypatch.setattr("hpref.stats.command.stats_command", lambda request: seen.append(request) or {"x": 1})
    args = ["data", "stats", "data.csv", "--tokens", "--recipe", "quickstart", "--on-error", "skip"]
    result = _invoke(*args, "--ceilings", "--set", "train.max_length=64", "--json")
    assert result.exit_code == 0, result.output
    (request,) = seen
    assert request == StatsRequest(
        "data.csv", "train", True, "quickstart", "skip", True, ("train.max_length=64",)
    )
