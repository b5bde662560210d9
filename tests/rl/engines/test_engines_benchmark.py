"""`benchmarks.rl_engines` (the README's "vLLM vs the transformers rollout engine" figure) runs end to
end in its smallest setting: one round, two rollouts (the first a warm-up), the transformers engine on
a config-built tiny policy instead of SmolLM2, HH-RLHF prompts from ../shared (skipped without them,
as the benchmark itself skips). ~15 s: a fresh worker process, as the benchmark times each engine."""

from __future__ import annotations

import json

import pytest
from benchmarks import rl_engines

from tests.rl.tiny import TINY


def test_the_engine_benchmark_times_an_engine_and_writes_its_table(tmp_path, capsys):
    # Wrong if the benchmark behind the README's engine figure no longer ran (an engine API it calls
    # changed, its worker's JSON line moved) or reported a rate that is not tokens over wall.
    if not rl_engines.HELPFUL.is_file():
        pytest.skip(f"{rl_engines.HELPFUL} is absent (../shared)")
    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig

    lm, tokenizer = build_policy_model(PolicyModelConfig(**TINY))
    lm.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    out = tmp_path / "engines.json"
    argv = [
        "--contenders",
        "transformers",
        "--rounds",
        "1",
        "--rollouts",
        "2",
        "--policy",
        str(tmp_path / "policy"),
    ]
    assert rl_engines.main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (run,) = result["runs"]["transformers"]
    assert len(run["rollouts"]) == 2  # the warm-up is kept in the file, not in the medians
    (timed,) = run["rollouts"][1:]
    assert timed["tokens"] > 0 and timed["tokens_per_s"] == pytest.approx(timed["tokens"] / timed["wall_s"])
    summary = result["summary"]["transformers"]
    assert summary["vs_transformers"] == 1.0 and summary["tokens_per_s"] == pytest.approx(
        timed["tokens_per_s"]
    )
    assert "| transformers |" in capsys.readouterr().out
