"""The synthetic arena's answer simulator: eight assistants, and the battles they fight.

Two of eight simulated assistants answer every turn. Each has a skill per family (the chance of a
correct answer), a verbosity (filler sentences), a style mix (terse, sentence, friendly, markdown)
and a refusal rate. Wrong answers look exactly like right ones (a near miss of the same form), so
only relating the answer to the prompt tells them apart. Battle i depends only on (seed, i)
(`generate_battles`), and carries the true outcome distribution its label was drawn from.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hpref.arena.judge import judge
from hpref.arena.world import FAMILIES, FILLERS, POLITE_MARKERS, REFUSALS, battle_rng, task_prompt, turn_count
from hpref.data.records import Battle

GENERATOR_VERSION = "1"  # bump when generated battles change, so token caches are not reused


@dataclass(frozen=True)
class Assistant:
    name: str
    skill: dict[str, float]  # P(correct) per family
    verbosity: float  # mean number of filler sentences
    styles: tuple[float, float, float, float]  # P(terse, sentence, friendly, markdown)
    refusal: float


def _assistants() -> tuple[Assistant, ...]:
    # A fixed cast (its own seed, not the data seed): "model_a = atlas" means the same skills in
    # every generated file. Skills vary by family so no assistant is simply "the good one".
    rng = random.Random(20240501)
    names = ("atlas", "borealis", "cirrus", "dynamo", "ember", "fjord", "granite", "halcyon")
    cast = []
    for i, name in enumerate(names):
        base = 0.35 + 0.5 * rng.random()
        skill = {f: min(0.95, max(0.1, base + rng.uniform(-0.25, 0.25))) for f in FAMILIES}
        weights = [rng.random() + 0.5 for _ in range(4)]
        total = sum(weights)
        cast.append(
            Assistant(
                name=f"{name}-{(i + 1) * 3}b",
                skill=skill,
                verbosity=rng.choice((0.3, 0.8, 1.5, 2.5)),
                styles=tuple(w / total for w in weights),  # type: ignore[arg-type]
                refusal=rng.choice((0.01, 0.03, 0.06)),
            )
        )
    return tuple(cast)


ASSISTANTS = _assistants()


def _render(rng: random.Random, assistant: Assistant, answer: str) -> str:
    if rng.random() < assistant.refusal:
        return rng.choice(REFUSALS)
    style = rng.choices(range(4), weights=assistant.styles)[0]
    if style == 0:
        core = answer
    elif style == 1:
        core = f"The answer is {answer}."
    elif style == 2:
        core = f"{rng.choice(POLITE_MARKERS)} The answer is {answer}."
    else:
        core = f"**Answer:** {answer}"
    n_fill = min(len(FILLERS), int(rng.expovariate(1.0 / assistant.verbosity))) if assistant.verbosity else 0
    fill = rng.sample(FILLERS, n_fill)
    before, after = fill[: n_fill // 2], fill[n_fill // 2 :]
    if style == 2:  # a polite opener stays first, or the judge would not see it as one
        return " ".join([core, *before, *after])
    return " ".join([*before, core, *after])


def generate_battle(
    seed: int, index: int, *, max_turns: int = 3, labels: str = "drawn", families: Sequence[str] | None = None
) -> Battle:
    """Battle `index` of the arena generated from `seed`."""
    rng = battle_rng(seed, index)
    a, b = rng.sample(ASSISTANTS, 2)
    prompt, answers_a, answers_b = [], [], []
    for _ in range(turn_count(rng, max_turns)):
        family = rng.choice(tuple(families or FAMILIES))
        text, right, wrong = task_prompt(rng, family)
        prompt.append(text)
        for assistant, out in ((a, answers_a), (b, answers_b)):
            answer = right if rng.random() < assistant.skill[family] else wrong
            out.append(_render(rng, assistant, answer))
    truth = judge(prompt, answers_a, answers_b)
    if labels == "soft":
        label = truth
    else:
        k = rng.choices(range(3), weights=truth)[0]
        label = tuple(1.0 if i == k else 0.0 for i in range(3))
    return Battle(
        id=f"synth-{seed}-{index}",
        prompt=tuple(prompt),
        response_a=tuple(answers_a),
        response_b=tuple(answers_b),
        label=label,  # type: ignore[arg-type]
        model_a=a.name,
        model_b=b.name,
        truth=truth,
    )


def generate_battles(
    n: int, seed: int, *, max_turns: int = 3, labels: str = "drawn", families: Sequence[str] | None = None
) -> Iterator[Battle]:
    """`n` battles; battle i depends only on (seed, i)."""
    for i in range(n):
        yield generate_battle(seed, i, max_turns=max_turns, labels=labels, families=families)


def corpus_texts(n: int, seed: int) -> Iterator[str]:
    """Plain text of `n` generated battles — every user turn and every answer — for training a
    tokenizer that covers the arena's vocabulary (add the formatter's fixed text separately)."""
    for battle in generate_battles(n, seed):
        yield from battle.prompt
        yield from battle.response_a
        yield from battle.response_b
