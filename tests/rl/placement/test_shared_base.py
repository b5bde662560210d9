"""LoRA policies on one shared base (`rl.share_base`, issue #37): when sharing is on and when it is
refused, and that a policy's numbers are the same sharing a base as alone: its answers (the engine's
mixed-adapter batches), its step (one trainer, an adapter and optimizer per policy), its saves.

The end-to-end run through Ray, shared against separate, is `test_a_shared_run_trains_as_separate_ones`."""

from __future__ import annotations

import dataclasses
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from hpref.errors import RecipeError  # noqa: E402
from hpref.recipe.rl import PolicyLoraSection, PolicyModelConfig, parse_rl_section  # noqa: E402
from hpref.rl.placement.shared_base import placement_order, resolve_share_base  # noqa: E402
from hpref.rl.rollout_types import GenerationRequest  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402


def rl_config(policies, share_base=None, engine=None, **defaults):
    data = {
        "defaults": {"model": TINY, "lora": {"r": 4}, **defaults},
        "policies": policies,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 4},
    }
    if engine is not None:
        data["engine"] = engine
    if share_base is not None:
        data["share_base"] = share_base
    return parse_rl_section({"rl": data}["rl"])


# --------------------------------------------------------------------------------------------------
# when a base is shared


def test_sharing_follows_where_the_engines_run_unless_the_recipe_says():
    """Unset, two LoRA policies of one base share when their engines run on a GPU and not on CPU
    engines, where one shared engine measured 1.64x two apart's wall time; `true` / `false` win
    either way, and each decision carries its reason. Wrong if a CPU run paid the slower setting by
    default, a GPU run paid two bases, a lone policy lost its merged-weight engine, or the reason
    (printed by the plan, written to rl.json) said something other than what decided."""
    from hpref.rl.placement.shared_base import CPU_REASON, GPU_REASON, share_base_line

    # the transformers engine: CPU
    both = rl_config({"a": {}, "b": {"lr": 5e-4, "algorithm": {"kl_coef": 0.1}}})
    cpu = resolve_share_base(both, ["a", "b"], "r.toml")
    assert (cpu.share_base, cpu.share_base_reason) == (False, CPU_REASON)
    assert placement_order(cpu, ["a", "b"]) == ["a", "b"]
    assert share_base_line(cpu) == f"share_base = false: {CPU_REASON}" and "1.64x" in CPU_REASON
    gpu = rl_config({"a": {}, "b": {}}, engine={"name": "vllm", "num_gpus": 1})
    decided = resolve_share_base(gpu, ["a", "b"], "r.toml")
    assert (decided.share_base, decided.share_base_reason) == (True, GPU_REASON)
    assert placement_order(decided, ["a", "b"]) == ["a"]
    # a decided config is not decided again (its reason would become "set in the recipe")
    assert resolve_share_base(decided, ["a", "b"], "r.toml") is decided
    # the recipe's word wins on either device
    on = resolve_share_base(rl_config({"a": {}, "b": {}}, share_base=True), ["a", "b"], "r.toml")
    assert (on.share_base, on.share_base_reason) == (True, "set in the recipe (rl.share_base = true)")
    off = rl_config({"a": {}, "b": {}}, share_base=False, engine={"name": "vllm", "num_gpus": 1})
    assert resolve_share_base(off, ["a", "b"], "r.toml").share_base is False
    assert resolve_share_base(both, ["a"], "r.toml").share_base_reason == "one policy: nothing to share"
    assert resolve_share_base(rl_config({"a": {}}, share_base=True), ["a"], "r").share_base is True
    # another base (a seed of a tiny model), or full fine-tuning: each trains alone, even on a GPU,
    # and the reason names the key that differs
    other = rl_config({"a": {}, "b": {"model": {"seed": 3}}}, engine={"name": "vllm", "num_gpus": 1})
    apart = resolve_share_base(other, ["a", "b"], "r.toml")
    assert apart.share_base is False and placement_order(apart, ["a", "b"]) == ["a", "b"]
    assert apart.share_base_reason.startswith("the policies cannot share one base (rl.policies.b.model.seed")
    full = rl_config({"a": {}, "b": {"lora": None}}, engine={"name": "vllm", "num_gpus": 1})
    assert resolve_share_base(full, ["a", "b"], "r.toml").share_base is False


@pytest.mark.parametrize(
    ("b", "key"),
    [
        ({"model": {"seed": 3}}, "rl.policies.b.model.seed: policy 'b' has another base than 'a' (3 vs 0)"),
        ({"lora": None}, "rl.policies.b.lora: policy 'b' trains every weight (full fine-tuning)"),
        ({"ranks": 2}, "rl.policies.b.ranks: 2 vs 1 for 'a'"),
    ],
)
def test_share_base_true_for_policies_that_cannot_share_is_one_line_naming_the_key(b, key):
    # Wrong if a recipe asking to share what cannot be shared started (and failed inside an actor)
    config = rl_config({"a": {}, "b": b}, share_base=True)
    with pytest.raises(RecipeError) as err:
        resolve_share_base(config, ["a", "b"], "r.toml")
    message = str(err.value)
    assert message.startswith("r.toml: rl.share_base = true, but ") and key in message
    assert "\n" not in message


def test_an_engine_that_serves_no_adapters_cannot_share(monkeypatch):
    # Wrong if a plugin engine without adapters were handed a shared base's policies (the engine
    # taken as on a GPU, where an unset share_base would otherwise share)
    import hpref.rl.placement.resources

    config = rl_config({"a": {}, "b": {}}, share_base=True)
    monkeypatch.setattr(type(config.engine_config), "serves_adapters", False)
    with pytest.raises(RecipeError, match="rl.engine.name: the 'transformers' engine cannot serve LoRA"):
        resolve_share_base(config, ["a", "b"], "r.toml")
    config.share_base = None
    monkeypatch.setattr(hpref.rl.placement.resources, "engines_on_gpu", lambda config: True)
    decided = resolve_share_base(config, ["a", "b"], "r.toml")
    assert decided.share_base is False and "cannot serve LoRA" in decided.share_base_reason


# --------------------------------------------------------------------------------------------------
# the same numbers shared as alone


def _rollout(policy, rollout_id, seed):
    from benchmarks.common import random_rollout

    rollout = random_rollout(
        rollout_id,
        random.Random(seed),
        prompts=2,
        group=2,
        prompt_tokens=(3, 8),
        answer_tokens=(2, 6),
        vocab=250,
    )
    rollout.policy = policy
    return rollout


def test_a_shared_trainer_steps_each_policy_as_its_own_trainer_would():
    # Wrong if a policy's step on a shared base differed from the same step alone: its adapter's
    # init, its own optimizer and lr, its KL (the base with every adapter off), or another policy's
    # adapter leaking into its forward or its gradients
    from hpref.models.lm_adapters import adapter_items, lm_adapter_state
    from hpref.rl.trainer.actor import TrainerActor

    config = rl_config(
        {"a": {"algorithm": {"measure_kl": True}}, "b": {"lr": 3e-3, "algorithm": {"kl_coef": 0.2}}},
        precision="fp32",
    )
    policies = config.policies
    shared = TrainerActor("a", policies["a"], 1, shared=dict(policies))
    alone = {p: TrainerActor(p, policies[p], 1) for p in ("a", "b")}
    for r in range(2):
        for p, seed in (("a", 10 + r), ("b", 20 + r)):
            want = alone[p].train(_rollout(p, r, seed))
            got = shared.train(_rollout(p, r, seed))
            for key in ("loss", "kl", "clip_fraction", "grad_norm", "engine_trainer_logprob_diff"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (p, r, key)
    assert (
        shared.slots["b"].rollouts_done == 2
        and shared.slots["a"].optimizer is not shared.slots["b"].optimizer
    )
    for p in ("a", "b"):
        mine = {k: v for k, v in adapter_items(shared.model, p)}
        theirs = lm_adapter_state(alone[p].lora)  # PEFT's own saved names and values
        assert set(mine) == set(theirs)
        for key, value in theirs.items():
            torch.testing.assert_close(mine[key], value, rtol=1e-5, atol=1e-7)
    # the two adapters trained apart (b's lr and KL differ): a sync carries one policy's alone
    assert not torch.equal(
        dict(adapter_items(shared.model, "a"))[key], dict(adapter_items(shared.model, "b"))[key]
    )
    version, sent = shared.update_weights("b")
    assert version == 2 and set(sent) == set(theirs)


def test_shared_saves_are_a_policy_of_its_own_saves_and_resume_either_way(tmp_path):
    # Wrong if a save on a shared base could only resume on a shared base (or the reverse): the
    # files are one policy's, whatever trained it
    from hpref.models.lm_adapters import adapter_items, lm_adapter_state
    from hpref.rl.trainer.actor import TrainerActor

    config = rl_config({"a": {}, "b": {"lr": 3e-3}}, precision="fp32")
    shared = TrainerActor("a", config.policies["a"], 1, shared=dict(config.policies))
    shared.train(_rollout("b", 0, 5))
    shared.save(str(tmp_path / "b"), "b")
    alone = TrainerActor("b", config.policies["b"], 1)
    assert alone.load(str(tmp_path / "b")) == 1
    for key, value in lm_adapter_state(alone.lora).items():
        torch.testing.assert_close(dict(adapter_items(shared.model, "b"))[key], value)
    alone.train(_rollout("b", 1, 6))
    alone.save(str(tmp_path / "b2"))
    again = TrainerActor("a", config.policies["a"], 1, shared=dict(config.policies))
    assert again.load(str(tmp_path / "b2"), "b") == 2 and again.slots["a"].rollouts_done == 0
    for key, value in lm_adapter_state(alone.lora).items():
        torch.testing.assert_close(dict(adapter_items(again.model, "b"))[key], value)
    # the optimizer moments came back too: the next step is the one the lone trainer takes
    want = alone.train(_rollout("b", 2, 7))
    got = again.train(_rollout("b", 2, 7))
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and got["grad_norm"] == pytest.approx(
        want["grad_norm"], rel=1e-5
    )


def test_a_shared_engine_answers_each_policy_as_its_own_engine_would():
    # Wrong if a policy's answers depended on the other policies batched with it (the sampling
    # stream, padding to the batch's longest prompt, another adapter's weights) or if an adapter's
    # update reached another policy
    from hpref.models.lm_adapters import adapter_items
    from hpref.rl.engines.transformers_engine import EngineActor

    model, lora = PolicyModelConfig(**TINY), PolicyLoraSection(r=4)
    shared = EngineActor("a", model, adapters={"a": lora, "b": lora})
    alone = EngineActor("a", model)
    prompts = [("hello there",), ("what is two plus two and why",)]

    def request(adapter, seed, temperature=1.0, max_new=5, greedy=False, group=2):
        return GenerationRequest(
            prompts=prompts if group > 1 else prompts[:1],
            group_size=group,
            max_new_tokens=max_new,
            temperature=temperature,
            top_k=3 if adapter == "b" else 0,
            seed=seed,
            greedy=greedy,
            adapter=adapter,
        )

    asked = [request("a", 1), request("b", 2, 0.7, 3), request("a", 0, greedy=True, group=1)]
    got = shared.generate_batch(asked)
    for req, out in zip(asked, got, strict=True):
        own = {k: v for k, v in dataclasses.asdict(req).items() if k != "adapter"}
        want = alone.generate(**own)
        assert out.completions == want.completions and out.prompt_ids == want.prompt_ids
        for mine, theirs in zip(out.logprobs, want.logprobs, strict=True):
            assert mine == pytest.approx(theirs, abs=1e-5)
    # in passes of at most 4 answers (`batch_rows`): the same answers again
    shared.batch_rows = 4
    assert [o.completions for o in shared.generate_batch(asked)] == [o.completions for o in got]
    shared.batch_rows = 0
    # a sync of b's adapter: b's answers move, a's stay, each at its own version
    state = {k: torch.randn_like(v) * 0.5 for k, v in adapter_items(shared.model, "b")}
    shared.begin_update(1, adapter="b")
    shared.load_weights(state, adapter="b")
    assert shared.commit_update(adapter="b") == 1
    after = shared.generate_batch(asked[:2])
    assert after[0].logprobs == got[0].logprobs and after[0].version == 0
    assert after[1].logprobs != got[1].logprobs and after[1].version == 1
    # a bad update (a's names under b's shapes missing) is refused whole; b keeps serving version 1
    shared.begin_update(2, adapter="b")
    shared.load_weights(dict(list(state.items())[:-1]), adapter="b")
    with pytest.raises(ValueError, match="engine 'a' adapter 'b': weight update refused .*version 1 keeps"):
        shared.commit_update(adapter="b")
    assert shared.get_version("b") == 1


# --------------------------------------------------------------------------------------------------
# end to end, through Ray


def _run_recipe(run_dir, **rl_over):
    from hpref.recipe import recipe_from_dict

    rl = {
        "num_rollouts": 2,
        # staleness 0: every rollout is generated by the weights of the step before it, so which
        # version answers does not depend on timing, shared or not, resumed or not
        "staleness_limit": 0,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 5},
        "reward": {"name": "rule"},
        "defaults": {"model": TINY, "lr": 1e-2, "lora": {"r": 4}, "precision": "fp32"},
        "policies": {"a": {"algorithm": {"kl_coef": 0.05}}, "b": {"lr": 5e-3}},
        "save_interval": 1,
    }
    rl.update(rl_over)
    return recipe_from_dict({"run": {"name": run_dir.name, "output_dir": str(run_dir.parent)}, "rl": rl})


def _rows(run_dir, policy):
    import json

    rows = {}
    for line in (run_dir / "metrics" / f"{policy}.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            rows[row["rollout"]] = row
    return rows


@pytest.mark.slow
def test_a_shared_run_trains_as_separate_ones(ray_cluster, tmp_path):
    # Wrong if sharing a base changed what a policy learns (its rollouts, losses or adapter). That a
    # shared trainer's save resumes exactly, on a shared base or alone, is
    # test_shared_saves_are_a_policy_of_its_own_saves_and_resume_either_way's (the driver's resume
    # is the same for every trainer: test_e2e_ray.py); a stop and resume here cost ~20 s
    import json

    from safetensors.torch import load_file

    from hpref.rl.control.record import read_record
    from hpref.rl.launch import run_rl
    from hpref.rl.placement.shared_base import CPU_REASON

    separate, shared = tmp_path / "separate", tmp_path / "shared"
    # unset on CPU engines: apart, and rl.json says so and why
    assert run_rl(_run_recipe(separate), ["a", "b"]) == 0
    assert run_rl(_run_recipe(shared, share_base=True), ["a", "b"]) == 0
    written = {d: json.loads((d / "rl.json").read_text()) for d in (separate, shared)}
    assert written[separate]["config"]["share_base"] is False
    assert written[separate]["share_base_reason"] == CPU_REASON
    assert written[shared]["config"]["share_base"] is True
    assert written[shared]["share_base_reason"] == "set in the recipe (rl.share_base = true)"
    for p in ("a", "b"):
        want, got = _rows(separate, p), _rows(shared, p)
        common = sorted(set(want) & set(got))
        assert common[:2] == [0, 1] if p == "a" else common[:1] == [0]
        for r in common:
            assert got[r]["reward_mean"] == want[r]["reward_mean"], (p, r)  # the same answers
            for key in ("loss", "kl", "grad_norm"):
                assert got[r][key] == pytest.approx(want[r][key], rel=1e-4, abs=1e-6), (p, r, key)
    final = {d: read_record(d).save_dir for d in (separate, shared)}
    files = {d: load_file(str(d / final[d] / "a" / "adapter" / "adapter_model.safetensors")) for d in final}
    for key, value in files[separate].items():
        torch.testing.assert_close(files[shared][key], value, rtol=1e-4, atol=1e-6)

    # each policy of the shared base exports (`hpref save --policy`) as its base plus its own saved
    # adapter, and policy a as its separately trained twin: wrong if the export took another adapter
    # of the shared trainer, or none (the seeded base itself)
    from transformers import AutoModelForCausalLM

    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl import PolicyModelConfig
    from hpref.save.export import save_export
    from tests.rl.exports import check_merged

    start = build_policy_model(PolicyModelConfig(**TINY))[0].state_dict()
    exported = {}
    for d, p in ((separate, "a"), (shared, "a"), (shared, "b")):
        folder = save_export(d, tmp_path / f"{d.name}-{p}", policy=p)
        exported[d, p] = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for p in ("a", "b"):
        assert check_merged(exported[shared, p], start, shared / final[shared] / p / "adapter") > 0
    for key, value in exported[separate, "a"].items():
        torch.testing.assert_close(exported[shared, "a"][key], value, rtol=1e-4, atol=1e-6)


def test_requests_that_queue_while_the_shared_engine_works_go_as_one_batch():
    # Wrong if a shared engine got the policies' requests one by one (no batching), lost one, or
    # answered a request with another's result
    import asyncio

    from hpref.rl.rollout.batching import RequestBatcher

    batches = []

    class Engine:
        class generate_batch:  # noqa: N801 - Ray's `handle.method.remote(...)` shape
            @staticmethod
            async def remote(requests):
                batches.append([r.adapter for r in requests])
                await asyncio.sleep(0.05)  # the engine at work while more requests queue
                return [{"who": r.adapter} for r in requests]

    def ask(adapter):
        return GenerationRequest([("q",)], group_size=1, max_new_tokens=1, temperature=1.0, adapter=adapter)

    async def main():
        batcher = RequestBatcher(Engine())
        first = [asyncio.ensure_future(batcher.generate(ask(p))) for p in ("a", "b")]
        await asyncio.sleep(0.01)  # the engine is busy with a and b
        later = [asyncio.ensure_future(batcher.generate(ask(p))) for p in ("c", "a")]
        return [await f for f in first + later]

    answers = asyncio.run(main())
    assert batches == [["a", "b"], ["c", "a"]]
    assert [a["who"] for a in answers] == ["a", "b", "c", "a"]

    # an engine that runs passes of 2 answers gets one pass per call (a sync waits for one pass)
    async def capped():
        batcher = RequestBatcher(Engine(), max_rows=2)
        calls = [batcher.generate(ask(p)) for p in "abc"]
        return await asyncio.gather(*calls)

    batches.clear()
    assert [a["who"] for a in asyncio.run(capped())] == ["a", "b", "c"]
    assert batches == [["a", "b"], ["c"]]
