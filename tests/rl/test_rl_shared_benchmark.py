"""`benchmarks.rl_shared` (the README's "Two LoRA policies on one shared base vs two apart" figure)
runs end to end in its smallest setting: both its parts through its own code, on a config-built tiny
Llama (random init) instead of SmolLM2, a tiny reward export instead of MiniLM's, and toy HH-RLHF-style
prompts instead of ../shared's: `hpref rl` processes for `alone` and `shared-2` (one rollout each,
joining the suite's Ray cluster) and the in-process engine for the merged policy and one adapter."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

from benchmarks import rl_shared  # noqa: E402

from tests.rl.tiny import TINY  # noqa: E402
from tests.serve.conftest import make_export  # noqa: E402


def toy_prompts(path: Path, n: int = 24) -> Path:
    """`n` chosen/rejected rows in HH-RLHF's transcript format, each its own prompt."""
    with path.open("w") as f:
        for i in range(n):
            prompt = f"\n\nHuman: Name a colour for room {i}."
            row = {"chosen": f"{prompt}\n\nAssistant: Green.", "rejected": f"{prompt}\n\nAssistant: No."}
            f.write(json.dumps(row) + "\n")
    return path


def test_the_shared_base_benchmark_times_its_runs_and_engines_and_writes_both_tables(
    ray_cluster, tmp_path, capsys
):
    """Wrong if the benchmark behind the README's shared-base figure no longer ran (a `--set` key of the
    recipe, a metrics field it reads or an engine call changed), a run's per-rollout time or memory were
    not positive and finite, the "shared-2 vs alone" ratio line the figure quotes were not printed, or the
    engine part's tokens/s were not the tokens it generated over its seconds."""
    import ray

    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig

    lm, tokenizer = build_policy_model(PolicyModelConfig(**TINY))
    lm.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    reward = make_export(tmp_path, "reward")
    out = tmp_path / "shared.json"
    argv = ["--runs", "alone,shared-2", "--rounds", "1", "--rollouts", "1", "--engine-adapters", "1"]
    argv += ["--policy", str(tmp_path / "policy"), "--prompts", str(toy_prompts(tmp_path / "p.jsonl"))]
    argv += ["--reward", str(reward), "--work", str(tmp_path / "work"), "--out", str(out)]
    argv += ["--ray-address", ray.get_runtime_context().gcs_address]
    assert rl_shared.main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"alone", "shared-2"}
    for name, policies in (("alone", 1), ("shared-2", 2)):
        (run,) = result["runs"][name]
        assert run["rc"] == 0 and run["policies"] == policies
        for key in ("seconds_per_leader_rollout", "train_s_median", "peak_pss_gib", "peak_rss_gib"):
            assert 0 < run[key] < math.inf, (name, key)
    engine = {int(n): runs for n, runs in result["engine"].items()}
    assert set(engine) == {0, 1}
    for (got,) in engine.values():
        assert got["tokens"] > 0 and got["tokens_per_s"] == pytest.approx(got["tokens"] / got["seconds"])
    printed = capsys.readouterr().out
    assert "shared-2: loop time / 2 x alone = " in printed and "| 1 adapter, one batch | 32 |" in printed
    assert printed.count("| alone | 1 | 1 |") == 1 and "| shared-2 | 2 | 1 |" in printed


def test_the_debate_benchmark_runs_a_shared_base_debate_and_reports_its_table(ray_cluster, tmp_path, capsys):
    """`benchmarks.rl_debate` (the README's "Policies that meet" figure) in its smallest setting: one
    `hpref rl rl-debate-smollm2` run on a shared base (both policies' turns through one engine), one
    update, a tiny Llama and a tiny reward export as judge and scorer. Wrong if the recipe's keys, the
    metrics it reads (`match_score_mean`, the scorer's win rate against the start) or the summary's
    live table (`leaderboard`, `matches`) changed, or a's verdicts against b were not in [0, 1]."""
    import ray
    from benchmarks import rl_debate

    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig

    lm, tokenizer = build_policy_model(PolicyModelConfig(**TINY))
    lm.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    reward = make_export(tmp_path, "reward")
    out = tmp_path / "debate.json"
    argv = ["--runs", "shared", "--updates", "1", "--eval-prompts", "2", "--policy", str(tmp_path / "policy")]
    prompts = toy_prompts(tmp_path / "p.jsonl", n=60)  # the recipe holds 5% out: 3 eval prompts
    argv += ["--prompts", str(prompts), "--reward", str(reward), "--scorer", str(reward)]
    argv += ["--work", str(tmp_path / "work"), "--out", str(out)]
    argv += ["--ray-address", ray.get_runtime_context().gcs_address]
    assert rl_debate.main(argv) == 0
    (run,) = json.loads(out.read_text())["runs"]["shared"]
    assert run["rc"] == 0 and run["updates"] == 1 and 0 < run["seconds_per_update"] < math.inf
    assert 0.0 <= run["match_score_first"] <= 1.0 and set(run["win_rate_vs_start"]) == {"a", "b"}
    assert {"a", "b", "a@start", "b@start"} <= set(run["leaderboard"])
    games, score = run["matches"]["a"]["b"]  # one update: its episodes' verdicts, each counted once
    assert games == 16 and 0.0 <= score <= games  # the recipe's 4 prompts x 4 debates each
    assert "| shared | 1 |" in capsys.readouterr().out
