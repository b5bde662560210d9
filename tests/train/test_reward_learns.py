"""The scalar reward model end to end: it learns a chosen/rejected task with an obvious signal,
`hpref eval` scores it (swap TTA a no-op), `hpref save` exports a transformers sequence classifier
whose scores reproduce hpref's predictions, and a killed run resumes to the same losses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from .test_learns_pairwise import write_pairs

RECIPE = """
[run]
name = "{name}"
output_dir = "{output_dir}"
seed = 0

[model]
name = "tiny-llama"
head = "reward"
hidden_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
intermediate_size = 128
vocab_size = 512
tokenizer_texts = 500

[dataset.train]
name = "pairwise"
path = "{train}"
folds = 1
split = "all"

[dataset.eval]
name = "pairwise"
path = "{eval}"
folds = 1
split = "all"

[formatter]
name = "answers"

[optimizer]
lr = 3e-3
betas = [0.9, 0.99]

[scheduler]
name = "linear"
warmup_fraction = 0.1

[train]
epochs = 2
batch_size = 8
max_length = 64
micro_batch_tokens = 1024
swap = "none"
precision = "fp32"
log_interval = 1
checkpoint_interval = 10
"""


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pairs")
    return write_pairs(folder / "train.jsonl", 128, seed=0), write_pairs(folder / "eval.jsonl", 64, seed=1)


def write_recipe(folder: Path, pairs, name: str = "reward") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    text = RECIPE.format(
        name=name,
        output_dir=(folder / "runs").as_posix(),
        train=pairs[0].as_posix(),
        eval=pairs[1].as_posix(),
    )
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory, pairs):
    from hpref.train import run_train

    folder = tmp_path_factory.mktemp("reward")
    assert run_train(write_recipe(folder, pairs), nproc_per_node=1) == 0
    return folder / "runs" / "reward"


def test_reward_model_learns_an_obvious_preference(reward_run):
    """Chosen says 'I love X', rejected 'I hate X': a reward model that scores each answer must
    separate them (a constant score sits at ln 2 and 0.5 accuracy)."""
    from hpref.train.metrics import read_metrics

    records = read_metrics(reward_run / "metrics.jsonl")
    losses = [r["step_loss"] for r in records if r["kind"] == "train"]
    final = [r for r in records if r["kind"] == "eval"][-1]
    assert len(losses) == 32
    assert losses[0] == pytest.approx(math.log(2), abs=0.05)  # P(tie) ~ 0 from step 0: prior-initialised nu
    assert sum(losses[-8:]) / 8 < 0.5 * math.log(2), losses
    assert final["eval_accuracy"] >= 0.9 and final["eval_log_loss"] < 0.35, final


def test_hpref_eval_scores_it_and_swap_tta_changes_nothing(reward_run, tmp_path, log_messages):
    """`hpref eval` on the run folder gives the training eval's numbers; `--tta swap` is a no-op (a
    reward model is symmetric by construction), said in one log line, not twice the compute."""
    from hpref.evaluate.command import EvalRequest, eval_command
    from hpref.prediction.files import read_predictions

    recipe = reward_run / "recipe.toml"
    assert eval_command(EvalRequest(recipe, checkpoint=reward_run, out=tmp_path / "a.csv")) == 0
    assert eval_command(EvalRequest(recipe, checkpoint=reward_run, out=tmp_path / "b.csv", tta="swap")) == 0
    a, b = read_predictions(tmp_path / "a.csv"), read_predictions(tmp_path / "b.csv")
    np.testing.assert_array_equal(a.probs, b.probs)
    metrics = json.loads((tmp_path / "b.metrics.json").read_text())
    assert metrics["sequences"] == 64 and metrics["accuracy"] >= 0.9
    assert any("symmetric" in m for m in log_messages)
    trained = np.loadtxt(reward_run / "predictions.csv", delimiter=",", skiprows=1, usecols=(1, 2, 3))
    np.testing.assert_allclose(a.probs, trained, atol=2e-6)


@pytest.fixture(scope="module")
def reward_export(reward_run, tmp_path_factory):
    """`hpref save` of the trained run: the folder other tools are handed."""
    from hpref.save.command import SaveRequest, save_command

    export = tmp_path_factory.mktemp("export") / "reward"
    assert save_command(SaveRequest(reward_run, to=export)) == 0
    return export


def eval_pairs(reward_run, tokenizer):
    """The run's eval battles through hpref's own formatter: (chosen ids, rejected ids) per battle,
    and hpref's eval margin log P(chosen) - log P(rejected) = s_chosen - s_rejected (Davidson's
    model) from the run's predictions.csv."""
    from hpref.data.formatting import AnswersConfig, AnswersFormatter
    from hpref.plugins import load_plugins
    from hpref.prediction.files import read_predictions
    from hpref.recipe import load_recipe

    recipe = load_recipe(reward_run / "recipe.toml")
    source = load_plugins().get("dataset", "pairwise").build(recipe.dataset.eval.config, recipe.run.seed)
    battles = list(source.battles())
    formatter = AnswersFormatter(AnswersConfig(), tokenizer, recipe.train.max_length)
    probs = read_predictions(reward_run / "predictions.csv").probs
    chosen, rejected, margins = [], [], []
    for battle, encoded, p in zip(battles, formatter.encode_many(battles), probs, strict=True):
        a, b = encoded.ids[: encoded.split], encoded.ids[encoded.split :]
        a_won = battle.label[0] > battle.label[1]
        chosen.append(a if a_won else b)
        rejected.append(b if a_won else a)
        margins.append(math.log(p[0] / p[1]) * (1 if a_won else -1))
    return chosen, rejected, np.array(margins)


def test_trl_reward_trainer_evaluates_the_export_with_hprefs_scores(reward_export, reward_run, tmp_path):
    """TRL's own `RewardTrainer` (1.16: `AutoModelForSequenceClassification` with num_labels 1 from
    the folder, right-padded batches) evaluating the export on the run's eval pairs gives each pair
    the margin s_chosen - s_rejected that hpref's eval gave (1e-4), hence hpref's accuracy and
    Bradley-Terry loss. If this fails, the README's "TRL loads it" hands TRL users another model."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_export)
    chosen, rejected, margins = eval_pairs(reward_run, tokenizer)
    pairs = Dataset.from_dict({"chosen_ids": chosen, "rejected_ids": rejected})
    args = trl.RewardConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_eval_batch_size=len(chosen),  # one batch: predictions are [chosen..., rejected...]
        use_cpu=True,
        bf16=False,
        report_to=[],
        max_length=None,
        disable_tqdm=True,
    )
    trainer = trl.RewardTrainer(
        model=str(reward_export),
        args=args,
        train_dataset=pairs,
        eval_dataset=pairs,
        processing_class=tokenizer,
    )
    scores = np.asarray(trainer.predict(pairs).predictions).reshape(-1)
    assert scores.shape == (2 * len(chosen),)
    trl_margins = scores[: len(chosen)] - scores[len(chosen) :]
    np.testing.assert_allclose(trl_margins, margins, atol=1e-4)
    metrics = trainer.evaluate()
    summary = json.loads((reward_run / "summary.json").read_text())
    assert metrics["eval_accuracy"] == pytest.approx(summary["eval_accuracy"], abs=1e-9)
    bt_loss = float(np.mean(np.log1p(np.exp(-margins))))
    assert metrics["eval_loss"] == pytest.approx(bt_loss, abs=1e-4)


class OpenRLHFRewardModel:
    """OpenRLHF's reward-model loading path, step by step, as `openrlhf/models/model.py`
    (`get_llm_for_sequence_regression(path, "reward")` and `_get_reward_model`) does it at commit
    3c3be6234e0cb353e76bb8019947db9dfe99fca7 (version 0.11.0, August 2026). OpenRLHF itself cannot be
    installed here (it imports deepspeed, flash-attn and vLLM at module level), so the test repeats
    its steps: `AutoConfig` of the folder; the value head's name from `config.value_head_prefix`,
    else "score"; the base class `AutoModel._model_mapping[type(config)]` under the attribute
    `base_model_prefix` of its pretrained-model parent class, with a bias-free `Linear(hidden, 1)` as
    the value head, filled by `from_pretrained`; the forward: position ids from the attention mask's
    cumulative sum (padding at 1), the value head on every token, the reward read at the last token
    whose mask is 1; `normalize_reward` off (no mean/std in the config)."""

    @staticmethod
    def load(folder):
        from torch import nn
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.from_pretrained(folder)
        config.normalize_reward = False
        prefix = getattr(config, "value_head_prefix", "score")
        base = AutoModel._model_mapping[type(config)]

        class RewardModel(base.__base__):
            def __init__(self, config):
                super().__init__(config)
                setattr(self, self.base_model_prefix, base(config))
                setattr(self, prefix, nn.Linear(config.hidden_size, 1, bias=False))
                self.post_init()

            def forward(self, input_ids, attention_mask):
                last = attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1, keepdim=True)
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids.masked_fill_(attention_mask == 0, 1)
                hidden = getattr(self, self.base_model_prefix)(
                    input_ids, attention_mask=attention_mask, position_ids=position_ids
                )["last_hidden_state"]
                values = getattr(self, prefix)(hidden).squeeze(-1)
                return values.gather(dim=1, index=last).squeeze(1)

        # OpenRLHF loads in bf16 by default (`param_dtype`); fp32 here, to compare scores at 1e-4
        return RewardModel.from_pretrained(
            folder, config=config, dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
        )


@pytest.mark.parametrize("side", ["right", "left"])
def test_openrlhf_loading_steps_give_hprefs_scores(reward_export, reward_run, side):
    """OpenRLHF's reward-model loading steps (`OpenRLHFRewardModel`) on the export: every weight
    found (no missing key, none unused), and on the eval pairs padded into one batch (left or right,
    as OpenRLHF pads either way) the margins of hpref's eval (1e-4). If this fails, the README's
    "OpenRLHF loads it" is false for a decoder's reward model, the one pooling OpenRLHF reads."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_export)
    model, info = OpenRLHFRewardModel.load(reward_export)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    chosen, rejected, margins = eval_pairs(reward_run, tokenizer)
    seqs = chosen + rejected
    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        where = slice(0, len(s)) if side == "right" else slice(longest - len(s), longest)
        ids[i, where], mask[i, where] = torch.tensor(s), 1
    with torch.no_grad():
        rewards = model(ids, mask).numpy()
    np.testing.assert_allclose(rewards[: len(chosen)] - rewards[len(chosen) :], margins, atol=1e-4)


def test_saved_reward_model_is_a_transformers_sequence_classifier(reward_run, tmp_path):
    """`hpref save` -> AutoModelForSequenceClassification (num_labels 1) scores each answer alone;
    Davidson's probabilities from those scores and the saved nu reproduce hpref's predictions. If
    not, TRL / OpenRLHF would load a different reward model from the one hpref evaluated."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hpref.data.formatting import AnswersConfig, AnswersFormatter
    from hpref.plugins import load_plugins
    from hpref.prediction.files import read_predictions
    from hpref.recipe import load_recipe
    from hpref.save.command import SaveRequest, save_command

    export = tmp_path / "export"
    assert save_command(SaveRequest(reward_run, to=export)) == 0
    info = json.loads((export / "hpref_model.json").read_text())
    hf = AutoModelForSequenceClassification.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert hf.config.num_labels == 1 and info["head"] == "reward" and info["tie_log_nu"] < -5
    recipe = load_recipe(reward_run / "recipe.toml")
    source = load_plugins().get("dataset", "pairwise").build(recipe.dataset.eval.config, recipe.run.seed)
    battles = list(source.battles())
    formatter = AnswersFormatter(AnswersConfig(), tokenizer, recipe.train.max_length)
    probs = []
    with torch.no_grad():
        for e in formatter.encode_many(battles):
            a = hf(input_ids=torch.tensor([e.ids[: e.split]])).logits[0, 0]
            b = hf(input_ids=torch.tensor([e.ids[e.split :]])).logits[0, 0]
            logits = torch.stack([a, b, info["tie_log_nu"] + (a + b) / 2])
            probs.append(torch.softmax(logits, dim=0).tolist())
    hpref_probs = read_predictions(reward_run / "predictions.csv").probs
    np.testing.assert_allclose(np.array(probs), hpref_probs, atol=1e-4)


def test_killed_reward_run_resumes_to_the_same_losses(reward_run, pairs, tmp_path):
    """Killed after step 15 and resumed from its step-10 checkpoint, the run follows the uninterrupted
    one (1e-6): the reward head and its tie parameter are checkpointed and restored like a judge's."""
    from hpref.train import run_train

    from ..conftest import run_hpref
    from .conftest import train_losses

    recipe = write_recipe(tmp_path, pairs)
    # the killed run in its own process, as a real crash is
    crashed = run_hpref("train", str(recipe), env={"HPREF_DEBUG_CRASH_AFTER_STEP": "15"}, timeout=300)
    assert crashed.returncode != 0, crashed.stderr
    assert run_train(recipe, nproc_per_node=1, resume="auto") == 0
    resumed, reference = train_losses(tmp_path / "runs" / "reward"), train_losses(reward_run)
    assert sorted(resumed) == sorted(reference)
    for step in reference:
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (['formatter.name="pab"'], "formatter.name"),
        (['train.swap="full"'], "train.swap"),
        (['model.head="judge"', 'train.swap="none"'], "formatter.name"),
    ],
)
def test_recipe_check_refuses_a_reward_model_with_a_judge_input(pairs, tmp_path, overrides, key):
    """A reward model fed judge sequences would pair unrelated sequences; a judge fed answer pairs
    would give two verdicts per battle; swap on a reward model doubles compute for nothing."""
    from hpref.errors import RecipeError
    from hpref.recipe import load_recipe
    from hpref.train.checks import check_train

    recipe = load_recipe(write_recipe(tmp_path, pairs), overrides)
    with pytest.raises(RecipeError, match=key):
        check_train(recipe, machine=False)
