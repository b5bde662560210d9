"""The sampling knobs of `hpref rl` beyond temperature and top-k, in `[rl.rollout]` and in a policy's
`rollout` table (`rl.policies.<id>.rollout = { top_p = 0.9 }`):

    [rl.rollout]
    top_p = 0.9                  # nucleus: the fewest likeliest tokens holding 90% of the probability
    min_p = 0.05                 # drop tokens under 5% of the likeliest token's probability
    repetition_penalty = 1.1     # CTRL's: a token seen in the prompt or answer has its logit divided
                                 # by 1.1 when positive, multiplied when negative
    stop = ["</answer>"]         # an answer ends where one of these first appears, without it

Each is off at its default (1, 0, 1, no strings) and means the same on both built-in engines: the
transformers engine draws with them itself (`hpref.rl.engines.sampling`), vLLM gets them as its
`SamplingParams`, and both cut an answer at a stop string the same way (`hpref.rl.policy.
stop_string_cut`). An engine component says which of them it takes (`sampling_knobs` on its config
class); a recipe that sets one its engine does not take is refused when it loads
(`check_engine_knobs`), not in the middle of a run.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field

from hpref.errors import RecipeError

#: At most this many stop strings per policy: every unfinished answer is decoded and searched for each
#: of them after every token it grows (the transformers engine here, vLLM's detokenizer there), so the
#: list is a per-token cost, and a longer one is likelier a string split into characters than a plan.
MAX_STOP_STRINGS = 16

#: Each knob's off value: an engine gets a knob (a keyword argument of `Engine.generate`) only when
#: it is on, so an engine whose `generate` predates the knobs keeps working while they stay off.
KNOBS_OFF: dict[str, Any] = {"top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "stop": ()}


def _stop_strings(value: list[str]) -> list[str]:
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(
            f"{len(value)} stop strings; at most {MAX_STOP_STRINGS} (each is searched in every answer "
            "after every token)"
        )
    if any(not s for s in value):
        raise ValueError("a stop string cannot be empty (it would end every answer before it starts)")
    return value


TopP = Annotated[
    float,
    Field(
        gt=0,
        le=1,
        description="nucleus sampling: the fewest likeliest tokens whose probability adds up to top_p "
        "(1 = off)",
    ),
]
MinP = Annotated[
    float,
    Field(ge=0, lt=1, description="drop tokens less likely than min_p x the likeliest one (0 = off)"),
]
RepetitionPenalty = Annotated[
    float,
    Field(
        gt=0,
        description="a token already in the prompt or answer has its logit divided by this when positive, "
        "multiplied when negative (CTRL's; 1 = off); applies to greedy evals too",
    ),
]
StopStrings = Annotated[
    list[str],
    AfterValidator(_stop_strings),
    Field(
        description="an answer ends where one of these first appears in its text, without it (and without "
        "its tokens); applies to greedy evals too"
    ),
]


def sampling_knobs(rollout: Any, greedy: bool = False) -> dict[str, Any]:
    """The knobs of `rollout` (a `RolloutConfig`) that are on, as `Engine.generate` keyword arguments;
    `greedy`: only those that change a greedy answer (the repetition penalty, the stop strings), so
    that evals answer with the policy's own behaviour (truncation never moves an argmax)."""
    on = {}
    for name, off in KNOBS_OFF.items():
        value = getattr(rollout, name)
        value = tuple(value) if isinstance(off, tuple) else value
        if value != off and not (greedy and name in ("top_p", "min_p")):
            on[name] = value
    return on


def check_engine_knobs(config: Any, where: str) -> None:
    """Each knob the recipe turns on (`[rl.rollout]` or a policy's `rollout`) is one the engine takes
    (its config's `sampling_knobs`, `hpref.rl.protocols.EngineConfig`); `config` is the `RLConfig`,
    its engine resolved."""
    takes = config.engine_config.sampling_knobs
    tables = [("rl.rollout", sampling_knobs(config.rollout))]
    tables += [
        (f"rl.policies.{p}.rollout", sampling_knobs(config.policy_rollout(p))) for p in config.policies
    ]
    for key, knobs in tables:
        for knob in knobs:
            if knob not in takes:
                raise RecipeError(
                    f"{where}: {key}.{knob}: the {config.engine.name!r} engine does not take {knob} (its "
                    f"config's sampling_knobs: {', '.join(sorted(takes)) or 'none'}); remove it, or use the "
                    "transformers or vllm engine"
                )
