"""A policy trainer on megatron-core (issue #15, `trainer_backend = "megatron"`): the same log-probs
and GRPO steps as the transformers trainer on the same weights, weights sent to the engine in the
transformers layout (engine and trainer agree after a sync), exact resume, one-line refusals, a
tensor-parallel group of two ranks that takes the one-rank step (issue #36), and a short `hpref rl`
run on a real local Ray cluster.

The actors run in-process (no Ray) except in the group's test and the last one, on the one-block
tiny Llama every RL test builds."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is the optional [megatron] extra")

from hpref.errors import RecipeError  # noqa: E402
from hpref.models.causal_lm import build_policy_model  # noqa: E402
from hpref.recipe.rl import parse_rl_section  # noqa: E402
from hpref.rl.engines.transformers_engine import EngineActor  # noqa: E402
from hpref.rl.policy import completion_logprobs, pad_batch  # noqa: E402
from hpref.rl.trainer.actor import TrainerActor  # noqa: E402
from hpref.runfolder.safe_load import CheckpointError  # noqa: E402
from tests.adam_steps import assert_same_adamw_step, trainable  # noqa: E402
from tests.conftest import run_hpref  # noqa: E402
from tests.rl.local_actor import length_scored_rollouts  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402

#: TINY with two key/value heads: megatron splits whole query groups over tensor-parallel ranks
TINY_TP2 = {**TINY, "num_key_value_heads": 2}
PROMPTS = [("What is the capital of Peru?",), ("Add 2 and 3.",)]


def rl_config(backend="megatron", **policy):
    data = {
        "num_rollouts": 4,
        "staleness_limit": 10,  # the fixture's rollouts all come from the starting weights
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6, "max_buffered": 1},
        "defaults": {"model": TINY, "lr": 3e-3, "trainer_backend": backend},
        "policies": {"a": policy},
        "reward": {"name": "rule", "function": "rl_megatron_length_reward:score"},
    }
    return parse_rl_section(data, "test")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Four rollouts of policy 'a' sampled from its start (the trainers take them off-policy, which
    is all these tests need); megatron's parallel state and process group torn down at the end."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    mp = pytest.MonkeyPatch()
    cfg = rl_config()
    _, rollouts = length_scored_rollouts(tmp_path_factory, mp, cfg, "rl_megatron_length_reward")
    yield cfg, rollouts
    from hpref.models.megatron.causal_lm import release_model_parallel

    release_model_parallel(created_group=True)
    mp.undo()


def trainer(backend="megatron", **policy):
    cfg = rl_config(backend, **policy)
    return TrainerActor("a", cfg.policies["a"], cfg.update_weights_interval)


def batch_of(gen, pad_id):
    return pad_batch(gen.prompt_ids, gen.completions, pad_id)


def test_megatron_log_probs_equal_the_transformers_policys(world):
    # Wrong if a weight were converted into the wrong slot (Q/K/V groups, gate/up halves, the final
    # norm, the output layer), if RoPE's positions did not restart per row when the batch is packed,
    # or if temperature or the masks were applied differently: the GRPO ratios would be off from the
    # first step. Untied here (hpref's tiny policy); the tied case is the next test.
    _cfg, rollouts = world
    mc, hf = trainer("megatron"), trainer("transformers")
    assert type(mc.model).__name__ == "MegatronCausalLM" and "gpt" in dict(mc.model.named_children())
    batch = pad_batch(rollouts[0].prompt_ids, rollouts[0].completions, mc.tokenizer.pad_token_id)
    mask = batch["mask"].bool()
    for temperature in (1.0, 0.7):
        with torch.no_grad():
            ours = completion_logprobs(mc.model, batch, temperature)
            theirs = completion_logprobs(hf.model, batch, temperature)
        assert float((ours - theirs)[mask].abs().max()) < 1e-5
    # and the engine's own sampling log-probs are what the megatron trainer computes at the start
    for i, ref in enumerate(rollouts[0].logprobs):
        s = len(rollouts[0].prompt_ids[i]) - 1
        assert (
            ours.new_tensor(ref)
            .sub(completion_logprobs(mc.model, batch, rollouts[0].temperature)[i, s : s + len(ref)])
            .abs()
            .max()
            < 1e-4
        )


def test_tied_embeddings_are_one_megatron_weight_and_two_transformers_keys(world):
    # Wrong if a tied model got a separate output layer (the engine's lm_head would drift from its
    # embedding) or if the state dict sent back lacked `lm_head.weight`, which a tied transformers
    # model's strict load still asks for.
    from transformers import LlamaForCausalLM

    from hpref.models.megatron.causal_lm import MegatronCausalLM

    _cfg, rollouts = world
    base, tokenizer = build_policy_model(rl_config().policies["a"].model)
    config = base.config.__class__(**{**base.config.to_dict(), "tie_word_embeddings": True})
    torch.manual_seed(3)
    tied = LlamaForCausalLM(config).float()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    mc = MegatronCausalLM(tied.config)
    mc.load_hf_state(tied.state_dict())
    assert mc.gpt.output_layer.weight is None  # megatron reads the embedding as its output weight
    batch = pad_batch(rollouts[1].prompt_ids, rollouts[1].completions, tokenizer.pad_token_id)
    with torch.no_grad():
        gap = completion_logprobs(mc, batch, 0.8) - completion_logprobs(tied, batch, 0.8)
    assert float(gap[batch["mask"].bool()].abs().max()) < 1e-5
    state = mc.hf_state_dict()
    assert state.keys() == tied.state_dict().keys()
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    tied.load_state_dict(state, strict=True)


def test_engine_and_trainer_agree_after_a_sync(world):
    # Wrong if `update_weights` sent megatron's layout (fused Q/K/V or gate/up, megatron's names:
    # the engine's strict load fails) or un-fused it wrongly (the engine would load and then sample
    # from another policy than the one trained, and every GRPO ratio would be off).
    _cfg, rollouts = world
    t = trainer("megatron")
    for rollout in rollouts[:2]:
        assert t.train(rollout)["grad_norm"] > 0
    engine = EngineActor("a", t.config.model)
    gen = engine.generate(PROMPTS, 2, 6, 1.0, 0, 7)
    batch = batch_of(gen, engine.tokenizer.pad_token_id)
    real = batch["attention_mask"].bool()

    def gap():
        with torch.no_grad():
            trained = t.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            served = engine.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return float((trained - served)[real].abs().max())

    assert gap() > 1e-3  # before the sync the engine still serves the start: the check can fail
    version, state = t.update_weights()
    want = engine.model.state_dict()
    assert state.keys() == want.keys()  # the transformers model's names and shapes ...
    assert all(state[k].shape == want[k].shape and state[k].dtype == want[k].dtype for k in want)
    engine.begin_update(version)
    engine.load_weights(state)
    assert engine.commit_update() == version == 2
    assert gap() < 1e-5  # ... and values: the engine's logits are the trainer's (fp32)
    # what the engine samples next is what the trainer's next step sees (left vs right padding)
    gen = engine.generate(PROMPTS[:1], 2, 6, 1.0, 0, 8)
    batch = batch_of(gen, engine.tokenizer.pad_token_id)
    with torch.no_grad():
        trained = completion_logprobs(t.model, batch, 1.0)
    for i, ref in enumerate(gen.logprobs):
        s = len(gen.prompt_ids[i]) - 1
        assert trained[i, s : s + len(ref)].tolist() == pytest.approx(ref, abs=1e-4)


def test_megatron_and_transformers_trainers_take_the_same_grpo_steps(world):
    # Wrong if the megatron trainer's loss, gradient or optimizer differed from the transformers
    # trainer's: from the same weights and rollouts the two must walk the same path. Not bit for bit:
    # megatron multiplies by fused Q/K/V and gate/up matrices, so floating-point sums run in another
    # order (about 1e-7 relative per step); the tolerances below are a few hundred times that. With a
    # KL term: the megatron reference (built again, not deep-copied) must be the start.
    _cfg, rollouts = world
    mc, hf = (
        trainer("megatron", algorithm={"kl_coef": 0.1}),
        trainer("transformers", algorithm={"kl_coef": 0.1}),
    )
    for step, rollout in enumerate(rollouts[:3]):
        ours, theirs = mc.train(rollout), hf.train(rollout)
        for key in ("loss", "grad_norm", "kl", "clip_fraction", "ratio_mean"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (step, key)
        if step == 0:
            assert ours["kl"] == pytest.approx(0.0, abs=1e-7)
    assert ours["kl"] > 1e-6  # the steps moved the policy off the reference
    got, want = mc.update_weights()[1], hf.update_weights()[1]
    start = build_policy_model(mc.config.model)[0].state_dict()
    for key in want:
        moved = float((want[key] - start[key]).abs().max())
        assert float((got[key] - want[key]).abs().max()) <= max(1e-3 * moved, 1e-6), key


def test_save_then_load_resumes_exactly_and_the_save_is_a_transformers_folder(world, tmp_path):
    # Wrong if a resumed megatron trainer differed in any bit from the uninterrupted one (weights or
    # Adam moments not restored, the conversion not a bijection), if the save were megatron's layout
    # (the run's checkpoint would not start a transformers policy), or if a save of one backend were
    # resumed by the other (Adam's moments are per parameter: one line, not a shape error).
    _cfg, rollouts = world
    t = trainer("megatron")
    t.train(rollouts[0])
    t.train(rollouts[1])
    saved = tmp_path / "a"
    t.save(str(saved))
    assert json.loads((saved / "model" / "config.json").read_text())["model_type"] == "llama"
    expected = t.train(rollouts[2])
    expected_state = t.update_weights()[1]

    resumed = trainer("megatron")
    assert resumed.load(str(saved)) == 2 and resumed.rollouts_done == 2
    got = resumed.train(rollouts[2])
    for key in ("loss", "grad_norm", "clip_fraction", "ratio_mean", "engine_trainer_logprob_diff"):
        assert got[key] == expected[key], key
    got_state = resumed.update_weights()[1]
    for key in expected_state:
        assert torch.equal(got_state[key], expected_state[key]), key

    # the saved folder starts a plain transformers policy with the same log-probs
    check = trainer("megatron")
    check.load(str(saved))
    folder = check.config.model.model_copy(update={"path": str(saved / "model")})
    plain, tokenizer = build_policy_model(folder)
    batch = pad_batch([[tokenizer.bos_token_id, 5, 6, 7]], [[8, 9, 10]], tokenizer.pad_token_id)
    with torch.no_grad():
        assert torch.allclose(
            completion_logprobs(check.model, batch, 1.0), completion_logprobs(plain, batch, 1.0), atol=1e-5
        )

    with pytest.raises(
        CheckpointError,
        match=r"saved by a megatron trainer, but policy 'a' has trainer_backend = 'transformers'",
    ):
        trainer("transformers").load(str(saved))
    trainer("transformers").save(str(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match=r"saved by a transformers trainer, .* 'megatron' now"):
        trainer("megatron").load(str(tmp_path / "hf"))


def test_refusals_are_one_line_naming_the_key(tmp_path, monkeypatch):
    # Wrong if LoRA or tensor parallelism on a megatron rl trainer were accepted (and then failed, or
    # silently trained something else, inside an actor), or if an architecture megatron does not map
    # surfaced only when the trainer actor died.
    with pytest.raises(
        RecipeError, match=r'^test: rl.policies.a: trainer_backend = "megatron" cannot train LoRA'
    ):
        rl_config(lora={"r": 4})
    with pytest.raises(
        RecipeError, match=r'^test: rl.policies.a: trainer_backend = "megatron" cannot train LoRA'
    ):  # the recipe's [lora] is every policy's default, so it reaches a megatron policy too
        parse_rl_section({"policies": {"b": {}, "a": {"trainer_backend": "megatron"}}}, "test", lora={"r": 2})
    with pytest.raises(
        RecipeError, match=r'^test: rl.defaults: trainer_backend = "megatron" cannot train LoRA'
    ):
        parse_rl_section(
            {"defaults": {"trainer_backend": "megatron"}, "policies": {"a": {}}}, "test", lora={"r": 2}
        )
    with pytest.raises(
        RecipeError,
        match=r"^test: rl.policies.a: ranks = 1, trainer_tensor_parallel = 2: a megatron trainer's ranks "
        r"are its tensor-parallel ranks, so the two must be equal \(data parallelism beyond",
    ):
        rl_config(trainer_tensor_parallel=2)
    with pytest.raises(RecipeError, match=r"^test: rl.policies.a: ranks = 4, trainer_tensor_parallel = 2: "):
        rl_config(ranks=4, trainer_tensor_parallel=2)
    with pytest.raises(
        RecipeError, match=r"^test: rl.policies.a: trainer_tensor_parallel = 2: only the megatron trainer is"
    ):
        rl_config("transformers", ranks=2, trainer_tensor_parallel=2)
    # heads the size does not divide: refused before any actor starts (TINY has one key/value head)
    from hpref.rl.trainer.backends import check_backends

    with pytest.raises(RecipeError) as refused:
        check_backends(rl_config(ranks=2, trainer_tensor_parallel=2), ["a"], "test")
    assert str(refused.value) == (
        "test: rl.policies.a.trainer_tensor_parallel = 2 must divide the model's attention heads (2), "
        "key/value heads (1) and MLP width (64): megatron splits whole query groups and MLP columns over "
        "the ranks"
    )
    check_backends(rl_config(ranks=2, trainer_tensor_parallel=2, model=TINY_TP2), ["a"], "test")
    with pytest.raises(
        RecipeError,
        match=r"^test: rl.policies.a.trainer_backend: unknown trainer_backend 'nemo'; known: megatron, ",
    ):
        rl_config(trainer_backend="nemo")

    from hpref.recipe import recipe_from_dict
    from hpref.rl import launch as driver

    def no_ray(_address):
        raise AssertionError("Ray was started before the megatron policy was checked")

    monkeypatch.setattr(driver, "connect_ray", no_ray)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    config = {
        "model_type": "gpt2",
        "n_embd": 32,
        "n_layer": 1,
        "n_head": 2,
        "vocab_size": 300,
        "n_positions": 64,
    }
    (gpt2 / "config.json").write_text(json.dumps(config))
    recipe = recipe_from_dict(
        {
            "run": {"name": "r", "output_dir": str(tmp_path)},
            "rl": {"policies": {"a": {"trainer_backend": "megatron", "model": {"path": str(gpt2)}}}},
        },
        resolve=False,
    )
    with pytest.raises(RecipeError) as refused:
        driver.run_rl(recipe, ["a"])
    assert str(refused.value).startswith(
        "recipe: rl.policies.a.trainer_backend: the megatron backend builds llama"
    )
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "r").exists()  # refused before the run folder was made


def test_the_megatron_trainer_stays_on_the_cpu_where_cuda_is_visible(world, monkeypatch):
    # Wrong if megatron's RoPE moved its table to `torch.cuda.current_device()` (what it does when
    # CUDA is visible; hpref's preference-model seam only swaps it when CUDA is absent): an rl trainer's
    # weights are on the CPU, so on a GPU host its first forward would mix devices and fail.
    _cfg, rollouts = world

    def touched_cuda(*_args, **_kwargs):
        raise AssertionError("the CPU trainer asked for a CUDA device")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", touched_cuda)
    t = trainer("megatron")
    assert t.train(rollouts[0])["grad_norm"] > 0


@pytest.mark.parametrize("tied", [False, True])
def test_tensor_parallel_slices_convert_back_to_the_transformers_state(tied):
    # Wrong if a rank's slice of the vocabulary (padded: 301 rows do not split in two), of the fused
    # Q/K/V groups or of the gate/up halves were cut or put back in another order: the engine, a save
    # and a one-rank resume would get another model than the group trained.
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpref.models.megatron.causal_lm import hf_causal_to_megatron, megatron_causal_to_hf, relayout
    from hpref.models.megatron.convert import shape_of

    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=301,
        tie_word_embeddings=tied,
    )
    shape = shape_of(config)
    torch.manual_seed(0)
    hf = {k: torch.randn_like(v) for k, v in LlamaForCausalLM(config).state_dict().items()}
    if tied:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    one = hf_causal_to_megatron(hf, shape, tied=tied)
    shards = [hf_causal_to_megatron(hf, shape, tied=tied, tp_rank=r, tp_size=2) for r in range(2)]
    assert shards[0]["gpt.embedding.word_embeddings.weight"].shape[0] == 151  # 302 rows over 2 ranks
    for r in range(2):  # a one-rank state (weights or moments) cut for rank r is rank r's own slice
        cut = relayout(one, shape, tied=tied, tp_rank=r, tp_size=2)
        assert cut.keys() == shards[r].keys() and all(torch.equal(cut[k], shards[r][k]) for k in cut)
    back = megatron_causal_to_hf(shards, shape, tied=tied)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_a_tensor_parallel_group_takes_the_one_rank_step_and_saves_its_files(world, ray_cluster, tmp_path):
    """Two Ray actors with `ranks = trainer_tensor_parallel = 2`: each holds half of every split
    weight, both run the whole rollout. If this fails, a tensor-parallel megatron policy learns
    something other than the same policy on one rank (log-probs over half the vocabulary, a gradient
    norm of one rank's slices, replicated weights counted twice, a slice loaded into the wrong rank),
    its engine gets slices or megatron's layout, or its save is not the one-rank save (a TP run
    would not resume on one rank, nor one rank's run on TP)."""
    ray = pytest.importorskip("ray")
    from hpref.rl.trainer.group import TrainerGroup
    from tests.rl.trainer.test_trainer_group import received, run

    _cfg, rollouts = world
    # grad_clip below the norm: the clip coefficient depends on the group's global norm
    cfg = rl_config(
        model=TINY_TP2, algorithm={"kl_coef": 0.1}, grad_clip=0.05, ranks=2, trainer_tensor_parallel=2
    )
    one = cfg.policies["a"].model_copy(update={"ranks": 1, "trainer_tensor_parallel": 1})
    alone = TrainerActor("a", one, 1)
    start = trainable(alone)
    want_stats = alone.train(rollouts[0])
    assert want_stats["grad_norm"] > 0.05 and want_stats["kl"] == 0.0

    remote = ray.remote(TrainerActor).options(num_cpus=0.25)
    ranks = [remote.remote("a", cfg.policies["a"], 1, rank=r, world_size=2) for r in range(2)]
    group = TrainerGroup("a", ranks)

    def read_back(name):
        """The group's state (weights and Adam moments) as a one-rank trainer loads its save, and the
        weights the group sent its engine: the save's own, to the bit (one layout conversion apart)."""
        run(group.save(str(tmp_path / name)))
        version, buckets = received(group, bucket_bytes=20_000)
        sent = {k: v for b in buckets for k, v in b.items()}
        reader = TrainerActor("a", one, 1)
        reader.load(str(tmp_path / name))
        saved = reader.update_weights()[1]
        assert sent.keys() == saved.keys() and len(buckets) > 2  # whole, in several 20 kB buckets
        for key, tensor in saved.items():
            assert sent[key].shape == tensor.shape and sent[key].dtype == torch.float32
            assert torch.equal(sent[key], tensor), key
        return version, reader

    try:
        run(group.start())

        def held(actor):  # (tensor-parallel size, rank, rows of this rank's fused Q/K/V)
            qkv = "gpt.decoder.layers.0.self_attention.linear_qkv.weight"
            return ray.get(
                actor.__ray_call__.remote(
                    lambda t: (t.model.tp_size, t.model.tp_rank, t.model.state_dict()[qkv].shape[0])
                )
            )

        assert [held(r) for r in ranks] == [(2, 0, 48), (2, 1, 48)]  # half of the 96 rows each
        stats = run(group.train(rollouts[0]))
        for key in ("loss", "kl", "grad_norm", "clip_fraction", "ratio_mean", "engine_trainer_logprob_diff"):
            assert stats[key] == pytest.approx(want_stats[key], rel=1e-5, abs=1e-7), key
        # the group's step is the one-rank step (tests/adam_steps.py: moments within summation-order
        # rounding, each side's weights its own AdamW step), and its save is a one-rank save: a one-rank
        # trainer resumes it, Adam moments included
        version, resumed = read_back("tp")
        assert version == 1 and resumed.optimizer.state  # moments came back, not a fresh optimizer
        assert_same_adamw_step(alone, resumed, start, start)

        # one more identical rollout on each: the resumed moments carry the step on
        before_alone, before_resumed = trainable(alone), trainable(resumed)
        again, resumed_again = alone.train(rollouts[1]), resumed.train(rollouts[1])
        group_again = run(group.train(rollouts[1]))
        for key in ("loss", "kl", "grad_norm"):
            assert group_again[key] == pytest.approx(again[key], rel=1e-5, abs=1e-7), key
            assert resumed_again[key] == pytest.approx(again[key], rel=1e-5, abs=1e-7), key
        assert_same_adamw_step(alone, resumed, before_alone, before_resumed)

        # ... and the group resumes a one-rank save (each rank cuts its slices of weights and moments)
        alone.save(str(tmp_path / "one"))
        assert run(group.load(str(tmp_path / "one"))) == 2
        before = trainable(alone)
        last = alone.train(rollouts[2])
        assert run(group.train(rollouts[2]))["grad_norm"] == pytest.approx(last["grad_norm"], rel=1e-5)
        _version, after_group = read_back("tp-again")
        assert_same_adamw_step(alone, after_group, before, before)
    finally:
        for r in ranks:
            ray.get(r.close.remote())
            ray.kill(r)


def test_close_releases_the_process_group_the_trainer_made(world):
    # Wrong if a megatron trainer left megatron's parallel state or its one-rank process group behind
    # (a later megatron model in the process would find another's groups), or if it destroyed a
    # process group it did not make. Runs last among the in-process tests: it tears the groups down.
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hpref.models.megatron.causal_lm import release_model_parallel

    _cfg, rollouts = world
    assert dist.is_initialized()  # the fixture's trainers made one ...
    release_model_parallel(created_group=True)  # ... gone, as in a fresh actor process
    t = trainer("megatron")
    assert t.model.created_group and dist.get_world_size() == 1
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    t.train(rollouts[0])
    t.close()
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        other = trainer("megatron")
        assert not other.model.created_group  # the process group was there: not the trainer's
        other.close()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_hpref_rl_with_a_megatron_trainer_on_ray(ray_cluster, tmp_path):
    # Wrong if the backend switch did not reach the trainer actor on Ray, if megatron's parallel
    # state could not be set up inside an actor (no process group there), or if the engine did not
    # serve the synced weights: the trainer's log-probs of each rollout are the engine's own.
    from hpref.recipe import recipe_from_dict
    from hpref.rl.control.record import read_record
    from hpref.rl.launch import run_rl

    rl = {
        "num_rollouts": 3,
        "staleness_limit": 0,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 4, "eval_prompts": 0},
        "defaults": {"model": TINY, "lr": 1e-3},
        "policies": {"m": {"trainer_backend": "megatron", "algorithm": {"kl_coef": 0.05}}},
    }
    run = {"name": "arena", "output_dir": str(tmp_path)}
    recipe = recipe_from_dict({"run": run, "rl": rl}, resolve=False)
    assert run_rl(recipe, ["m"]) == 0
    run_dir = tmp_path / "arena"
    final = read_record(run_dir)
    assert final.rollout_ids == {"m": 3}
    assert (
        json.loads((run_dir / "rl.json").read_text())["config"]["policies"]["m"]["trainer_backend"]
        == "megatron"
    )
    saved = run_dir / final.save_dir / "m" / "model"
    assert (saved / "model.safetensors").is_file() and (saved / "config.json").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics" / "m.jsonl").read_text().splitlines()]
    assert [(row["rollout"], row["weight_version"]) for row in rows] == [(0, 1), (1, 2), (2, 3)]
    assert max(row["engine_trainer_logprob_diff"] for row in rows) < 1e-4


def test_recipes_check_refuses_lora_on_a_megatron_policy_in_one_line(tmp_path):
    # Wrong if `hpref recipes check` (and so `hpref rl`, exit 2) accepted a megatron policy with the
    # recipe's [lora], which would then die inside a trainer actor, or refused a plain megatron one.
    path = tmp_path / "rl-megatron.toml"
    text = """
[rl]
num_rollouts = 2
[rl.defaults]
model = { hidden_size = 32, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 1 }
[rl.policies.a]
trainer_backend = "megatron"
[rl.policies.b]
"""
    path.write_text(text)
    ok = run_hpref("recipes", "check", str(path))
    assert ok.returncode == 0, ok.stderr
    path.write_text(text + "\n[lora]\nr = 4\n")
    bad = run_hpref("recipes", "check", str(path))
    assert bad.returncode == 2
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, bad.stderr
    assert 'rl.policies.a: trainer_backend = "megatron" cannot train LoRA adapters' in lines[0]
