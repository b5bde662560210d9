"""The supervised warm-up: its data, that it learns, that it is cached, and `hpref rl-warmup`."""

from __future__ import annotations

import json
import textwrap

import pytest

pytest.importorskip("torch")

from hpref import arena as synthetic  # noqa: E402
from hpref.builtin.prompts import SyntheticPrompts, SyntheticPromptsConfig  # noqa: E402
from hpref.models.causal_lm import encode_prompt, policy_tokenizer  # noqa: E402
from hpref.recipe.rl import PolicyModelConfig, WarmupConfig  # noqa: E402
from hpref.rl.engines.transformers_engine import EngineActor  # noqa: E402
from hpref.rl.warmup import supervised as warmup_mod  # noqa: E402
from tests.conftest import run_hpref  # noqa: E402
from tests.rl.tiny import TINY as TINY_SETTINGS  # noqa: E402

TINY = PolicyModelConfig(**TINY_SETTINGS)
QUICK = WarmupConfig(steps=60, batch_size=16, battles=300, warmup_steps=5, lr=1e-2)


def test_examples_are_engine_prompts_and_arena_answers():
    # Wrong if the warm-up taught answers in a position the engine never samples from, or left out
    # the eos the policy must learn to stop with.
    tok = policy_tokenizer(TINY)
    cfg = WarmupConfig(battles=20)
    examples = warmup_mod.sft_examples(tok, cfg)
    battles = list(synthetic.generate_battles(20, cfg.seed, max_turns=1, labels="soft"))
    assert len(examples) == 40  # both answers of every battle
    prompt_ids, answer_ids = examples[1]
    assert prompt_ids == encode_prompt(tok, battles[0].prompt)
    assert answer_ids[-1] == tok.eos_token_id
    assert tok.decode(answer_ids[:-1]) == battles[0].response_b[0]
    preferred = warmup_mod.sft_examples(tok, cfg.model_copy(update={"answers": "preferred"}))
    assert len(preferred) == 20
    first = battles[0]
    want = first.response_a[0] if first.truth[0] >= first.truth[1] else first.response_b[0]
    assert tok.decode(preferred[0][1][:-1]) == want


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    cfg = WarmupConfig(steps=100, warmup_steps=10)
    assert warmup_mod.lr_multiplier(0, cfg) == pytest.approx(0.1)
    assert warmup_mod.lr_multiplier(9, cfg) == pytest.approx(1.0)
    assert warmup_mod.lr_multiplier(10, cfg) == pytest.approx(1.0)
    assert warmup_mod.lr_multiplier(100, cfg) == pytest.approx(0.1)


def test_warmup_learns_is_cached_and_gives_text_answers(monkeypatch):
    # Wrong if the warm-up did not lower the loss, retrained on a second call (every run would pay
    # for it again), or left a checkpoint whose answers are no better than a random model's.
    folder = warmup_mod.warmup_checkpoint(TINY, QUICK)
    meta = json.loads((folder / warmup_mod.META_FILE).read_text())
    assert meta["final_loss"] < 0.6 * meta["first_loss"], meta
    assert folder.name == warmup_mod.cache_key(TINY, QUICK)

    def no_training(*args, **kwargs):
        raise AssertionError("the cached warm-up was trained again")

    monkeypatch.setattr(warmup_mod, "train_warmup", no_training)
    assert warmup_mod.warmup_checkpoint(TINY, QUICK) == folder
    # threads do not change the result, so they do not change the cache key; the data does
    assert warmup_mod.cache_key(TINY, QUICK.model_copy(update={"threads": 2})) == folder.name
    assert warmup_mod.cache_key(TINY, QUICK.model_copy(update={"seed": 1})) != folder.name

    prompts = SyntheticPrompts(SyntheticPromptsConfig()).eval_prompts(0, 24)

    def mean_utility(model):
        texts = EngineActor("a", model).generate(prompts, 1, 16, 1.0, 0, 0, True).texts
        return sum(synthetic.answer_utility(p, t) for p, t in zip(prompts, texts, strict=True)) / len(texts)

    random_init = mean_utility(TINY)
    started = mean_utility(PolicyModelConfig(path=str(folder)))
    assert started > random_init + 0.1, (random_init, started)


def test_rl_warmup_command(tmp_path):
    # Wrong if the command did not print the folder `hpref rl` would start from, or a recipe
    # without [rl.warmup] were not one clear line with exit 2.
    tiny = ", ".join(f"{k} = {v}" for k, v in TINY.model_dump(exclude={"path", "name"}).items())
    body = textwrap.dedent(
        f"""
        [run]
        name = "w"
        output_dir = "{tmp_path}"
        [rl.defaults]
        model = {{ {tiny} }}
        [rl.policies.a]
        """
    )
    plain = tmp_path / "plain.toml"
    plain.write_text(body)
    failed = run_hpref("rl-warmup", str(plain))
    assert failed.returncode == 2
    assert (
        failed.stderr.strip()
        .splitlines()[-1]
        .endswith("rl.warmup: the recipe has no [rl.warmup] section to build")
    )
    warm = tmp_path / "warm.toml"
    warm.write_text(body + "[rl.warmup]\nsteps = 3\nbatch_size = 4\nbattles = 20\nwarmup_steps = 1\n")
    done = run_hpref("rl-warmup", str(warm))
    assert done.returncode == 0, done.stderr
    policy, folder = done.stdout.strip().split("\t")
    cfg = WarmupConfig(steps=3, batch_size=4, battles=20, warmup_steps=1)
    assert policy == "a" and folder.endswith(warmup_mod.cache_key(TINY, cfg))
