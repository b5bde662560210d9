"""The actors in-process (no Ray): generation, the executor's ordering and staleness rules, GRPO
steps, weight publishing and save/load round trips."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from hpref.recipe.rl import parse_rl_section  # noqa: E402
from hpref.recipe.rl_components import AlgorithmSection, resolve_algorithm  # noqa: E402
from hpref.rl.engines.transformers_engine import EngineActor  # noqa: E402
from hpref.rl.policy import completion_logprobs, group_batch, pad_batch, trim_completion  # noqa: E402
from hpref.rl.rollout.executor import RolloutExecutor  # noqa: E402
from hpref.rl.rollout.prompts import build_prompt_source, rollout_prompts  # noqa: E402
from hpref.rl.rollout_types import rollout_of_tokens  # noqa: E402
from hpref.rl.staleness import StaleWeightsError, staleness_decision  # noqa: E402
from hpref.rl.trainer.actor import TrainerActor  # noqa: E402
from tests.rl.local_actor import LocalActor  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402


def rl_config(**over):
    data = {
        "num_rollouts": 4,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6, "max_buffered": 1},
        "defaults": {"model": TINY, "lr": 1e-3},
        "policies": {"a": {}, "b": {"model": {"seed": 1}, "algorithm": {"kl_coef": 0.1}}},
    }
    data.update(over)
    return parse_rl_section(data, "test")


def test_trim_completion_keeps_eos_and_drops_padding():
    assert trim_completion([5, 6, 2, 7], 2, pad_id=0) == [5, 6, 2]
    assert trim_completion([5, 0, 0], 2, pad_id=0) == [5]
    assert trim_completion([5, 6], 2, pad_id=0) == [5, 6]
    # an instruct model stops at any of its stop ids (eos and end-of-turn)
    assert trim_completion([5, 9, 6, 2], [2, 9], pad_id=0) == [5, 9]


def test_pad_batch_masks_exactly_the_completion_targets():
    batch = pad_batch([[1, 2, 3], [1, 2]], [[7, 8], [9]], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7, 8], [1, 2, 9, 0, 0]]
    # logits at t predict token t+1: completion tokens 7, 8 sit at targets 2, 3; 9 at target 1
    assert batch["mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]


def test_group_batch_runs_each_prompt_once_and_gives_pad_batchs_logprobs_and_gradients():
    """A prompt group's answers on its KV cache (`group_batch`) must be the same computation as each
    answer after its own copy of the prompt (`pad_batch`): log-probs and gradients. If not, shared
    prefixes would train another objective than the one the engine sampled from."""
    from hpref.models.causal_lm import build_policy_model
    from hpref.models.lm_adapters import apply_lora_to_causal_lm
    from hpref.recipe.rl import PolicyModelConfig
    from hpref.recipe.schema import LoraSection

    model, tok = build_policy_model(PolicyModelConfig(**{**TINY, "num_hidden_layers": 2}))
    pad = tok.pad_token_id
    # prompts of unequal lengths (left padding), answers of 1 to 5 tokens (right padding), group of 3
    heads = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    answers = [[20, 21, 22], [23], [24, 25, 26, 27, 28], [29, 30], [31], [32, 33, 34], [35], [36, 37], [38]]
    prompts = [h for h in heads for _ in range(3)]
    grouped = group_batch(prompts, answers, 3, pad)
    assert grouped["prompt_ids"].shape == (3, 5) and grouped["completion_ids"].shape == (9, 5)
    assert grouped["mask"].sum(-1).tolist() == [len(a) for a in answers]
    assert group_batch(prompts, answers, 2, pad) is None  # rows are not whole groups of one prompt
    assert group_batch([heads[0], heads[1]], answers[:2], 2, pad) is None
    padded = pad_batch(prompts, answers, pad)
    for lora in (False, True):
        if lora:
            apply_lora_to_causal_lm(model, LoraSection(r=4, alpha=8))
            for name, param in model.named_parameters():  # B = 0 would hide a wrong path
                if "lora_B" in name:
                    torch.nn.init.normal_(param, std=0.1)
        grads = []
        picked = []
        for batch in (padded, grouped):
            model.zero_grad(set_to_none=True)
            tokens = completion_logprobs(model, batch, 0.7)[batch["mask"].bool()]  # row by row
            # a weight per answer token, so a token scored at the wrong place changes the gradient
            (tokens * torch.linspace(0.5, 1.5, tokens.numel())).sum().backward()
            picked.append(tokens.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert picked[0].shape == picked[1].shape == (sum(map(len, answers)),)
        torch.testing.assert_close(picked[1], picked[0], atol=1e-5, rtol=1e-5)
        assert grads[0].keys() == grads[1].keys() and grads[0]
        total = sum(g.norm() ** 2 for g in grads[0].values()) ** 0.5
        diff = sum((grads[0][n] - grads[1][n]).norm() ** 2 for n in grads[0]) ** 0.5
        assert float(diff) < 1e-4 * float(total) + 1e-6


def test_rollout_prompts_are_shared_and_positional():
    config = rl_config()
    source, cfg = build_prompt_source(config), config.rollout
    assert rollout_prompts(source, cfg, 3) == rollout_prompts(source, cfg, 3)
    assert rollout_prompts(source, cfg, 3) != rollout_prompts(source, cfg, 4)
    assert len(rollout_prompts(source, cfg, 0)) == cfg.prompts_per_rollout
    assert all(len(p) == 1 for p in rollout_prompts(source, cfg, 0))


def test_a_grpo_step_is_the_same_over_shared_prompts_padded_rows_and_any_micro_batching(monkeypatch):
    """The trainer's step must not depend on how it lays the rollout out: prompt groups on a shared
    KV cache in one batch, one group per micro-batch, or every row padded with its own prompt."""
    import hpref.rl.trainer.actor as trainer_module

    rollout = {
        "rollout_id": 0,
        "group_size": 2,
        "temperature": 1.0,
        "rewards": [1.0, 0.0, 0.2, 0.9, 0.5, 0.4],
        "prompt_ids": [[1, 5, 6, 7, 3, 4, 5, 6, 7]] * 2
        + [[1, 8, 3, 4, 5, 6, 7]] * 2
        + [[1, 9, 10, 3, 4, 5, 6, 7]] * 2,
        "completions": [[20, 21], [22], [23, 24, 25], [26], [27, 28], [29, 30, 31, 2]],
    }
    rollout["logprobs"] = [[-1.0 - 0.1 * t for t in range(len(c))] for c in rollout["completions"]]

    def stepped(micro_batch_tokens, share):
        monkeypatch.setattr(trainer_module, "shares_prefix", lambda model: share)
        cfg = rl_config(defaults={"model": TINY, "lr": 1e-2, "micro_batch_tokens": micro_batch_tokens})
        trainer = TrainerActor("a", cfg.policies["a"], cfg.update_weights_interval)
        stats = trainer.train(rollout_of_tokens(**rollout))
        return stats, trainer.model.state_dict()

    one_stats, one = stepped(4096, True)
    assert one_stats["micro_batches"] == 1
    for budget, share in ((16, True), (4096, False), (16, False)):
        stats, other = stepped(budget, share)
        # at 16 padded tokens every group (13-16) and every padded row (8-12) goes alone
        assert stats["micro_batches"] == ((3 if share else 6) if budget == 16 else 1)
        assert stats["loss"] == pytest.approx(one_stats["loss"], abs=1e-6)
        for key, value in one.items():  # Adam moves each weight by ~lr (1e-2): a wrong step shows
            torch.testing.assert_close(other[key], value, atol=1e-5, rtol=1e-5)


def test_rl_actors_bound_the_memory_a_step_leaves_behind(monkeypatch):
    """Every rl actor caps oneDNN's per-shape cache before its first matmul, and the trainer hands
    freed heap pages back before a step (the last sync's state dict) and after it (the step's
    activations). Without these a SmolLM2 trainer kept its largest step's peak (~5.4 GiB) and grew
    by ~0.1 GiB an update, and two policies outgrew a 24 GiB machine at update 19 (#22)."""
    import hpref.rl.trainer.actor as trainer_module
    from hpref import memory
    from hpref.rl.policy import apply_env

    monkeypatch.delenv(memory.ONEDNN_CACHE_ENV, raising=False)
    apply_env(None)
    assert memory.os.environ[memory.ONEDNN_CACHE_ENV] == memory.ONEDNN_CACHE_DEFAULT
    calls = []
    monkeypatch.setattr(trainer_module, "release_freed_memory", lambda: calls.append(1) or True)
    cfg = rl_config()
    trainer = TrainerActor("a", cfg.policies["a"], cfg.update_weights_interval)
    completions = [[20, 21], [22]]
    trainer.train(
        rollout_of_tokens(
            0, [[1, 5, 6, 7]] * 2, completions, [[-1.0] * len(c) for c in completions], [1.0, 0.0], 2
        )
    )
    assert len(calls) == 2


def test_staleness_decision():
    # interval 1, limit 1: rollout 5 needs version >= 4
    assert staleness_decision("a", 5, 4, 5, 1, 1) == "use"
    assert staleness_decision("a", 5, 3, 4, 1, 1) == "regenerate"
    assert staleness_decision("a", 5, None, 4, 1, 1) == "regenerate"
    with pytest.raises(StaleWeightsError, match="policy 'a': rollout 5 needs weights of version >= 4"):
        staleness_decision("a", 5, None, 3, 1, 1)
    # interval 2: rollout 5 is trained by version 2, so with limit 0 version 2 is needed
    assert staleness_decision("a", 5, 2, 2, 2, 0) == "use"


@pytest.fixture(scope="module")
def actors():
    mp = pytest.MonkeyPatch()
    import tempfile

    mp.setenv("HPREF_CACHE", tempfile.mkdtemp(prefix="hpref-rl-cache-"))
    cfg = rl_config()
    engines = {p: LocalActor(EngineActor(p, cfg.policies[p].model)) for p in ("a", "b")}
    trainers = {p: TrainerActor(p, cfg.policies[p], cfg.update_weights_interval) for p in ("a", "b")}
    yield cfg, engines, trainers
    mp.undo()


def test_engine_and_trainer_start_identical_and_agree_on_logprobs(actors):
    cfg, engines, trainers = actors
    engine = engines["a"].wrapped
    for k, v in trainers["a"].model.state_dict().items():
        assert torch.equal(v, engine.model.state_dict()[k]), k
    out = engine.generate(rollout_prompts(build_prompt_source(cfg), cfg.rollout, 0), 2, 6, 1.0, 0, 123)
    assert len(out.completions) == 4 and out.version == 0
    again = engine.generate(rollout_prompts(build_prompt_source(cfg), cfg.rollout, 0), 2, 6, 1.0, 0, 123)
    assert again.completions == out.completions  # seeded: regenerating replays the same answers
    from hpref.rl.policy import completion_logprobs

    batch = pad_batch(out.prompt_ids, out.completions, engine.tokenizer.pad_token_id)
    with torch.no_grad():
        lp = completion_logprobs(trainers["a"].model, batch, 1.0)
    for i, ref in enumerate(out.logprobs):
        s = len(out.prompt_ids[i]) - 1
        # the trainer's teacher-forced log-probs match the engine's sampling ones (left vs right padding)
        assert lp[i, s : s + len(ref)].tolist() == pytest.approx(ref, abs=1e-4)


def test_executor_serves_in_order_and_the_trainer_steps(actors, tmp_path):
    cfg, engines, trainers = actors

    async def main():
        ex = RolloutExecutor(cfg, ["a", "b"], engines)
        r0 = await ex.get(0, "a")
        with pytest.raises(RuntimeError, match="asked for rollout 2 but its next rollout is 1"):
            await ex.get(2, "a")
        assert ex.positions == {"a": 1, "b": 0}  # b's buffer is untouched by a
        assert len(r0.rewards) == 4 and r0.version == 0
        metrics = trainers["a"].train(r0)
        assert metrics["engine_trainer_logprob_diff"] < 1e-3  # on-policy: ratio 1
        assert metrics["clip_fraction"] == 0.0
        assert 0.05 < metrics["trainer_peak_rss_gib"] < 64  # KiB from getrusage, reported in GiB
        version, state = trainers["a"].update_weights()
        assert version == 1
        await engines["a"].begin_update.remote(version)
        await engines["a"].load_weights.remote(state)
        assert await engines["a"].commit_update.remote() == 1
        r1 = await ex.get(1, "a")  # prefetched with version 0: still within staleness 1
        assert r1.version == 0 and not r1.stale_regenerated
        await ex.save(str(tmp_path / "ex"))
        ex2 = RolloutExecutor(cfg, ["a", "b"], engines)
        assert await ex2.load(str(tmp_path / "ex")) == {"a": 2, "b": 0}
        await ex.shutdown()

    asyncio.run(main())


def test_trainer_save_load_round_trip(actors, tmp_path):
    cfg, _engines, trainers = actors
    t = trainers["a"]
    t.save(str(tmp_path / "a"))
    fresh = TrainerActor("a", cfg.policies["a"], cfg.update_weights_interval)
    assert fresh.load(str(tmp_path / "missing")) == 0
    assert fresh.load(str(tmp_path / "a")) == t.rollouts_done
    for k, v in t.model.state_dict().items():
        assert torch.equal(v, fresh.model.state_dict()[k]), k
    assert fresh.version == t.version


def test_abort_update_keeps_the_live_weights(actors):
    _cfg, engines, _trainers = actors
    engine = engines["b"].wrapped
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.begin_update(5)
    engine.load_weights({k: torch.zeros_like(v) for k, v in before.items()})
    engine.abort_update()
    assert engine.version == 0
    with pytest.raises(RuntimeError, match="without begin_update"):
        engine.commit_update()
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("damage", ["missing", "wrong shape", "unknown"])
def test_a_commit_of_a_partial_or_misshapen_state_leaves_every_weight_as_it_was(actors, damage):
    """Half the weights (or one misshapen, or one extra) committed: refused whole, naming what
    differs and the version that keeps serving. If this fails, torch's strict `load_state_dict`
    copied every matching tensor before it raised, and the engine served part of the new weights
    under the old version (what the transformers engine did before #26)."""
    _cfg, engines, _trainers = actors
    engine = engines["b"].wrapped
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v + 1.0 for k, v in before.items()}
    if damage == "missing":
        new = dict(sorted(new.items())[: len(new) // 2])
    elif damage == "wrong shape":
        new["model.norm.weight"] = torch.ones(7)
    else:
        new["model.extra.weight"] = torch.ones(2)
    engine.begin_update(engine.version + 1)
    engine.load_weights(new)
    with pytest.raises(
        ValueError, match=rf"engine 'b': weight update refused \({damage} .*version 0 keeps serving"
    ):
        engine.commit_update()
    assert engine.get_version() == 0
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in before.items())


def test_a_transfer_that_breaks_half_way_is_aborted_and_named(actors, monkeypatch):
    """The driver's weight push, its transfer broken after the first bucket reached the engine: the
    staged part is dropped, the engine answers exactly as before on its old version, and the error
    names the policy, the version that failed and the one still serving. If this fails, a broken
    sync leaves a half-staged update that a later commit would complete with the wrong weights, or
    the run cannot say which weights its engine is generating with."""
    import hpref.rl.transport.weight_channel as weight_channel
    from hpref.rl.trainer.group import TrainerGroup, WeightSyncError, push_weights

    # the trainer's next bucket waits for an engine that never takes it: a run ends there (its
    # actors are killed); in-process, the channel's timeout ends the sender's wait
    monkeypatch.setattr(weight_channel, "CHANNEL_TIMEOUT_S", 3.0)
    cfg, engines, trainers = actors
    engine = engines["b"]
    prompts = rollout_prompts(build_prompt_source(cfg), cfg.rollout, 0)
    before = engine.wrapped.generate(prompts, 2, 6, 1.0, 0, 5)

    class BrokenTransfer:
        """b's engine handle, whose `receive_weights` takes the first bucket and then loses the link."""

        def __getattr__(self, name):
            return getattr(engine, name)

        class receive_weights:  # noqa: N801 - a Ray method handle
            @staticmethod
            async def remote(layout_ref):
                await engine.receive_weights.remote(layout_ref)  # the first bucket arrives whole
                raise ConnectionError("the link dropped half-way")

    trainer = TrainerGroup("b", [LocalActor(trainers["b"])])
    version = trainers["b"].rollouts_done // cfg.update_weights_interval
    with pytest.raises(WeightSyncError) as err:
        asyncio.run(push_weights(trainer, BrokenTransfer(), "b", bucket_bytes=8192))
    assert str(err.value) == (
        f"policy 'b': the weight update to version {version} failed on its way to the engine "
        "(ConnectionError: the link dropped half-way); the engine keeps serving version 0"
    )
    assert engine.wrapped._staging is None  # aborted: nothing staged for a later commit
    after = engine.wrapped.generate(prompts, 2, 6, 1.0, 0, 5)
    assert after.version == 0 and after.logprobs == before.logprobs


def test_kl_policy_has_a_frozen_reference(actors):
    _cfg, _engines, trainers = actors
    assert trainers["a"].reference is None
    ref = trainers["b"].reference
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())


def _pairwise_expected(prompt, answers, opponents):
    """Each group answer's mean P(win) + P(tie)/2 over the rest of its group and the opponents."""
    from hpref.arena import answer_utility, davidson

    everyone = [*answers, *opponents]
    u = [answer_utility(prompt, a) for a in everyone]
    out = []
    for i in range(len(answers)):
        scores = [davidson(u[i], u[j]) for j in range(len(everyone)) if j != i]
        out.append(sum(p_a + 0.5 * p_tie for p_a, _p_b, p_tie in scores) / len(scores))
    return out


def test_cross_policy_rewards_judge_each_policy_against_the_other(actors):
    # Wrong if a policy's answers were judged only within their own group (cross-policy judging
    # off), against answers to other prompts, or if an opponent's already produced answers to the
    # same rollout were not reused (paying for a second generation).
    from hpref.rl.rollout.prompts import sample_seed

    _cfg, engines, _trainers = actors
    cfg = rl_config(reward={"name": "rule", "mode": "pairwise", "opponent_answers": 1})
    prompts = rollout_prompts(build_prompt_source(cfg), cfg.rollout, 0)

    async def main():
        ex = RolloutExecutor(cfg, ["a", "b"], engines)
        ra = await ex.get(0, "a")
        # a's prefetch of rollout 1 also samples b's engine; let it finish before b generates, since
        # in-process engines share torch's global RNG (Ray actors each have their own)
        await asyncio.gather(*ex._buffer["a"].values())
        rb = await ex.get(0, "b")
        await ex.shutdown()
        return ra, rb

    ra, rb = asyncio.run(main())
    # a came first: b's engine answered a's prompts for it, seeded by (b, a, rollout id)
    b_for_a = engines["b"].wrapped.generate(prompts, 1, 6, 1.0, 0, sample_seed(0, "b>a", 0))
    assert ra.opponent_tokens == b_for_a.tokens > 0
    g = cfg.rollout.group_size
    for i, prompt in enumerate(prompts):
        group = ra.texts[i * g : (i + 1) * g]
        want = _pairwise_expected(prompt, group, [b_for_a.texts[i]])
        assert ra.rewards[i * g : (i + 1) * g] == pytest.approx(want, abs=1e-12)
    # then b was judged against a's own rollout-0 answers (the first of each group): no generation
    assert rb.opponent_tokens == 0
    for i, prompt in enumerate(prompts):
        group = rb.texts[i * g : (i + 1) * g]
        want = _pairwise_expected(prompt, group, [ra.texts[i * g]])
        assert rb.rewards[i * g : (i + 1) * g] == pytest.approx(want, abs=1e-12)


def test_utility_rewards_ask_for_no_opponents(actors):
    # Wrong if an absolute reward made the executor generate opponents' answers it cannot use.
    _cfg, engines, _trainers = actors
    cfg = rl_config(reward={"name": "rule", "mode": "utility"})

    async def main():
        ex = RolloutExecutor(cfg, ["a", "b"], engines)
        r = await ex.get(0, "a")
        await ex.shutdown()
        return r, ex._answers

    r, answers = asyncio.run(main())
    assert r.opponent_tokens == 0 and answers == {}


def test_eval_win_rate_is_against_the_recorded_start(actors):
    # Wrong if the win rate were measured against anything but the weights the engine started
    # with: unchanged weights must score exactly the tie value against themselves.
    _cfg, engines, _trainers = actors
    cfg = rl_config(
        rollout={"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6, "eval_prompts": 5}
    )
    engines = {"b": engines["b"]}  # b's engine still serves version 0

    async def main():
        ex = RolloutExecutor(cfg, ["b"], engines)
        start = await ex.record_start(["b"])
        return start, await ex.evaluate(["b"])

    start, ev = asyncio.run(main())
    from hpref.arena import davidson

    p_a, _p_b, p_tie = davidson(0.0, 0.0)
    assert ev["win_rate_vs_start"]["b"] == pytest.approx(p_a + 0.5 * p_tie) == pytest.approx(0.5)
    assert (
        ev["true_utility"]["b"]
        == pytest.approx(ev["true_utility"]["b@start"])
        == pytest.approx(start["true_utility"]["b@start"])
    )
    assert {(x, y) for x, y, _ in ev["battles"]} == {("b", "b@start")} and len(ev["battles"]) == 5
    # the training reward scores the same answers too; unchanged weights tie with their start
    assert ev["reward"]["means"]["b"] == pytest.approx(ev["reward"]["means"]["b@start"])
    assert ev["answer_tokens"]["b"] == ev["answer_tokens"]["b@start"] > 0


def test_measure_kl_reports_the_drift_from_the_start_without_optimising_it(actors):
    # Wrong if `kl` stayed 0 for a policy that moved away from its start (the metric would hide
    # drift), or if measuring it changed the loss (kl_coef = 0 must mean no KL term).
    cfg, engines, _trainers = actors
    # the recipe's `algorithm = { name = "grpo", measure_kl = true }`
    grpo = AlgorithmSection(name="grpo", measure_kl=True)
    measured = cfg.policies["a"].model_copy(update={"algorithm": grpo, "lr": 3e-2})
    trainer = TrainerActor("a", measured, cfg.update_weights_interval)
    assert trainer.reference is not None and resolve_algorithm(grpo, "a").kl_coef == 0

    async def main():
        ex = RolloutExecutor(cfg, ["a"], {"a": engines["b"]})  # any engine: off-policy is fine here
        out = [await ex.get(r, "a") for r in range(2)]
        await ex.shutdown()
        return out

    first, second = asyncio.run(main())
    s0 = trainer.train(first)
    assert s0["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step starts at the reference
    s1 = trainer.train(second)
    assert s1["kl"] > 1e-5, s1
    # the same policy without the measurement takes exactly the same steps: no KL in the loss
    unmeasured = measured.model_copy(update={"algorithm": AlgorithmSection(name="grpo", measure_kl=False)})
    plain = TrainerActor("a", unmeasured, cfg.update_weights_interval)
    assert plain.reference is None
    p0, p1 = plain.train(first), plain.train(second)
    assert (p0["loss"], p1["loss"]) == pytest.approx((s0["loss"], s1["loss"]), abs=1e-6)
    assert p1["kl"] == 0.0
