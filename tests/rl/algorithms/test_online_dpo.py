"""Online DPO in `hpref rl` (`algorithm = "online-dpo"`, `hpref.rl.algorithms.online_dpo`): the pairs and
verdicts a rollout carries, the trainer's DPO step on them, the refusals, and a real two-policy run on Ray
with a cross-policy policy, stopped and resumed."""

from __future__ import annotations

import json
import math

import pytest

from hpref.errors import RecipeError
from hpref.recipe import recipe_from_dict
from hpref.recipe.rl import parse_rl_section
from hpref.rl.algorithms.registry import check_algorithms
from hpref.rl.rollout.pairing import judged_pairs
from hpref.rl.rollout_types import rollout_of_tokens
from tests.rl.tiny import TINY

torch = pytest.importorskip("torch")


class LengthJudge:
    """The shorter answer is preferred 0.7 : 0.1 (tie 0.2); equal lengths are a sure tie."""

    def judge_answers(self, prompts, pairs):
        out = []
        for a, b in pairs:
            out.append(
                (0.0, 0.0, 1.0)
                if len(a) == len(b)
                else (0.7, 0.1, 0.2)
                if len(a) < len(b)
                else (0.1, 0.7, 0.2)
            )
        return out


def test_judged_pairs_pair_a_group_two_by_two_or_each_answer_against_a_rival():
    # Wrong if online DPO trained on pairs of answers to different prompts, lost an answer's
    # reward, or scored a tie as a coin flip
    prompts = [("p",), ("q",)]
    groups = [["a", "bbb", "cc", "cc"], ["dd", "e", "ff", "g"]]
    pairs, verdicts, opponents, rewards, _ = judged_pairs(LengthJudge(), prompts, groups)
    assert pairs == [(0, 1), (2, 3), (4, 5), (6, 7)] and opponents == []
    assert verdicts[1] == (0.0, 0.0, 1.0)  # "cc" vs "cc": a tie stays a tie
    assert rewards == pytest.approx([0.8, 0.2, 0.5, 0.5, 0.2, 0.8, 0.2, 0.8])
    judged = judged_pairs(LengthJudge(), prompts, groups, [["xx", "y"], ["zzzz"]], None, [["b", "c"], ["c"]])
    pairs, verdicts, opponents, rewards, owners = judged
    # each answer against the prompt's rivals in turn; opponent rows follow the policy's 8 rows
    assert pairs == [(i, 8 + i) for i in range(8)]
    assert opponents == ["xx", "y", "xx", "y", "zzzz", "zzzz", "zzzz", "zzzz"]
    assert rewards[0] == pytest.approx(0.8) and rewards[1] == pytest.approx(0.2)  # "a" < "xx", "bbb" > "y"
    # the live leaderboard's matches: each cross pair once, against the rival's own policy
    assert owners == ["b", "c", "b", "c", "c", "c", "c", "c"]
    assert judged.matches("a", 8) == [
        ("a", o, v[0] + 0.5 * v[2]) for o, v in zip(owners, verdicts, strict=True)
    ]
    assert judged.matches("a", 8)[0] == ("a", "b", pytest.approx(rewards[0]))  # its one pair: its reward


def _config(algorithm, **over):
    data = {
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 4},
        "defaults": {"model": TINY, "lr": 1e-2, "algorithm": algorithm},
        "policies": {"a": {}, "b": {"model": {"seed": 1}}},
    }
    data.update(over)
    return parse_rl_section(data, "test")


PROMPTS = [[1, 5, 6, 7, 3]] * 2 + [[1, 8, 3, 4]] * 2 + [[1, 9, 10, 3, 4, 5]] * 2
ANSWERS = [[20, 21], [22], [23, 24, 25], [26], [27, 28], [29, 30, 31, 2]]
VERDICTS = [(1.0, 0.0, 0.0), (0.0, 0.0, 1.0), (0.1, 0.8, 0.1)]  # a win, a tie, a soft loss


def _rollout(rollout_id, **fields):
    judged = {"pairs": [(0, 1), (2, 3), (4, 5)], "verdicts": VERDICTS, **fields}
    return rollout_of_tokens(
        rollout_id, PROMPTS, ANSWERS, [[-1.0] * len(c) for c in ANSWERS], [0.5] * 6, 2, **judged
    )


def test_an_online_dpo_step_is_the_dpo_loss_whatever_the_micro_batching_and_learns_the_verdicts(monkeypatch):
    """The first step's loss is the Davidson DPO loss at equal rewards (policy = reference: every
    outcome 1/3, so ln 3 per pair); the step is the same whether the pairs are packed (a prompt once)
    in one batch or two, or padded row by row (a pair is never split); and the next step
    finds the chosen answers' implicit rewards above the rejected ones'. Wrong if the pairs' rows,
    their targets or the reference were mixed up."""
    import hpref.rl.trainer.actor as trainer_module
    from hpref.rl.trainer.actor import TrainerActor

    def stepped(budget, share):
        monkeypatch.setattr(trainer_module, "shares_prefix", lambda model: share)
        cfg = _config(
            {"name": "online-dpo", "beta": 1.0},
            defaults={
                "model": TINY,
                "lr": 1e-2,
                "algorithm": {"name": "online-dpo", "beta": 1.0},
                "micro_batch_tokens": budget,
            },
        )
        trainer = TrainerActor("a", cfg.policies["a"], 1)
        return trainer, trainer.train(_rollout(0))

    trainer, first = stepped(4096, True)
    assert first["loss"] == pytest.approx(math.log(3.0), abs=1e-5)
    assert first["rewards_margin"] == pytest.approx(0.0, abs=1e-6) and first["kl"] == pytest.approx(
        0.0, abs=1e-6
    )
    weights = trainer.model.state_dict()
    for budget, share in ((16, True), (4096, False), (16, False)):
        other, stats = stepped(budget, share)
        # at 16 tokens: packed pairs of 6, 6 and 10 tokens (a prompt once, its answers' inputs) fill
        # two micro-batches; padded rows of 6-10 tokens each pair alone
        assert stats["micro_batches"] == ((2 if share else 3) if budget == 16 else 1)
        assert stats["loss"] == pytest.approx(first["loss"], abs=1e-6)
        for key, value in other.model.state_dict().items():
            torch.testing.assert_close(value, weights[key], atol=1e-5, rtol=1e-5)
    second = trainer.train(_rollout(1))
    assert second["loss"] < first["loss"]
    assert second["rewards_margin"] > 0 and second["rewards_accuracy"] == 1.0 and second["kl"] > 0


def test_cross_policy_pairs_read_the_rivals_answer_in_the_policys_own_tokens():
    # Wrong if an opponent's answer were trained on in another tokenizer's ids, or without the eos
    # a sampled answer ends with
    from hpref.models.causal_lm import policy_tokenizer
    from hpref.rl.algorithms.registry import build_algorithm

    cfg = _config({"name": "online-dpo", "pairs": "cross"})
    tokenizer = policy_tokenizer(cfg.policies["a"].model)
    rollout = _rollout(0, pairs=[(0, 6), (1, 7)], verdicts=VERDICTS[:2], opponent_texts=["the sea", "a cat"])
    rows = build_algorithm("a", cfg.policies["a"]).prepare(rollout, tokenizer)
    assert rows.group == 2 and rows.whole_groups and rows.behaviour is None and rows.temperature == 1.0
    assert rows.prompts == [PROMPTS[0]] * 4
    assert rows.completions[0] == ANSWERS[0]
    assert rows.completions[1] == tokenizer.encode("the sea", add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]
    assert rows.values["targets"].tolist() == [list(v) for v in VERDICTS[:2]]
    assert rows.values["own"].tolist() == [True, False, True, False]  # KL is measured on its own answers


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"defaults": {"algorithm": "online-dop"}},
            "rl.policies.a.algorithm.name: unknown algorithm 'online-dop'",
        ),
        (
            {"defaults": {"algorithm": {"name": "online-dpo", "loss_type": "ipo", "label_smoothing": 0.1}}},
            "IPO",
        ),
        (
            {"defaults": {"trainer_backend": "deepspeed"}},
            "rl.policies.a.trainer_backend: unknown trainer_backend",
        ),
    ],
)
def test_a_bad_algorithm_setting_is_one_line_naming_the_key(over, message):
    data = {"policies": {"a": {}}, **over}
    with pytest.raises(RecipeError, match=message.replace("(", r"\(")):
        parse_rl_section(data, "test")


def test_online_dpo_refuses_what_it_cannot_pair_or_judge_before_any_actor_starts():
    # Wrong if a run started that would split no pairs, pair with nobody, or ask a reward for
    # verdicts it cannot give — each would fail (or quietly train on something else) mid-run
    odd = _config("online-dpo", rollout={"group_size": 3})
    with pytest.raises(RecipeError, match="rl.policies.a.algorithm: .*group_size is 3; make it even"):
        check_algorithms(odd, ["a"], "test")
    cross = _config({"name": "online-dpo", "pairs": "cross"})
    check_algorithms(cross, ["a", "b"], "test")
    with pytest.raises(RecipeError, match="algorithm.pairs: 'cross' .* only 'a' runs"):
        check_algorithms(cross, ["a"], "test")
    remote = _config("online-dpo", reward={"name": "remote", "url": "http://127.0.0.1:9/score"})
    with pytest.raises(RecipeError, match="reward 'remote' does not judge pairs"):
        check_algorithms(remote, ["a"], "test")
    check_algorithms(_config("grpo", rollout={"group_size": 3}), ["a"], "test")


def _recipe(run_dir, **rl_over):
    rl = {
        "num_rollouts": 2,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6, "eval_prompts": 4},
        "reward": {"name": "rule"},
        "defaults": {"model": TINY, "lr": 1e-3},
        "policies": {
            "a": {"algorithm": "online-dpo"},
            "b": {
                "model": {"seed": 1},
                "algorithm": {"name": "online-dpo", "pairs": "cross", "loss_type": "sigmoid"},
            },
        },
        "eval_interval": 2,
        "save_interval": 1,
    }
    rl.update(rl_over)
    return recipe_from_dict({"run": {"name": run_dir.name, "output_dir": str(run_dir.parent)}, "rl": rl})


@pytest.mark.slow
def test_two_online_dpo_policies_run_stop_and_resume_on_ray(ray_cluster, tmp_path):
    """The leader's coordination is the algorithm's too: a run stopped after rollout 1 and resumed
    trains each rollout once, b's pairs are judged against a's answers, and the DPO metrics and the
    evals reach metrics.jsonl."""
    from hpref.rl.control.record import read_record
    from hpref.rl.launch import run_rl

    run_dir = tmp_path / "dpo"
    assert run_rl(_recipe(run_dir, debug_exit_after_rollout=1), ["a", "b"], None, None) == 0
    assert read_record(run_dir).rollout_ids["a"] == 1
    assert run_rl(_recipe(run_dir), ["a", "b"], None, "auto") == 0
    assert read_record(run_dir).rollout_ids["a"] == 2
    for policy in ("a", "b"):
        rows = [json.loads(x) for x in (run_dir / "metrics" / f"{policy}.jsonl").read_text().splitlines()]
        train = [r for r in rows if not r.get("eval")]
        assert [r["rollout"] for r in train][:2] == [0, 1]
        for row in train:
            for key in ("loss", "reward_mean", "judged_tie_share", "grad_norm"):
                assert math.isfinite(row[key]), (policy, key, row)
            assert 0.0 < row["judged_tie_share"] < 1.0  # the arena judge's Davidson ties, kept
        assert any(r.get("eval") and math.isfinite(r["eval_true_utility"]) for r in rows)
        # a pairs its own answers (2 prompts x 2 answers: 2 pairs); b each answer against one of a's
        pairs = {(r["judged_pairs"], r["cross_policy_pairs"]) for r in train}
        assert pairs == ({(2, 0)} if policy == "a" else {(4, 4)})
