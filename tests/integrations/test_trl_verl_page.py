"""docs/trl-verl.md's snippets run as written: the TRL ones with a tiny policy, a tiny dataset and
the tiny exports at `exports/judge` and `exports/reward`, the verl config lines through verl's own
`load_reward_manager`. (The served snippet runs against the serve tests' server, in
tests/serve/test_server.py.)"""

from __future__ import annotations

import pytest

from .conftest import PAGE, snippets, tiny_policy


@pytest.fixture
def exports_here(tiny_exports, tmp_path, monkeypatch):
    """The working directory a user runs the snippets from: `exports/judge`, `exports/reward`."""
    (tmp_path / "exports").mkdir()
    for kind, folder in tiny_exports.items():
        (tmp_path / "exports" / kind).symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _logged(history: list[dict], key: str) -> list[float]:
    return [entry[key] for entry in history if key in entry]


@pytest.mark.slow
def test_the_trl_snippets_train_and_trl_logs_the_hpref_values(exports_here, monkeypatch):
    """Both TRL snippets, pasted into a script that has `model`, `tokenizer` and `dataset`, run two
    real steps of `GRPOTrainer` and `OnlineDPOTrainer`: TRL logs as `rewards/hpref_reward/mean` the
    mean of what the hpref reward returned (the export's own scores of those completions), and as
    `objective/scores` 0.5 and `objective/scores_margin` the mean |p_first - p_second| the judge
    gave (so TRL's chosen side is the judge's). Wrong if a snippet no longer runs (a renamed import,
    argument or TRL interface), values were misassigned, or the judge's never reached the trainer.
    This machine has no GPU: trainer arguments get `use_cpu=True, bf16=False`, as a CPU user sets
    them (TRL defaults to bf16, which transformers refuses without a GPU)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import TrainingArguments

    from hpref.integrations.trl import HprefReward, _PairwiseJudge

    post_init, reward_call, judged = (
        TrainingArguments.__post_init__,
        HprefReward.__call__,
        _PairwiseJudge.probabilities,
    )
    rewarded: list[tuple[list, list, list[float]]] = []
    verdicts: list[list[tuple[float, float, float]]] = []

    def on_cpu(self):
        self.use_cpu, self.bf16 = True, False
        post_init(self)

    def recorded_reward(self, prompts, completions, **kwargs):
        rewarded.append((list(prompts), list(completions), reward_call(self, prompts, completions, **kwargs)))
        return rewarded[-1][2]

    def recorded_verdicts(self, prompts, completions):
        verdicts.append(judged(self, prompts, completions))
        return verdicts[-1]

    monkeypatch.setattr(TrainingArguments, "__post_init__", on_cpu)
    monkeypatch.setattr(HprefReward, "__call__", recorded_reward)
    monkeypatch.setattr(_PairwiseJudge, "probabilities", recorded_verdicts)

    dataset = Dataset.from_dict({"prompt": ["What is 12 + 30?", "Name a colour.", "Say hi.", "Count to 3."]})
    logs = []
    for code in snippets("trl"):
        model, tokenizer = tiny_policy()
        namespace = {"model": model, "tokenizer": tokenizer, "dataset": dataset}
        exec(compile(code, str(PAGE), "exec"), namespace)
        logs.append(namespace["trainer"].state.log_history)
    grpo, online_dpo = logs

    assert len(rewarded) == 2  # one generation batch per step
    means = [sum(rewards) / len(rewards) for _, _, rewards in rewarded]
    assert _logged(grpo, "rewards/hpref_reward/mean") == pytest.approx(means, abs=1e-5)
    from hpref.builtin.scoring import ExportScorer

    scorer = ExportScorer.load("exports/reward")
    for prompts, completions, rewards in rewarded:
        assert len(set(prompts)) == 2 and len(prompts) == 4  # two prompts, groups of num_generations
        pairs = zip(prompts, completions, strict=True)
        assert rewards == pytest.approx(
            [scorer.score_groups([(p,)], [[c]])[0][0] for p, c in pairs], abs=1e-5
        )

    steps = verdicts[-2:]  # the snippet's own two calls come first, then one per training step
    assert len(verdicts) == 4 and all(len(step) == 2 for step in steps)
    margins = [sum(abs(p[0] - p[1]) for p in step) / len(step) for step in steps]
    assert _logged(online_dpo, "objective/scores") == pytest.approx([0.5, 0.5], abs=1e-6)
    assert _logged(online_dpo, "objective/scores_margin") == pytest.approx(margins, abs=1e-6)
    assert min(margins) > 0.0


def test_the_verl_config_lines_load_the_hpref_reward_in_verls_manager(exports_here):
    """The page's verl command-line overrides, read as verl's Hydra reads them, make verl's
    `load_reward_manager` score a response with the reward export, the prompt taken from
    `extra_info["question"]`. Wrong if the documented path, function name or keyword were wrong."""
    pytest.importorskip("verl")
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import load_reward_manager

    from hpref.integrations.verl import backend_for

    from .test_verl import QUESTIONS, REFERENCES, RESPONSES, verl_batch

    [command] = snippets("verl")
    overrides = [word.lstrip("+") for word in command.split() if "=" in word]
    config = OmegaConf.merge(
        OmegaConf.create({"reward": {"reward_manager": {"source": "register", "name": "naive"}}}),
        OmegaConf.from_dotlist(overrides),
    )
    _, tokenizer = tiny_policy()
    data, _ = verl_batch(tokenizer, RESPONSES, REFERENCES)
    manager = load_reward_manager(config, tokenizer)
    got = manager.loop.run_until_complete(manager.run_single(data[:1]))["reward_score"]
    [[want]] = backend_for(export="exports/reward").score_groups([(QUESTIONS[0],)], [[RESPONSES[0]]])
    assert got == pytest.approx(want, abs=1e-5)


def test_the_recipe_lines_are_valid_dataset_and_prompt_settings():
    """The page's TOML is a `[dataset.train]` and an `[rl.prompts]` section their components accept
    (path, hf_split). Wrong if a key the page names were not a setting of the readers."""
    import tomllib

    from hpref.plugins import load_plugins

    [text] = snippets("recipe")
    sections = tomllib.loads(text)
    plugins = load_plugins()
    for kind, section in (("dataset", sections["dataset"]["train"]), ("prompts", sections["rl"]["prompts"])):
        settings = {k: v for k, v in section.items() if k != "name"}
        config = plugins.get(kind, section["name"]).config(**settings)
        assert (config.path, config.hf_split) == (settings["path"], settings["hf_split"])
