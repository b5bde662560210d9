"""`benchmarks.rl_tool` (benchmarks/README.md, "Tool use on SmolLM2") runs end to end in its smallest
setting: the shipped `rl-tool-smollm2` recipe as an `hpref rl` process joining the suite's Ray cluster,
on a config-built tiny Llama instead of SmolLM2, one update and an eval of two held-out problems; and
its figures are read from the metrics rows as the README says."""

from __future__ import annotations

import json
import math

import pytest
from benchmarks import rl_tool

from tests.rl.tiny import TINY


def test_the_figures_come_from_the_training_rows_and_the_last_eval():
    """Wrong if the seconds per update were not the loop time to the last update over N (start-up
    and the final eval excluded), or the start and end columns came from another eval than the
    last (an interim one) or from the wrong key."""
    rows = [
        {"elapsed_s": 30.0, "reward_mean": 0.25},
        {"elapsed_s": 40.0, "eval": True, "eval_success": 0.0, "eval_success_start": 0.0},
        {"elapsed_s": 70.0, "reward_mean": 0.5},
        {"elapsed_s": 90.0, "reward_mean": 0.75},
        {
            "elapsed_s": 120.0, "eval": True, "eval_success": 0.5, "eval_success_start": 0.125,
            "eval_tool_call_share": 0.75, "eval_tool_call_share_start": 0.25, "eval_turns": 1.75,
            "eval_turns_start": 1.25,
        },
    ]  # fmt: skip
    got = rl_tool.tool_figures(rows, updates=3)
    assert got == {
        "updates": 3,
        "seconds_per_update": 30.0,
        "median_gap_s": 30.0,  # 40 and 20 s between the three updates
        "reward_first": 0.25,
        "reward_last": 0.75,
        "success_start": 0.125,
        "success_end": 0.5,
        "tool_call_share_start": 0.25,
        "tool_call_share_end": 0.75,
        "turns_start": 1.25,
        "turns_end": 1.75,
    }


@pytest.mark.slow
def test_the_tool_benchmark_runs_the_recipe_and_writes_its_table(ray_cluster, tmp_path, capsys):
    """Wrong if the benchmark behind the tool-use figure no longer ran (a `--set` key of the recipe, an
    eval figure it reads or the recipe itself changed), or reported a share outside [0, 1] or a time
    per update that is not positive."""
    pytest.importorskip("peft")
    import ray

    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig

    lm, tokenizer = build_policy_model(PolicyModelConfig(**TINY))
    lm.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    out = tmp_path / "tool.json"
    argv = ["--updates", "1", "--eval-prompts", "2", "--policy", str(tmp_path / "policy")]
    argv += ["--work", str(tmp_path / "work"), "--out", str(out)]
    argv += ["--ray-address", ray.get_runtime_context().gcs_address]
    assert rl_tool.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["rc"] == 0 and result["updates"] == 1 and result["eval_prompts"] == 2
    for key in ("success_start", "success_end", "tool_call_share_start", "tool_call_share_end"):
        assert 0.0 <= result[key] <= 1.0, key
    assert 0 < result["seconds_per_update"] < math.inf and result["turns_start"] >= 1.0
    printed = capsys.readouterr().out
    assert "| policy | eval problems | success: start | after 1 |" in printed and "| policy | 2 |" in printed
