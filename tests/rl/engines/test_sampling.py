"""The sampling knobs `top_p`, `min_p`, `repetition_penalty` and `stop` (`hpref.recipe.rl_sampling`):
each draws as it is defined (against transformers' own warpers and hand computations), a request's
answers do not depend on the knobs of the requests batched with it, a stop string cuts an answer's
text, tokens and log-probs alike, the executor hands them to engines only when they are on, the
vLLM engine gets the same meaning as `SamplingParams`, and bad values are one line at recipe load
whatever the engine. No Ray: the samplers are called directly, the engine is a tiny in-process one.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

torch = pytest.importorskip("torch")

from hpref.errors import RecipeError  # noqa: E402
from hpref.hookspecs import hookimpl  # noqa: E402
from hpref.plugins import load_plugins  # noqa: E402
from hpref.recipe.rl import PolicyModelConfig, parse_rl_section  # noqa: E402
from hpref.recipe.rl_sampling import KNOBS_OFF, MAX_STOP_STRINGS, sampling_knobs  # noqa: E402
from hpref.rl.engines.sampling import Block, RowSampler, penalised, truncated  # noqa: E402
from hpref.rl.protocols import EngineConfigBase  # noqa: E402
from hpref.rl.rollout_types import Generation, GenerationRequest  # noqa: E402
from tests.rl.local_actor import LocalActor  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402

PROMPTS = [("hello there",), ("what is two plus two and why",)]


def kept(scores: torch.Tensor) -> list[list[int]]:
    """The token ids each row of truncated scores still allows."""
    return [torch.nonzero(row > float("-inf")).flatten().tolist() for row in scores]


def a_stop_string(texts: list[str]) -> str:
    """Two ASCII letters or digits from inside one of `texts` (not at its start): a stop string some
    answer reaches after saying something (a tiny random policy's answers are mostly odd bytes)."""
    return next(
        t[i : i + 2]
        for t in texts
        for i in range(1, len(t) - 1)
        if t[i : i + 2].isascii() and t[i : i + 2].isalnum()
    )


# --------------------------------------------------------------------------------------------------
# the knobs' maths


def test_top_p_min_p_and_top_k_keep_what_transformers_warpers_keep_in_vllms_order():
    """Wrong if a knob kept another set of tokens than the library implementations users know
    (transformers' warpers, which vLLM matches for each alone), or if min-p and top-p together ran
    in transformers' order (top-p first) instead of vLLM's (min-p first), which would make the two
    engines draw from different sets."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    scaled = torch.randn(6, 40) * 2
    ids = torch.zeros((6, 1), dtype=torch.long)
    for top_p in (0.3, 0.9):
        assert kept(truncated(scaled, 0, top_p, 0.0)) == kept(TopPLogitsWarper(top_p)(ids, scaled.clone()))
    for min_p in (0.05, 0.5):
        assert kept(truncated(scaled, 0, 1.0, min_p)) == kept(MinPLogitsWarper(min_p)(ids, scaled.clone()))
    both = TopPLogitsWarper(0.8)(ids, TopKLogitsWarper(5)(ids, scaled.clone()))
    assert kept(truncated(scaled, 5, 0.8, 0.0)) == kept(both)
    assert truncated(scaled, 0, 1.0, 0.0) is scaled  # all off: the scores as they were

    # probabilities .4 .3 .2 .1, min_p .3 (drops .1), top_p .75: over the three left (.44 .33 .22)
    # top-p keeps two; transformers' order (top-p over all four first) would keep three
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    assert kept(truncated(logits, 0, 0.75, 0.3)) == [[0, 1]]
    assert kept(MinPLogitsWarper(0.3)(ids[:1], TopPLogitsWarper(0.75)(ids[:1], logits.clone()))) == [
        [0, 1, 2]
    ]


def test_repetition_penalty_is_ctrls_over_the_prompt_and_answer_never_the_padding():
    """Wrong if a seen token's logit were not divided (positive) or multiplied (negative) by the
    penalty as transformers and vLLM do, if a left-padding column counted as a seen token (vLLM
    sees no padding), or if the recorded log-prob were the penalised one instead of the trainer's."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[0, 1, 1]])
    assert penalised(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, 3.0]]
    assert torch.equal(
        penalised(logits, seen, 2.0), RepetitionPenaltyLogitsProcessor(2.0)(seen, logits.clone())
    )

    # a greedy row whose prompt is token 2 after one padding column holding token 3
    block = Block(0, 1, 1.0, 0, True, 0, repetition_penalty=2.0)
    input_ids = torch.tensor([[3, 2]])
    padded = RowSampler([block], prompt_starts=[1])
    assert padded(input_ids, logits.clone()).argmax(-1).tolist() == [3]  # 3 is padding: not penalised
    unpadded = RowSampler([block], prompt_starts=[0])
    assert unpadded(input_ids, logits.clone()).argmax(-1).tolist() == [0]  # 3 seen: 3.0 / 2 < 2.0
    assert unpadded.token_logprobs()[0, 0].item() == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())


def run_sampler(blocks: list[Block], scores: list[torch.Tensor], prompt: torch.Tensor) -> tuple[list, list]:
    """Steps of a `RowSampler` over given scores, its choices fed back as `generate` does: the
    chosen tokens per step and the recorded log-probs."""
    sampler = RowSampler(blocks)
    input_ids, chosen = prompt, []
    for step in scores:
        token = sampler(input_ids, step.clone()).argmax(-1)
        chosen.append(token.tolist())
        input_ids = torch.cat([input_ids, token[:, None]], dim=1)
    return chosen, sampler.token_logprobs().tolist()


def test_each_knob_draws_as_defined_and_records_the_trainers_logprob():
    """Wrong if a tiny top_p did not always take the likeliest token (nucleus of one), if min_p let
    through a token under min_p x the likeliest one's probability, or if the recorded log-prob were
    read from the truncated distribution instead of the full one at the temperature."""
    torch.manual_seed(1)
    rows, steps = 8, 12
    scores = [torch.randn(rows, 30) for _ in range(steps)]
    prompt = torch.randint(0, 30, (rows, 3))
    nucleus, logprobs = run_sampler([Block(0, rows, 0.7, 0, False, 5, top_p=1e-6)], scores, prompt)
    assert nucleus == [s.argmax(-1).tolist() for s in scores]
    for t, s in enumerate(scores):
        full = torch.log_softmax(s / 0.7, dim=-1)
        assert [logprobs[r][t] for r in range(rows)] == pytest.approx(full.max(-1).values.tolist(), abs=1e-6)

    def under_min_p(chosen):
        probs = [torch.softmax(s, -1) for s in scores]
        return sum(
            p[r, c] < 0.5 * p[r].max()
            for p, row in zip(probs, chosen, strict=True)
            for r, c in enumerate(row)
        )

    plain, _ = run_sampler([Block(0, rows, 1.0, 0, False, 5)], scores, prompt)
    with_min_p, _ = run_sampler([Block(0, rows, 1.0, 0, False, 5, min_p=0.5)], scores, prompt)
    assert under_min_p(plain) > 0 and under_min_p(with_min_p) == 0


def test_a_blocks_draws_do_not_depend_on_the_knobs_of_the_blocks_beside_it():
    """Wrong if one request's knobs (or its rows' tokens, for the penalty) leaked into another's
    draws: a shared-base engine batches policies with different rollout settings, and a policy's
    answers must be the ones it gets alone."""
    torch.manual_seed(2)
    scores = [torch.randn(5, 30) for _ in range(10)]
    prompt = torch.randint(0, 30, (5, 4))
    a = dict(temperature=0.9, top_k=0, greedy=False, seed=11, top_p=0.8, repetition_penalty=1.4)
    b = dict(temperature=1.2, top_k=7, greedy=False, seed=12, min_p=0.1)
    together, lp = run_sampler([Block(0, 2, **a), Block(2, 5, **b)], scores, prompt)
    alone_a, lp_a = run_sampler([Block(0, 2, **a)], [s[:2] for s in scores], prompt[:2])
    alone_b, lp_b = run_sampler([Block(0, 3, **b)], [s[2:] for s in scores], prompt[2:])
    assert [row[:2] for row in together] == alone_a and [row[2:] for row in together] == alone_b
    assert lp[:2] == [pytest.approx(row) for row in lp_a] and lp[2:] == [pytest.approx(row) for row in lp_b]


# --------------------------------------------------------------------------------------------------
# the transformers engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One tiny in-process transformers engine for the engine tests of this module."""
    from hpref.rl.engines.transformers_engine import EngineActor

    mp = pytest.MonkeyPatch()
    mp.setenv("HPREF_CACHE", str(tmp_path_factory.mktemp("hpref-cache")))
    yield EngineActor("a", PolicyModelConfig(**TINY))
    mp.undo()


def test_a_stop_string_cuts_text_tokens_and_logprobs_alike_alone_or_batched(engine):
    """Wrong if an answer went past its stop string, kept it in its text, kept tokens whose text is
    not the answer's (the trainer would train on text the reward never saw), misaligned the engine
    log-probs, or if a request's answers changed when batched with one holding other knobs."""
    from hpref.rl.policy import stop_string_cut

    free = engine.generate(PROMPTS, 2, 12, 1.0, 0, 5)
    stop = a_stop_string(free.texts)  # from inside an answer given without it
    asked = dict(prompts=PROMPTS, group_size=2, max_new_tokens=12, temperature=1.0, seed=5, stop=[stop])
    cut = engine.generate(**asked)
    assert any(stop in t for t in free.texts)
    for i, tokens in enumerate(free.completions):
        keep = stop_string_cut(engine.tokenizer, tokens, [stop])
        assert cut.completions[i] == tokens[:keep]  # the same draws, ended at the stop string
        assert cut.logprobs[i] == pytest.approx(free.logprobs[i][:keep], abs=1e-6)
        assert cut.texts[i] == engine.tokenizer.decode(tokens[:keep], skip_special_tokens=True)
        assert stop not in cut.texts[i]
        if stop in free.texts[i]:
            assert keep < len(tokens) and free.texts[i].startswith(cut.texts[i])
            assert len(cut.texts[i]) <= free.texts[i].index(stop)
        else:
            assert keep == len(tokens)
    other = dict(asked, prompts=PROMPTS[::-1], seed=9, stop=[], top_p=0.7, repetition_penalty=1.3)
    together = engine.generate_batch([GenerationRequest(**asked), GenerationRequest(**other)])
    alone = engine.generate(**other)
    assert together[0].completions == cut.completions and together[1].completions == alone.completions


def test_a_tiny_top_p_is_greedy_and_the_penalty_reaches_greedy_answers(engine):
    """Wrong if top_p did not reach the sampler (a nucleus of one is the greedy answer), if a greedy
    request ignored its repetition penalty (evals answer with the policy's own behaviour), or if
    the penalty did not apply the same way to sampled and greedy rows."""
    greedy = engine.generate(PROMPTS, 1, 10, 1.0, greedy=True, repetition_penalty=1.5)
    nucleus = engine.generate(PROMPTS, 1, 10, 1.0, seed=3, top_p=1e-6, repetition_penalty=1.5)
    assert nucleus.completions == greedy.completions
    plain = engine.generate(PROMPTS, 1, 10, 1.0, greedy=True)
    assert plain.completions != greedy.completions


# --------------------------------------------------------------------------------------------------
# the recipe, the executor, and the vLLM engine's mapping


def section(engine: str = "transformers", **over):
    data = {"defaults": {"model": TINY}, "policies": {"a": {}}, "engine": {"name": engine}}
    data.update(over)
    return parse_rl_section(data, "r.toml")


@pytest.mark.parametrize("engine_name", ["transformers", "vllm"])
@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"rollout": {"top_p": 0}}, "r.toml: rl.rollout.top_p: Input should be greater than 0, got 0"),
        (
            {"rollout": {"top_p": 1.5}},
            "r.toml: rl.rollout.top_p: Input should be less than or equal to 1, got 1.5",
        ),
        ({"rollout": {"min_p": 1}}, "r.toml: rl.rollout.min_p: Input should be less than 1, got 1"),
        (
            {"rollout": {"min_p": -0.1}},
            "r.toml: rl.rollout.min_p: Input should be greater than or equal to 0",
        ),
        (
            {"rollout": {"repetition_penalty": 0}},
            "r.toml: rl.rollout.repetition_penalty: Input should be greater than 0, got 0",
        ),
        ({"rollout": {"stop": ["</a>", ""]}}, "r.toml: rl.rollout.stop: a stop string cannot be empty"),
        (
            {"rollout": {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}},
            f"r.toml: rl.rollout.stop: {MAX_STOP_STRINGS + 1} stop strings; at most {MAX_STOP_STRINGS}",
        ),
        (
            {"policies": {"a": {"rollout": {"top_p": 2}}}},
            "r.toml: rl.policies.a.rollout.top_p: Input should be less than or equal to 1, got 2",
        ),
        (
            {"defaults": {"model": TINY, "rollout": {"stop": [""]}}},
            "r.toml: rl.defaults.rollout.stop: a stop string cannot be empty",
        ),
    ],
)
def test_bad_knobs_are_one_line_naming_the_key_whatever_the_engine(engine_name, over, message):
    """Wrong if a value outside a knob's range reached an engine (vLLM would refuse it mid-run, the
    transformers engine would sample from nothing), or if the two engines refused differently."""
    with pytest.raises(RecipeError) as info:
        section(engine_name, **over)
    assert "\n" not in str(info.value) and str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("engine_name", ["transformers", "vllm"])
def test_both_engines_take_every_knob_and_a_policy_overrides_them(engine_name):
    """Wrong if a built-in engine did not declare a knob it honours (its recipes would be refused),
    if a policy's override did not replace the shared value, or if an off knob were handed on."""
    config = section(
        engine_name,
        rollout={"top_p": 0.9, "stop": ["\n\n"]},
        policies={"a": {}, "b": {"rollout": {"top_p": 1.0, "min_p": 0.05, "repetition_penalty": 1.1}}},
    )
    assert config.engine_config.sampling_knobs == frozenset(KNOBS_OFF)
    assert sampling_knobs(config.policy_rollout("a")) == {"top_p": 0.9, "stop": ("\n\n",)}
    assert sampling_knobs(config.policy_rollout("b")) == {
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "stop": ("\n\n",),
    }
    assert sampling_knobs(section(engine_name).rollout) == {}


def test_an_engine_that_does_not_declare_a_knob_is_refused_at_load(fresh_registry):
    """Wrong if a recipe could turn a knob on for an engine plugin that would drop it (or fail on the
    keyword after every actor started): one line naming the key and the engine, at load."""

    class Config(EngineConfigBase):
        pass

    class Plugin:
        __name__ = "old-engine"

        @hookimpl
        def register_engines(self, register):
            register(name="old", config=Config, build=lambda config, **_: None, description="old")

    load_plugins(extra=[Plugin()])
    assert section("old").engine.name == "old"  # knobs off: the plugin runs as before
    with pytest.raises(
        RecipeError, match=r"^r.toml: rl.policies.a.rollout.stop: the 'old' engine does not take"
    ):
        section("old", policies={"a": {"rollout": {"stop": ["x"]}}})
    with pytest.raises(RecipeError, match=r"^r.toml: rl.rollout.top_p: the 'old' engine does not take top_p"):
        section("old", rollout={"top_p": 0.5})


def answers(n: int) -> Generation:
    """What an engine's `generate` returns for `n` one-token answers "x"."""
    return Generation(
        prompt_ids=[[1]] * n,
        completions=[[5]] * n,
        logprobs=[[-1.0]] * n,
        texts=["x"] * n,
        version=0,
        tokens=n,
        seconds=0.0,
    )


class OldEngine:
    """An engine plugin whose `generate` predates the knobs: positional arguments only (a keyword
    it does not know is a TypeError). Records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def generate(self, prompts, group_size, max_new_tokens, temperature, top_k=0, seed=0, greedy=False):
        self.calls.append(((group_size, greedy), {}))
        return answers(len(prompts) * group_size)

    def get_version(self) -> int:
        return 0


class KnobEngine(OldEngine):
    """An engine that takes the knobs, as keywords."""

    def generate(
        self, prompts, group_size, max_new_tokens, temperature, top_k=0, seed=0, greedy=False, **knobs
    ):
        self.calls.append(((group_size, greedy), knobs))
        return answers(len(prompts) * group_size)


def test_the_executor_hands_an_engine_only_the_knobs_that_are_on():
    """Wrong if an engine whose `generate` predates the knobs got keywords it cannot take while a
    recipe leaves them off, if a policy's own knobs did not reach its rollouts, or if greedy evals
    lost the penalty and stop strings (or got the truncation knobs, which cannot change them)."""
    from hpref.rl.rollout.batching import RequestBatcher
    from hpref.rl.rollout.executor import RolloutExecutor

    config = section(
        rollout={"group_size": 2, "prompts_per_rollout": 2, "eval_prompts": 2},
        policies={"a": {}, "b": {"rollout": {"top_p": 0.5, "repetition_penalty": 1.2, "stop": ["\n"]}}},
    )
    engines = {"a": OldEngine(), "b": KnobEngine()}
    executor = RolloutExecutor(config, ["a", "b"], {p: LocalActor(e) for p, e in engines.items()})

    async def main():
        prompts = executor._eval_prompts()
        for p in ("a", "b"):
            await executor._produce(p, 0)
            await executor._greedy_answers([p], prompts)

    asyncio.run(main())
    assert engines["a"].calls == [((2, False), {}), ((1, True), {})]
    sampled = {"top_p": 0.5, "repetition_penalty": 1.2, "stop": ("\n",)}
    greedy = {"repetition_penalty": 1.2, "stop": ("\n",)}
    assert engines["b"].calls == [((2, False), sampled), ((1, True), greedy)]

    asked = []

    class Batched:
        class generate_batch:  # noqa: N801 - Ray's `handle.method.remote(...)` shape
            @staticmethod
            async def remote(requests):
                asked.extend(requests)
                return [answers(r.rows) for r in requests]

    # a shared base's engine: the knobs in the request
    executor.batcher = executor.players.batcher = RequestBatcher(Batched())
    asyncio.run(executor.players.generate("b", PROMPTS, 2, 5, 1.0, 0, 7, **sampled))
    assert asked == [
        GenerationRequest(
            prompts=PROMPTS,
            group_size=2,
            max_new_tokens=5,
            temperature=1.0,
            top_k=0,
            seed=7,
            adapter="b",
            **sampled,
        )
    ]


def test_the_vllm_engine_gets_the_same_knobs_as_sampling_params():
    """Wrong if a knob did not reach vLLM under its own name, if a greedy request were truncated (or
    lost its penalty and stop strings), or if vLLM were asked to detokenize for no stop string."""
    from hpref.rl.engines.vllm_engine import sampling_params

    request = GenerationRequest(
        prompts=PROMPTS,
        group_size=3,
        max_new_tokens=9,
        temperature=0.8,
        top_k=4,
        seed=1,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.2,
        stop=("</a>",),
    )
    got = sampling_params(request, 17, [2])
    assert {k: got[k] for k in ("n", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")} == dict(
        n=3, temperature=0.8, top_k=4, top_p=0.9, min_p=0.05, repetition_penalty=1.2
    )
    assert got["stop"] == ["</a>"] and got["include_stop_str_in_output"] is False and got["detokenize"]
    assert (got["max_tokens"], got["seed"], got["stop_token_ids"]) == (9, 17, [2])
    greedy = sampling_params(dataclasses.replace(request, greedy=True), 17, [2])
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"], greedy["min_p"]) == (0.0, 0, 1.0, 0.0)
    assert greedy["repetition_penalty"] == 1.2 and greedy["stop"] == ["</a>"]
    plain = sampling_params(
        GenerationRequest(prompts=PROMPTS, group_size=1, max_new_tokens=3, temperature=1.0), 0, [2]
    )
    assert (plain["top_p"], plain["min_p"], plain["repetition_penalty"], plain["stop"]) == (1.0, 0.0, 1.0, [])
    assert plain["detokenize"] is False
