"""`hpref train`'s metric loggers (`--log tensorboard --log wandb`, `hpref.builtin.loggers`) read back
from the shared 2-rank run (tests/train/conftest.py `two_rank_run`): the same numbers as
metrics.jsonl at the same steps, from rank 0 alone, with the recipe as the run's config; and the
refusals a bad `[logging]` gets before anything starts."""

from __future__ import annotations

import json

import pytest

from hpref import __version__

from .logger_files import (
    assert_curves_match,
    tensorboard_scalars,
    tensorboard_text,
    train_curves,
    wandb_curves,
    wandb_run,
)


def assert_loggers_show_metrics(run_dir, redone: range = range(0)) -> None:
    """TensorBoard's and W&B's curves are metrics.jsonl's (`train/*` at each train step, `eval/*` at
    each eval), each step once (also in the resume test of test_engine.py). `redone`: the steps an
    interrupted run logged after its last save; W&B keeps the first copy of those (it drops a
    resumed run's steps below the one it reached), so there only the steps are compared."""
    expected = train_curves(run_dir)
    history, _config = wandb_run(run_dir)
    shown = {**wandb_curves(history, "train/step"), **wandb_curves(history, "eval/step")}
    assert_curves_match(expected, tensorboard_scalars(run_dir / "tensorboard"))
    for name, points in expected.items():
        assert sorted(shown.get(name, {})) == sorted(points), f"W&B {name}"
    later = {name: {s: v for s, v in points.items() if s not in redone} for name, points in expected.items()}
    assert_curves_match(
        later, {name: {s: v for s, v in points.items() if s not in redone} for name, points in shown.items()}
    )


def test_tensorboard_and_wandb_show_metrics_jsonl(two_rank_run):
    """If this fails, a figure of metrics.jsonl (loss, lr, grad norm, tokens/s, MFU, memory, eval log
    loss, accuracy) is missing from a dashboard, at another step or with another value; or rank 1
    wrote too (two event files / W&B runs); or the config is not the run's recipe."""
    assert_loggers_show_metrics(two_rank_run)
    events = list((two_rank_run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, f"only rank 0 writes: {events}"
    assert len(list((two_rank_run / "wandb").glob("offline-run-*"))) == 1
    for name in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu"):
        assert name in tensorboard_scalars(two_rank_run / "tensorboard"), name
    # the summary's baselines, at the last eval's step, as `eval/baseline_<name>`
    summary = json.loads((two_rank_run / "summary.json").read_text())
    scalars = tensorboard_scalars(two_rank_run / "tensorboard")
    for name, value in summary["baselines"].items():
        if isinstance(value, int | float):
            assert scalars[f"eval/baseline_{name}"] == {summary["eval_step"]: pytest.approx(value, rel=1e-6)}
    config = json.loads(tensorboard_text(two_rank_run / "tensorboard", "config/text_summary").strip("`\n"))
    _history, wandb_config = wandb_run(two_rank_run)
    for logged in (config, wandb_config):
        assert logged["hpref_version"] == __version__
        assert logged["recipe"]["run"]["name"] == "ref"
        assert logged["recipe"]["logging"]["loggers"] == ["tensorboard", "wandb"]


def test_a_bad_log_option_is_one_line_exit_2_before_anything_starts(tmp_path):
    """If this fails, `--log` with a typo on `hpref train` or `hpref rl` starts a run (or prints a
    traceback) instead of one line that names the option and the nearest logger."""
    from hpref.errors import RecipeError
    from hpref.rl.command import RlRequest, rl_command
    from tests.conftest import run_hpref

    result = run_hpref("train", "quickstart", "--log", "tensorbord", "--set", f"run.output_dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --log: logging.loggers: unknown logger 'tensorbord' (did you mean 'tensorboard'?)"
    ]
    assert not any(tmp_path.iterdir()), "a run folder was written before the refusal"
    from hpref.recipe.catalog import resolve_recipe_path

    request = RlRequest(resolve_recipe_path("rl-arena"), "a", (f"run.output_dir={tmp_path}",), log=("wand",))
    with pytest.raises(RecipeError, match=r"unknown logger 'wand' \(did you mean 'wandb'"):
        rl_command(request)
    assert not any(tmp_path.iterdir())


def test_a_plugin_logger_from_register_loggers_gets_the_records(tmp_path, fresh_registry):
    """A third-party logger registered through the `register_loggers` hook, selected by `--log` with
    its `[logging.<name>]` parameters. If this fails, plugins cannot add a logger (the hook is not
    read, the config not validated) or it is not handed the run, the step axis and the names."""
    import types

    from pydantic import BaseModel

    from hpref.builtin.loggers import build_loggers
    from hpref.hookspecs import hookimpl
    from hpref.plugins import load_plugins
    from hpref.recipe.loading import recipe_from_dict
    from hpref.recipe.logging_section import add_loggers

    got = []

    class Config(BaseModel):
        prefix: str = ""

    class Logger:
        def __init__(self, config, run):
            got.append(("start", run.resume_step, run.config["hpref_version"] == __version__))
            self.prefix = config.prefix

        def log(self, values, step, axis):
            got.append((axis, step, {self.prefix + k: v for k, v in values.items()}))

        def close(self):
            got.append(("close",))

    plugin = types.SimpleNamespace(
        register_loggers=hookimpl(lambda register: register(name="memory", config=Config, build=Logger))
    )
    plugin.register_loggers.__name__ = "register_loggers"
    load_plugins(extra=[plugin])
    recipe = recipe_from_dict({"logging": {"memory": {"prefix": "x-"}}})
    add_loggers(recipe, ["memory"])
    loggers = build_loggers(recipe, tmp_path, 4)
    loggers.train_record({"kind": "train", "step": 5, "loss": 0.5, "note": "text is not a figure"})
    loggers.train_record({"kind": "eval", "step": 5, "eval_log_loss": 1.0, "eval_accuracy": 0.5})
    loggers.close()
    assert got == [
        ("start", 4, True),
        ("train/step", 5, {"x-train/loss": 0.5}),
        ("eval/step", 5, {"x-eval/log_loss": 1.0, "x-eval/accuracy": 0.5}),
        ("close",),
    ]
