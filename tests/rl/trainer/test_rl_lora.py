"""LoRA policies in `hpref rl` (issue #13): only the adapter trains, the engine is sent merged weights
and then computes the trainer's log-probs, a save holds the adapter and its optimizer state (plus the
base's name) and resumes exactly, and `[lora]` in an rl recipe is accepted and checked.

The actors run in-process (no Ray), on the one-block tiny Llama every RL test builds."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from hpref.errors import RecipeError  # noqa: E402
from hpref.models.causal_lm import build_policy_model  # noqa: E402
from hpref.recipe.rl import parse_rl_section  # noqa: E402
from hpref.rl.control.driver import Handles, drive, restore  # noqa: E402
from hpref.rl.engines.transformers_engine import EngineActor  # noqa: E402
from hpref.rl.policy import completion_logprobs, pad_batch  # noqa: E402
from hpref.rl.report.metrics import MetricsWriter  # noqa: E402
from hpref.rl.rollout.executor import RolloutExecutor  # noqa: E402
from hpref.rl.trainer.actor import TrainerActor  # noqa: E402
from hpref.runfolder.safe_load import CheckpointError  # noqa: E402
from tests.conftest import run_hpref  # noqa: E402
from tests.rl.local_actor import LocalActor, length_scored_rollouts  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402

R = 4
#: TINY's adapted linears as (in, out): q, k, v, o (2 query heads of 16, 1 key/value head), gate, up,
#: down; LoRA adds r (in + out) parameters to each
TINY_LINEARS = [(32, 32), (32, 16), (32, 16), (32, 32), (32, 64), (32, 64), (64, 32)]
ADAPTER_PARAMS = sum(R * (i + o) for i, o in TINY_LINEARS)  # 2,048


def rl_config(lora=None, **over):
    data = {
        "num_rollouts": 4,
        "staleness_limit": 10,  # the fixture's rollouts all come from the starting weights
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6, "max_buffered": 1},
        "defaults": {"model": TINY, "lr": 3e-2},
        "policies": {"a": {}, "b": {"algorithm": {"kl_coef": 0.1}}},
        "reward": {"name": "rule", "function": "rl_lora_length_reward:score"},
    }
    data.update(over)
    return parse_rl_section(data, "test", lora=lora if lora is not None else {"r": R})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The config, a plain engine for policy 'a', and four of its rollouts (sampled from the start:
    the trainers below take them off-policy, which is all these tests need)."""
    mp = pytest.MonkeyPatch()
    cfg = rl_config()
    engine, rollouts = length_scored_rollouts(tmp_path_factory, mp, cfg, "rl_lora_length_reward")
    yield cfg, engine, rollouts
    mp.undo()


def trainer(cfg, policy="a"):
    return TrainerActor(policy, cfg.policies[policy], cfg.update_weights_interval)


def base_weights(t):
    return {k: v.clone() for k, v in t.model.state_dict().items() if ".lora_" not in k}


def test_top_level_lora_is_every_policys_default_and_a_policy_table_changes_it():
    # Wrong if [lora] did not reach the policies (they would train in full), if a policy's own
    # lora table replaced the section instead of changing one key, or if QLoRA were accepted for a
    # policy whose engine cannot run a 4-bit base.
    cfg = parse_rl_section(
        {"defaults": {"model": TINY}, "policies": {"a": {}, "b": {"lora": {"alpha": 2}}}},
        "test",
        lora={"r": 4, "target_modules": ["q_proj", "v_proj"]},
    )
    assert cfg.policies["a"].lora.r == 4 and cfg.policies["a"].lora.scale_alpha == 8
    assert cfg.policies["b"].lora.r == 4 and cfg.policies["b"].lora.scale_alpha == 2
    assert cfg.policies["b"].lora.target_modules == ["q_proj", "v_proj"]
    plain = parse_rl_section({"policies": {"a": {}, "b": {"lora": {"r": 2}}}}, "test")
    assert plain.policies["a"].lora is None and plain.policies["b"].lora.r == 2
    with pytest.raises(
        RecipeError,
        match=r"^test: rl.policies.a.lora.quantize_base: '4bit' \(QLoRA\) is not supported for hpref rl",
    ):
        parse_rl_section({"policies": {"a": {"lora": {"quantize_base": "4bit"}}}}, "test")


def test_only_the_adapter_trains_and_the_base_never_moves(world):
    # Wrong if the optimizer held base weights (a full fine-tune under a LoRA name, with Adam
    # moments for every weight), if any base weight changed in a step, or if the adapters did not.
    cfg, _engine, rollouts = world
    t = trainer(cfg)
    trainable = {n: p.numel() for n, p in t.model.named_parameters() if p.requires_grad}
    assert sum(trainable.values()) == ADAPTER_PARAMS == 2048
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)
    in_optimizer = [p for group in t.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in in_optimizer) == ADAPTER_PARAMS
    assert all(p.requires_grad for p in in_optimizer)
    total = sum(p.numel() for p in t.model.parameters())
    plain = sum(p.numel() for p in build_policy_model(cfg.policies["a"].model)[0].parameters())
    assert total == plain + ADAPTER_PARAMS  # the whole base is there, frozen (28,512 weights here)

    before = base_weights(t)
    for rollout in rollouts[:2]:
        stats = t.train(rollout)
        assert stats["grad_norm"] > 0
    after = base_weights(t)
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    lora_b = [p for n, p in t.model.named_parameters() if ".lora_B." in n]
    assert all(float(p.detach().abs().max()) > 0 for p in lora_b)  # B starts at zero: the adapters moved


def test_a_steps_mfu_counts_its_batches_with_the_base_frozen_over_every_pass(world, monkeypatch):
    # Wrong if a LoRA step's MFU counted the frozen base's weight gradients (1.5x too high), if a
    # second pass over the rollout went uncounted, or if the seconds or the peak were not the
    # step's (`hpref.rl.trainer.throughput`).
    import hpref.rl.trainer.actor as actor_module
    from hpref.rl.trainer.throughput import FlopShape

    cfg, _engine, rollouts = world
    policy = cfg.policies["a"].model_copy(update={"epochs_per_rollout": 2})
    t = TrainerActor("a", policy, cfg.update_weights_interval)
    shapes, flops, batch_flops = set(), [], actor_module.batch_flops

    def counted(shape, batch):
        shapes.add(shape)
        flops.append(batch_flops(shape, batch))
        return flops[-1]

    monkeypatch.setattr(actor_module, "batch_flops", counted)
    stats = t.train(rollouts[0])
    dense = FlopShape.of(t.model.config).trained
    assert shapes == {FlopShape(trained=ADAPTER_PARAMS, frozen=dense, attention=2 * 16)}
    assert len(flops) == 2 * stats["micro_batches"]  # both passes
    assert 0 < stats["train_mfu"] == pytest.approx(sum(flops) / (stats["train_s"] * t.peak.flops), rel=1e-9)


def test_kl_reference_is_the_base_with_the_adapters_off(world):
    # Wrong if a LoRA policy kept a deep copy of the model as its reference (twice the memory for
    # nothing), or if the reference were not the start: at the first step the KL must be exactly 0,
    # and once the adapters moved it must not be.
    cfg, _engine, rollouts = world
    t = trainer(cfg, "b")
    assert t.reference is None and t.wants_reference
    first = t.train(dataclasses.replace(rollouts[0], policy="b"))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)
    second = t.train(dataclasses.replace(rollouts[1], policy="b"))
    assert second["kl"] > 1e-6


def test_engine_and_trainer_agree_after_a_sync(world):
    # Wrong if the merged weights were not what the adapted trainer computes (a wrong scale
    # alpha/r, a transposed delta, an adapter left out): the engine would sample from another
    # policy than the one trained, and every GRPO ratio would be off.
    cfg, _engine, rollouts = world
    t = trainer(cfg)
    for rollout in rollouts[:3]:
        t.train(rollout)
    engine = EngineActor("a", cfg.policies["a"].model)
    gen = engine.generate([("What is the capital of Peru?",), ("Add 2 and 3.",)], 2, 6, 1.0, 0, 7)
    batch = pad_batch(gen.prompt_ids, gen.completions, engine.tokenizer.pad_token_id)
    mask = batch["mask"].bool()

    def gap():
        with torch.no_grad():
            trained = completion_logprobs(t.model, batch, 1.0)
            served = completion_logprobs(engine.model, batch, 1.0)
        return float((trained - served)[mask].abs().max())

    assert gap() > 1e-3  # before the sync the engine still serves the start: the check can fail
    version, state = t.update_weights()
    assert version == 3
    assert not any(".lora_" in k or "base_layer" in k for k in state)  # a plain transformers state dict
    engine.begin_update(version)
    engine.load_weights(state)
    assert engine.commit_update() == 3
    assert gap() < 1e-5  # fp32: base + B A alpha/r computes what base(x) + B(A(x)) alpha/r does
    # and what the engine samples with is what the trainer's next step sees (left vs right padding)
    gen = engine.generate([("What is the capital of Peru?",)], 2, 6, 1.0, 0, 8)
    batch = pad_batch(gen.prompt_ids, gen.completions, engine.tokenizer.pad_token_id)
    with torch.no_grad():
        trained = completion_logprobs(t.model, batch, 1.0)
    for i, ref in enumerate(gen.logprobs):
        s = len(gen.prompt_ids[i]) - 1
        assert trained[i, s : s + len(ref)].tolist() == pytest.approx(ref, abs=1e-4)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft asks transformers v5
def test_save_holds_only_the_adapter_and_resume_is_exact(world, tmp_path):
    # Wrong if a save held the full model (not small, and not what the issue asks), if the base it
    # adapts were not named, if the adapter were not PEFT's own loadable format, or if a resumed
    # trainer took a step that differed in any bit from the one the uninterrupted trainer took.
    cfg, _engine, rollouts = world
    t = trainer(cfg)
    t.train(rollouts[0])
    t.train(rollouts[1])
    t.save(str(tmp_path / "a"))
    saved = tmp_path / "a"
    names = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file())
    assert "model/model.safetensors" not in names
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "policy_base.json"} <= set(
        names
    )
    described = json.loads((saved / "policy_base.json").read_text())
    assert described["base"] == cfg.policies["a"].model.model_dump(mode="json")  # the base, by name
    assert described["lora"]["r"] == R
    adapter_bytes = (saved / "adapter" / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < ADAPTER_PARAMS * 4 + 4096  # fp32 adapters and a safetensors header only
    full_bytes = sum(p.numel() * 4 for p in t.model.parameters())
    assert adapter_bytes < full_bytes / 10

    # the uninterrupted run's third step ...
    expected = t.train(rollouts[2])
    expected_state = t.update_weights()[1]
    # ... and a fresh trainer resumed from the save takes exactly the same step
    resumed = trainer(cfg)
    assert resumed.load(str(saved)) == 2 and resumed.rollouts_done == 2 and resumed.version == 0
    got = resumed.train(rollouts[2])
    for key in ("loss", "grad_norm", "clip_fraction", "ratio_mean", "engine_trainer_logprob_diff"):
        assert got[key] == expected[key], key
    got_state = resumed.update_weights()[1]
    assert got_state.keys() == expected_state.keys()
    for key in expected_state:
        assert torch.equal(got_state[key], expected_state[key]), key

    # the adapter folder is PEFT's: plain peft on the base the save names rebuilds the policy
    from peft import PeftModel

    base, tokenizer = build_policy_model(cfg.policies["a"].model)
    loaded = PeftModel.from_pretrained(base, str(saved / "adapter")).eval()
    prompts = [[tokenizer.bos_token_id, 5, 6, 7]]
    batch = pad_batch(prompts, [[8, 9, 10]], tokenizer.pad_token_id)
    check = trainer(cfg)
    check.load(str(saved))
    with torch.no_grad():
        want = completion_logprobs(check.model.eval(), batch, 1.0)
        have = completion_logprobs(loaded, batch, 1.0)
    assert torch.allclose(want, have, atol=1e-6)


def test_resume_refuses_a_save_of_another_base_or_adapter_shape(world, tmp_path):
    # Wrong if an adapter were loaded into a policy with another base (a different seed or folder:
    # the adapter would be applied to weights it was not trained on) or other adapter settings, or
    # if a LoRA save were read as a full one or the other way round; each is one line naming it.
    cfg, _engine, _rollouts = world
    saved = tmp_path / "a"
    trainer(cfg).save(str(saved))
    full = TrainerActor("a", cfg.policies["a"].model_copy(update={"lora": None}), 1)
    full.save(str(tmp_path / "full"))

    other_seed = cfg.policies["a"].model_copy(
        update={"model": cfg.policies["a"].model.model_copy(update={"seed": 5})}
    )
    with pytest.raises(
        CheckpointError, match=r"policy_base.json: .*other model settings .*model.seed: saved 0, now 5"
    ):
        TrainerActor("a", other_seed, 1).load(str(saved))
    other_r = rl_config(lora={"r": 2})
    with pytest.raises(CheckpointError, match=r"other lora settings .*lora.r: saved 4, now 2"):
        trainer(other_r).load(str(saved))
    with pytest.raises(CheckpointError, match="holds a LoRA adapter, but policy 'a' has no \\[lora\\]"):
        full.load(str(saved))
    with pytest.raises(CheckpointError, match="holds full weights .* has \\[lora\\] now"):
        trainer(cfg).load(str(tmp_path / "full"))


@pytest.mark.slow
def test_lora_in_an_rl_recipe_passes_recipes_check(tmp_path):
    # Wrong if `hpref recipes check` still refused [lora] in an rl recipe, or accepted a target
    # module the policy's LM does not have (the run would then die inside a trainer actor).
    path = tmp_path / "rl-lora.toml"
    text = """
[rl]
num_rollouts = 2
[rl.defaults]
model = { hidden_size = 32, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 1 }
[rl.policies.a]
[rl.policies.b]
lora = { r = 2 }

[lora]
r = 8
"""
    path.write_text(text)
    from hpref.check.command import check_recipes

    # in-process (what the command runs) for the accepted recipe; the real command for the refusal
    assert next(check_recipes([str(path)], [], portable=False)).startswith(f"ok  {path}")
    path.write_text(text.replace("r = 8", 'r = 8\ntarget_modules = ["q_prj"]'))
    bad = run_hpref("recipes", "check", str(path))
    assert bad.returncode == 2
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, bad.stderr
    assert "rl.policies.a.lora.target_modules:" in lines[0] and "q_proj" in lines[0]


def test_driver_gives_the_recipes_lora_to_the_policies():
    # Wrong if `hpref rl` parsed [rl] without the recipe's [lora] (policies would train in full
    # while `recipes check` had accepted the section for them).
    from hpref.recipe import recipe_from_dict
    from hpref.rl.control.preflight import rl_config as _rl_config

    recipe = recipe_from_dict({"rl": {"policies": {"a": {}}}, "lora": {"r": 3}}, resolve=False)
    config, _run_dir = _rl_config(recipe)
    assert config.policies["a"].lora is not None and config.policies["a"].lora.r == 3


def _drive(cfg, run_dir, starts=None, resume=False):
    """One policy 'a' through the real driver loop with in-process actors: its metric rows and the
    actors."""
    engines = {"a": LocalActor(EngineActor("a", cfg.policies["a"].model))}
    handles = Handles(
        LocalActor(RolloutExecutor(cfg, ["a"], engines)),
        engines,
        {"a": LocalActor(trainer(cfg))},
    )
    metrics = MetricsWriter(None)

    async def main():
        starts, _record = await restore(handles, ["a"], run_dir if resume else None)
        await drive(cfg, ["a"], handles, run_dir, starts, metrics)
        await handles.executor.shutdown.remote()
        return handles

    asyncio.run(main())
    return [row for row in metrics.rows["a"] if not row.get("eval")], handles


def test_grpo_trains_a_lora_policy_through_the_driver(world, tmp_path):
    # Wrong if the driver's weight pushes did not reach the engine as merged weights (the engine
    # would keep sampling the start and the reward would stay flat), or if GRPO's gradient did not
    # reach the adapters. The reward is minus the answer's length: the tiny random policy rambles to
    # the token limit and must learn to end at once. The adapters include the LM head's: the frozen
    # head of a random-init model caps every logit near 0.6, so no block adapter alone can make eos
    # likely (LoRA on a pretrained policy needs no such help).
    cfg = rl_config(
        lora={"r": R, "target_modules": ["o_proj", "down_proj", "lm_head"]},
        num_rollouts=30,
        staleness_limit=0,
        rollout={"group_size": 4, "prompts_per_rollout": 4, "max_new_tokens": 12},
    )
    rows, handles = _drive(cfg, tmp_path / "run")
    rewards = [row["reward_mean"] for row in rows]
    assert [row["weight_version"] for row in rows] == list(range(1, 31))  # every update was pushed
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < -8.0, rewards  # a random policy rambles ...
    assert last > -2.0, rewards  # ... and GRPO on the adapters teaches it to stop
    t = handles.trainers["a"].ranks[0].wrapped
    fresh = trainer(cfg)
    for key, value in base_weights(fresh).items():  # thirty steps, and the base has not moved
        assert torch.equal(value, base_weights(t)[key]), key


@pytest.mark.parametrize("staleness", [0, 1])
def test_driver_stop_and_resume_continues_exactly(world, tmp_path, staleness):
    # Wrong if a resumed LoRA policy differed in any bit from the uninterrupted one: the adapter or
    # its Adam moments not restored, the engine not sent the restored (merged) weights before the
    # first resumed rollout, or the base rebuilt differently. Staleness 1 (the default): the rollout
    # prefetched ahead of the save came from the weights before it; regenerated from the saved
    # weights on resume, it was other answers (the save keeps it: benchmarks/chaos_rl.py found it).
    over = {"num_rollouts": 6, "staleness_limit": staleness}
    whole, _ = _drive(rl_config(**over), tmp_path / "whole")
    stopped, _ = _drive(rl_config(**over, debug_exit_after_rollout=3), tmp_path / "split")
    assert [row["rollout"] for row in stopped] == [0, 1, 2]
    saved = tmp_path / "split" / "checkpoints" / "rollout-000003" / "a"
    assert (saved / "adapter" / "adapter_model.safetensors").is_file()
    assert not (saved / "model").exists()
    resumed, _ = _drive(rl_config(**over), tmp_path / "split", resume=True)
    assert [row["rollout"] for row in resumed] == [3, 4, 5]
    keys = ("reward_mean", "loss", "grad_norm", "kl", "engine_trainer_logprob_diff", "gen_tokens")
    for want, got in zip(whole, stopped + resumed, strict=True):
        assert {k: want[k] for k in keys} == {k: got[k] for k in keys}, want["rollout"]
    # and the engine served on-policy weights throughout: the trainer's log-probs are the sampler's
    # (staleness 1: rollouts after the first were sampled one version behind, on purpose)
    assert (max(row["engine_trainer_logprob_diff"] for row in whole) < 1e-5) == (staleness == 0)


def test_hpref_rl_refuses_a_wrong_target_before_any_actor_starts(tmp_path, monkeypatch):
    # Wrong if a target module the policy does not have surfaced only inside a trainer actor (on Ray:
    # an actor that died, exit 1, instead of one line naming the key, exit 2).
    from hpref.recipe import recipe_from_dict
    from hpref.rl import launch as driver

    def no_ray(_address):
        raise AssertionError("Ray was started before the recipe's [lora] was checked")

    monkeypatch.setattr(driver, "connect_ray", no_ray)
    recipe = recipe_from_dict(
        {
            "run": {"name": "r", "output_dir": str(tmp_path)},
            "rl": {
                "defaults": {"model": TINY},
                "policies": {"a": {}, "b": {"lora": {"target_modules": ["mlp"]}}},
            },
        },
        resolve=False,
    )
    with pytest.raises(
        RecipeError, match=r"^recipe: rl.policies.b.lora.target_modules: .*the policy's linear layers"
    ):
        driver.run_rl(recipe, ["a", "b"])
    assert not (tmp_path / "r").exists()  # refused before the run folder was made


@pytest.mark.slow
def test_hpref_rl_with_lora_on_ray_saves_adapters(ray_cluster, tmp_path):
    # Wrong if the recipe's [lora] (and a policy's own lora table) did not reach the trainer actors
    # on Ray: rl.json and the saves would show full weights. (Resume is checked in-process above.)
    from hpref.recipe import recipe_from_dict
    from hpref.rl.control.record import read_record
    from hpref.rl.launch import run_rl

    rl = {
        "num_rollouts": 2,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 4, "eval_prompts": 0},
        "defaults": {"model": TINY, "lr": 1e-3},
        # one policy (three actors: each is a process that imports torch), with the recipe's [lora]
        # and its own change to it
        "policies": {"b": {"algorithm": {"kl_coef": 0.05}, "lora": {"alpha": 2}}},
    }
    run = {"name": "arena", "output_dir": str(tmp_path)}
    recipe = recipe_from_dict({"run": run, "rl": rl, "lora": {"r": R}}, resolve=False)
    assert run_rl(recipe, ["b"]) == 0
    run_dir = tmp_path / "arena"
    final = read_record(run_dir)
    assert final.rollout_ids == {"b": 2}
    lora = json.loads((run_dir / "rl.json").read_text())["config"]["policies"]["b"]["lora"]
    assert (lora["r"], lora["alpha"]) == (R, 2)
    saved = run_dir / final.save_dir / "b"
    assert not (saved / "model").exists()
    adapter = json.loads((saved / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (R, 2)
    rows = [json.loads(line) for line in (run_dir / "metrics" / "b.jsonl").read_text().splitlines()]
    assert [(row["rollout"], row["weight_version"]) for row in rows] == [(0, 1), (1, 2)]
    assert all(row["kl"] >= 0 and row["grad_norm"] >= 0 for row in rows)


def test_merged_weights_cover_embedding_and_lm_head_adapters():
    # Wrong if merging skipped an adapter kind: PEFT keeps an embedding's adapter apart from a
    # linear layer's (lora_embedding_A/B), and a missed one would leave the engine on the base
    # embedding while the trainer uses the adapted one. Random adapters, so every delta is non-zero.
    from transformers import LlamaForCausalLM

    from hpref.models.causal_lm import tiny_policy_config
    from hpref.models.lm_adapters import apply_lora_to_causal_lm, merged_lm_state
    from hpref.recipe import LoraSection
    from hpref.recipe.rl import PolicyModelConfig

    config = tiny_policy_config(PolicyModelConfig(**TINY), vocab_size=300)
    torch.manual_seed(0)
    adapted, plain = LlamaForCausalLM(config), LlamaForCausalLM(config)
    peft = apply_lora_to_causal_lm(
        adapted, LoraSection(r=4, target_modules=["embed_tokens", "q_proj", "lm_head"])
    )
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if ".lora_" in name:
                param.normal_(0.0, 0.3)
    plain.load_state_dict(merged_lm_state(adapted), strict=True)
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = adapted(ids).logits
        assert float((want - plain(ids).logits).abs().max()) < 1e-5
        with peft.disable_adapter():  # and the adapters change the output: the check can fail
            assert float((want - adapted(ids).logits).abs().max()) > 1.0
