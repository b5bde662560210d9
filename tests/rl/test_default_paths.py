"""Default paths of `hpref rl` that no other test runs: an exported hpref judge as online DPO's judge
(`JudgeReward.judge_answers` through `rollout.pairing.judged_pairs`), and one short run on the suite's Ray
cluster that carries two more: its reward is `remote`, served by a real `hpref serve`, and its policy
learns with the example plugin's algorithm (`best-of-n`, `plugins/hpref-example`)."""

from __future__ import annotations

import json
import math

import pytest

from tests.rl.tiny import TINY
from tests.serve.conftest import TOKEN, make_export, serving

torch = pytest.importorskip("torch")

PROMPTS = [("What is 12 + 30?",), ("Name a colour.", "Blue.", "Another one?")]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{"judge": folder, "reward": folder}: tiny models checkpointed by the trainer's own code and
    consolidated by `hpref save` (`tests.serve.conftest.make_export`), as users make them."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))
    try:
        base = tmp_path_factory.mktemp("exports")
        return {head: make_export(base, head) for head in ("judge", "reward")}
    finally:
        mp.undo()


def one_order(model, formatter, prompt, first: str, second: str) -> tuple[float, float, float]:
    """The judge's own (P(first), P(second), P(tie)) of one order: the pair formatted alone and read
    by one forward pass of the model, with none of the scorer's packing, dedup or un-swapping."""
    from hpref.data.prompts import battle_with_answers

    [encoded] = formatter.encode_many([battle_with_answers(prompt, first, second)])
    ids = torch.tensor(encoded.ids)
    cu = torch.tensor([0, len(encoded.ids)], dtype=torch.int32)
    with torch.no_grad():
        logits = model(ids, cu, torch.arange(len(encoded.ids)))[0].double()
    return tuple(torch.softmax(logits, -1).tolist())  # type: ignore[return-value]


def test_an_exported_judge_judges_online_dpo_pairs_in_both_orders_and_keeps_ties(exports):
    """Online DPO's judge as a run builds it (`[rl.reward] name = "judge"` on an `hpref save` export,
    the executor's `RewardSet`) pairs each group's answers and gives every pair the mean of the
    judge's two orders, computed here from the model's own three-way probabilities. Wrong if a pair
    were read in one order only (this judge's position bias moves the numbers), the second order
    were mapped back with P(first) and P(second) crossed, a tie's probability were dropped or handed
    to a winner, or an answer's reward were not its P(preferred) + half P(tie)."""
    from hpref.models import PreferenceModel
    from hpref.recipe.rl import parse_rl_section
    from hpref.recipe.rl_rewards import reward_parts
    from hpref.rl.rollout.pairing import judged_pairs
    from hpref.rl.rollout.rewards import RewardSet

    config = parse_rl_section(
        {
            "rollout": {"group_size": 2},
            "reward": {"name": "judge", "path": str(exports["judge"])},
            "defaults": {"model": TINY, "algorithm": "online-dpo"},
            "policies": {"a": {}},
        },
        "test",
    )
    judge = RewardSet.from_parts(reward_parts(config))
    assert judge.judges_pairs
    # the second group's answers are the same text: whichever order, the judge reads one sequence
    groups = [["The answer is 42.", "I cannot assist with this request."], ["Red.", "Red."]]
    pairs, verdicts, opponents, rewards, _ = judged_pairs(judge, PROMPTS, groups)
    assert pairs == [(0, 1), (2, 3)] and opponents == []

    model = PreferenceModel.from_pretrained(str(exports["judge"])).eval()
    formatter = judge.components[0].reward.scorer.formatter  # 'pab', as the export was trained
    for (prompt, (first, second)), verdict in zip(zip(PROMPTS, groups, strict=True), verdicts, strict=True):
        ab = one_order(model, formatter, prompt, first, second)
        b_first, a_second, tie = one_order(model, formatter, prompt, second, first)
        want = ((ab[0] + a_second) / 2, (ab[1] + b_first) / 2, (ab[2] + tie) / 2)
        assert verdict == pytest.approx(want, abs=1e-6)
        assert sum(verdict) == pytest.approx(1.0, abs=1e-6)
    # the order matters to this judge: one order's numbers would not pass the check above
    ab = one_order(model, formatter, PROMPTS[0], *groups[0])
    assert max(abs(x - y) for x, y in zip(ab, verdicts[0], strict=True)) > 1e-3
    # a tie stays a tie: neither of two same answers is preferred, and the judge's tie probability
    # (checked above against the model's) is the verdict's, not split between them or rounded away
    p_first, p_second, p_tie = verdicts[1]
    assert p_first == p_second and p_tie > 0.05
    want_rewards = [verdicts[0][0] + verdicts[0][2] / 2, verdicts[0][1] + verdicts[0][2] / 2, 0.5, 0.5]
    assert rewards == pytest.approx(want_rewards, abs=1e-6)


@pytest.fixture(scope="module")
def served(exports, tmp_path_factory):
    """`hpref serve` on the reward export (one replica, one thread: the run's few requests), behind
    the token, in its own process and Ray cluster."""
    base = tmp_path_factory.mktemp("served")
    with serving(exports["reward"], base, "--replicas", "1", "--threads", "1") as server:
        yield server, base / "token"


def served_scores(server, prompt: list[str], answers: list[str]) -> list[float]:
    """What the server says of `answers` to `prompt` (turns: user, assistant, ..., user)."""
    import httpx

    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(prompt)]
    reply = httpx.post(
        f"{server.url}/v1/score",
        json={"conversation": messages, "answers": answers},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["scores"]


@pytest.mark.slow
def test_a_plugin_algorithm_trains_on_a_served_remote_reward_through_ray(ray_cluster, served, tmp_path):
    """One `hpref rl` run on the suite's Ray cluster whose reward is `remote` (the `hpref serve`
    above) and whose policy's algorithm is the example plugin's `best-of-n`. Wrong if the rewards
    the run logged were not the served model's scores of those very answers (a reward made up, a
    default in its place, answers sent to the wrong prompt), or if the plugin's algorithm, found
    through its entry point inside the trainer actor, did not train the policy (GRPO's step in its
    place, or its loss and kept-answer count lost on the way to metrics.jsonl)."""
    from hpref.recipe import recipe_from_dict
    from hpref.rl.launch import run_rl

    server, token = served
    run_dir = tmp_path / "remote"
    rl = {
        "num_rollouts": 2,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6, "eval_prompts": 3},
        "reward": {"name": "remote", "url": f"{server.url}/v1/score", "token_file": str(token)},
        "defaults": {"model": TINY, "lr": 1e-3},
        "policies": {"a": {"algorithm": {"name": "best-of-n", "top": 1}}},
        "eval_interval": 2,
        "save_interval": 2,
    }
    recipe = recipe_from_dict({"run": {"name": run_dir.name, "output_dir": str(tmp_path)}, "rl": rl})
    assert run_rl(recipe, ["a"], None, None) == 0

    rows = [json.loads(x) for x in (run_dir / "metrics" / "a.jsonl").read_text().splitlines()]
    train = [r for r in rows if not r.get("eval")]
    assert [r["rollout"] for r in train] == [0, 1]
    for row in train:
        # best-of-n keeps each prompt's best answer (top = 1): 2 prompts, 2 answers trained on;
        # `kept_answers` is the plugin's own metric, and GRPO's clipped ratio never ran
        assert row["kept_answers"] == 2.0 and math.isfinite(row["loss"]) and row["loss"] > 0
        assert "clip_fraction" not in row and math.isfinite(row["reward_mean"])
    (evaluation,) = [r for r in rows if r.get("eval")]

    # every greedy eval answer, the policy's and its start's, carries the reward the run got for it:
    # the server's score of that answer to that prompt
    answers = run_dir / "metrics" / "eval_answers" / "rollout-000002.jsonl"
    logged = [json.loads(x) for x in answers.read_text().splitlines()]
    assert sorted(r["player"] for r in logged) == ["a"] * 3 + ["a@start"] * 3
    for row in logged:
        [score] = served_scores(server, row["prompt"], [row["answer"]])
        assert row["reward"] == pytest.approx(score, abs=1e-5), row
    assert len({round(r["reward"], 4) for r in logged}) > 1  # the scores differ: a constant would not pass
    mine = [r["reward"] for r in logged if r["player"] == "a"]
    assert evaluation["eval_reward"] == pytest.approx(sum(mine) / len(mine), abs=1e-6)
