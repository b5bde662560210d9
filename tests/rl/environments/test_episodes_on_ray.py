"""Episodes through the rest of `hpref rl` on the suite's Ray cluster (#49 points 7 and 8, #50 point
6): the example plugin's environments, named in the recipe and found by the actors through its entry
point. The module's run is two policies in ONE episode (`guess-number-duel`: a GRPO leader guesses
the number a follower on the plugin's `best-of-n` keeps): a stop whose save holds prefetched joint
episodes and its resume, equal bit for bit to the run never stopped; `hpref save --policy b` of the
second role's policy; TensorBoard's episode figures. A shared base runs the one-role `guess-number`
(each policy its own episodes), its later turns through the shared engine's batched requests. Tiny
models, 2-4 rollouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("ray")

import torch  # noqa: E402

from hpref.recipe import recipe_from_dict  # noqa: E402
from hpref.rl import launch  # noqa: E402
from hpref.rl.control.record import read_record  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402

pytestmark = pytest.mark.slow

ROLLOUTS, STOP = 4, 2
#: the example plugin's environments (plugins/hpref-example): one role, each policy its own episodes
GUESS = {"name": "guess-number", "high": 8, "max_guesses": 3, "max_turns": 3, "max_context_tokens": 256}
#: two roles: a keeper (policy b) picks the number, a guesser (policy a) guesses it, zero-sum
DUEL = {**GUESS, "name": "guess-number-duel", "roles": {"guesser": "a", "keeper": "b"}}
#: what a row holds of the clock, the machine or the process: never equal across two runs
TIMED = (
    "elapsed_s", "gen_tokens_per_s", "train_s", "train_tokens_per_s", "train_mfu", "trainer_peak_rss_gib",
)  # fmt: skip


def recipe(run_dir: Path, **rl_over):
    rl = {
        "num_rollouts": ROLLOUTS,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 4, "eval_prompts": 2},
        "reward": {"name": "rule"},  # read by no one: guess-number scores its episodes itself
        "environment": DUEL,
        "defaults": {"model": TINY, "lr": 1e-2},
        "policies": {
            "a": {},
            "b": {"model": {"seed": 1}, "algorithm": {"name": "best-of-n", "top": 1}},
        },
        "staleness_limit": 1,  # a rollout prefetched while the one before it trains: what a save keeps
        "update_weights_interval": 1,
        "save_interval": 1,
        "keep_last": 0,  # every save: the follower's positions are compared where both runs saved one
        "eval_interval": ROLLOUTS,
    }
    rl.update(rl_over)
    run = {"name": run_dir.name, "output_dir": str(run_dir.parent)}
    return recipe_from_dict({"run": run, "rl": rl, "logging": {"loggers": ["tensorboard"]}}, resolve=False)


def run(rec, resume=None) -> None:
    """`run_rl` in this process, on the suite's Ray cluster."""
    assert launch.run_rl(rec, ["a", "b"], None, resume) == 0


def rows_of(run_dir: Path, policy: str, evals: bool = False) -> dict[int, dict]:
    """A policy's metrics rows by rollout (its training rows, or its eval rows), the timed fields out."""
    lines = (run_dir / "metrics" / f"{policy}.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return {
        r["rollout"]: {k: v for k, v in r.items() if k not in TIMED}
        for r in rows
        if bool(r.get("eval")) == evals
    }


def saves_by_position(run_dir: Path, policy: str) -> dict[int, Path]:
    """Each of the run's saves of `policy`, by the policy's position in it."""
    out = {}
    for save in sorted((run_dir / "checkpoints").glob("rollout-*")):
        state = json.loads((save / "executor" / "executor.json").read_text())
        out[state["positions"][policy]] = save / policy
    return out


def weights(save: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(save / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    """The run never stopped (`reference`), and the one stopped after leader rollout STOP (its record
    then kept in `stopped`) and resumed with `--resume auto` to the end (`resumed`)."""
    root = tmp_path_factory.mktemp("episodes-on-ray")
    reference, resumed = root / "reference", root / "resumed"
    run(recipe(reference))
    run(recipe(resumed, debug_exit_after_rollout=STOP))
    stopped = read_record(resumed)
    run(recipe(resumed), resume="auto")
    return {"reference": reference, "resumed": resumed, "stopped": stopped}


def test_a_stopped_episode_run_resumes_to_the_uninterrupted_one_bit_for_bit(runs):
    """Two policies in one episode (a guesses, b keeps the number): the save at the stop holds each
    policy's prefetched part of the joint episodes whole (the guesser's own-token masks, the keeper's
    one turn, the episode counts), the two policies within one rollout of each other (lockstep), and
    the resumed run ends where the reference did: the leader's final weights and every metrics row
    (its eval's too; the follower's rows where both runs trained that rollout, its weights where both
    saved it at one position) equal bit for bit. If this fails, a save lost an episode's masks (the
    resume then trained observations) or its counts, or a policy's part of a joint rollout its
    partner's prefetch played (replayed after the resume at the partner's newer weights), a resume
    replayed a joint rollout differently (the environment's seed, the turn seeds, a role's opening),
    a policy ran ahead of its partner, or best-of-n on episodes was not exact across a restore."""
    reference, resumed, stopped = runs["reference"], runs["resumed"], runs["stopped"]
    assert stopped.rollout_ids["a"] == STOP and read_record(resumed).rollout_ids["a"] == ROLLOUTS
    assert abs(stopped.rollout_ids["b"] - stopped.rollout_ids["a"]) <= 1  # lockstep (Driver.ahead)
    executor = json.loads((resumed / stopped.save_dir / "executor" / "executor.json").read_text())
    for policy in ("a", "b"):
        buffered = executor["buffered"][policy]
        assert [r["rollout_id"] for r in buffered][:1] == [stopped.rollout_ids[policy]], policy
        for data in buffered:
            episodes = data["episodes"]
            # a rollout none of whose episodes went past its first turn has no masks (all own tokens)
            masks = data["masks"] or [[1] * len(c) for c in data["completions"]]
            assert [len(m) for m in masks] == [len(c) for c in data["completions"]]
            # own tokens are the log-probs the engine gave; the observations between turns are 0s
            assert [sum(m) for m in masks] == [len(lp) for lp in data["logprobs"]]
            assert len(episodes["turns"]) == len(masks) and max(episodes["turns"]) <= 3
            assert all((t > 1) == (0 in m) for t, m in zip(episodes["turns"], masks, strict=True))
    # a joint rollout is played once for both: the save keeps it for each policy that has not taken it
    ids = {p: [r["rollout_id"] for r in executor["buffered"][p]] for p in ("a", "b")}
    played = set(ids["a"]) | set(ids["b"])
    assert all(ids[p] == sorted(r for r in played if r >= stopped.rollout_ids[p]) for p in ids), ids
    # the guesser guesses again after a hint; the keeper picks once per episode
    assert any(t > 1 for d in executor["buffered"]["a"] for t in d["episodes"]["turns"])
    assert all(t == 1 for d in executor["buffered"]["b"] for t in d["episodes"]["turns"])

    want, got = rows_of(reference, "a"), rows_of(resumed, "a")
    assert sorted(got) == list(range(ROLLOUTS)) and got == want
    assert rows_of(resumed, "a", evals=True) == rows_of(reference, "a", evals=True)
    want_b, got_b = rows_of(reference, "b"), rows_of(resumed, "b")
    # the follower keeps to the leader's pace, a rollout ahead or behind: how far it got is timing
    assert sorted(got_b) == list(range(len(got_b))) and len(got_b) >= stopped.rollout_ids["b"]
    common = sorted(set(want_b) & set(got_b))
    assert common and all(got_b[r] == want_b[r] for r in common)

    final = read_record(reference).save_dir
    ours, theirs = weights(resumed / read_record(resumed).save_dir / "a"), weights(reference / final / "a")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # the follower runs free, so which of its positions a save holds is the run's timing: its weights
    # are compared at every position both runs saved (benchmarks/chaos_rl.py's rule for a follower),
    # and every rollout it trained in both runs above (a weight that differed moved its loss)
    mine, ref = saves_by_position(resumed, "b"), saves_by_position(reference, "b")
    for position in set(mine) & set(ref):
        ours, theirs = weights(mine[position]), weights(ref[position])
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), position


def test_a_policy_trained_on_episodes_exports_with_hpref_save(runs, tmp_path):
    """`hpref save --policy b` of the reference run: a transformers causal LM whose weights are b's
    final save (the keeper, the second role of the joint episodes, trained by best-of-n), not its
    seeded start. Wrong if an rl save of a run whose policies meet in one episode did not export the
    second role's policy, or exported other weights (the first role's, the start)."""
    from transformers import AutoModelForCausalLM

    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig
    from hpref.save.export import save_export

    reference = runs["reference"]
    folder = save_export(reference, tmp_path / "b", policy="b")
    exported = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    saved = weights(reference / read_record(reference).save_dir / "b")
    start = build_policy_model(PolicyModelConfig(**TINY, seed=1))[0].state_dict()
    assert saved.keys() <= exported.keys()
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
    assert any(not torch.equal(start[k], v) for k, v in saved.items())  # trained


def test_tensorboard_receives_the_episode_figures(runs):
    """TensorBoard gets each policy's `turns_mean`, `truncated_share` and `success` at every rollout
    and its eval's success (`<policy>/eval/success`), the numbers of `metrics/<policy>.jsonl`. Wrong
    if the logger fan-out dropped the episode metrics a dashboard user watches."""
    from tests.train.logger_files import tensorboard_scalars

    reference = runs["reference"]
    scalars = tensorboard_scalars(reference / "tensorboard")
    for policy in ("a", "b"):
        rows, evals = rows_of(reference, policy), rows_of(reference, policy, evals=True)
        for key in ("turns_mean", "truncated_share", "success"):
            assert scalars[f"{policy}/{key}"] == pytest.approx({r: row[key] for r, row in rows.items()})
        assert scalars[f"{policy}/eval/success"] == pytest.approx(
            {r: row["eval_success"] for r, row in evals.items()}
        )
    # the guesser (a) guesses again after "higher" / "lower"; the keeper (b) picks once per episode
    assert max(scalars["a/turns_mean"].values()) > 1.0
    assert set(scalars["b/turns_mean"].values()) == {1.0}


def test_a_shared_base_plays_both_policies_episodes_through_batched_requests(ray_cluster, tmp_path):
    """Two LoRA policies of one tiny base on one shared engine (`share_base = true`), one-role
    guess-number episodes (each policy its own, so both act in every round; the module's only
    one-role run on Ray): the run ends, both policies' rows show several turns per episode, and
    the engine got later turns as `generate_batch` requests holding the episodes' token contexts
    under each policy's adapter, both policies' in one call. The executor runs in this process
    over the Ray engine, so its requests can be read. Wrong if a later turn went out without its
    adapter (the base answered, or the other policy's adapter), one engine call per episode or
    policy, or re-encoded text instead of the episode's tokens."""
    from hpref.rl.rollout.executor import RolloutExecutor
    from tests.rl.local_actor import LocalActor

    batches: list[list[tuple[str | None, bool, int]]] = []

    class Recorded:
        """The shared engine's handle as the executor holds it: each `generate_batch` noted."""

        def __init__(self, handle):
            self.handle = handle

        def __getattr__(self, name):
            return getattr(self.handle, name)

        @property
        def generate_batch(self):
            handle = self.handle

            class Method:
                @staticmethod
                def remote(requests):
                    batches.append([(r.adapter, r.contexts is not None, len(r.prompts)) for r in requests])
                    return handle.generate_batch.remote(requests)

            return Method

    real_create = launch.create_ray_actors

    def create(config, order, *args, **kwargs):
        handles = real_create(config, order, *args, **kwargs)
        from hpref.rl.placement.shared_base import engine_of

        engine = Recorded(engine_of(handles.engines[order[0]]))
        local = LocalActor(RolloutExecutor(config, order, {p: engine for p in order}))
        # named as the actor it stands in for (none: the executor it replaces ran in this process)
        local._actor_id = getattr(handles.executor, "_actor_id", None)
        handles.executor = local
        return handles

    lora = {"r": 4}
    rec = recipe(
        tmp_path / "shared",
        num_rollouts=2,
        share_base=True,
        environment=GUESS,
        eval_interval=0,
        defaults={"model": TINY, "lr": 1e-2, "lora": lora},
        policies={"a": {}, "b": {"lr": 5e-3}},
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "create_ray_actors", create)
        assert launch.run_rl(rec, ["a", "b"]) == 0
    for policy in ("a", "b"):
        rows = rows_of(tmp_path / "shared", policy)
        assert rows and all(row["turns_mean"] > 1.0 for row in rows.values()), rows
    later = [b for b in batches if any(has_context for _, has_context, _ in b)]
    assert later and all(adapter in ("a", "b") for b in later for adapter, _, _ in b)
    # both policies' later turns in one engine call: the batcher's whole point on a shared base
    assert any({adapter for adapter, has_context, _ in b if has_context} == {"a", "b"} for b in later)
