"""The synthetic arena: a world model of battles whose true outcome probabilities are known.

A quality anchor no real data set gives (every battle carries the distribution its label was drawn
from), used by the `synthetic-arena` dataset (`hpref.arena.source`, the source adapter), by
`hpref rl` (prompts, the `rule` reward, evals) and by the tiny tokenizer (its corpus).

- `world`: task families, their vocabulary, `parse_task` / `is_correct`, prompts.
- `judge`: the latent utility of an answer, Davidson's outcome model, the ground-truth `judge`.
- `answers`: the eight simulated assistants and the battles they fight.
- `report`: the Bayes floor, the cheap baselines and the skill ceilings of a split.
- `source`: the `synthetic-arena` dataset component (a `BattleSource` over `generate_battles`).

Public helpers (stable; other parts of hpref build on them):
    generate_battles(n, seed, *, max_turns=3, labels="drawn", families=None) -> Iterator[Battle]
        battle i depends only on (seed, i): the first k battles do not change when n grows.
    generate_prompt(rng: random.Random, turns=None, families=None) -> tuple[str, ...]
    prompts(n, seed, *, max_turns=3) -> Iterator[tuple[str, ...]]     prompts for RL rollouts
    answer_utility(prompt, answer) -> float      the judge's latent utility of one answer; prompt and
                                                 answer are a string (one turn) or sequences of turns
    judge(prompt, answer_a, answer_b) -> (p_a, p_b, p_tie)    the ground-truth outcome distribution
    corpus_texts(n, seed) -> Iterator[str]       plain text of n battles (prompts and answers), for
                                                 training a tiny model's tokenizer
    arena_report(train, eval) -> SyntheticReport uniform, floor, entropy, baselines (see the class)
    skill_ceilings(eval) -> dict[str, float]   log loss of judges that know correctness only for
                                                 some task families: what each skill is worth
"""

from hpref.arena.answers import ASSISTANTS, GENERATOR_VERSION, corpus_texts, generate_battle, generate_battles
from hpref.arena.judge import TIE_NU, W_CORRECT, W_LENGTH, answer_utility, davidson, judge, turn_utility
from hpref.arena.world import (
    CAPITALS,
    CITIES,
    FAMILIES,
    REFUSALS,
    Task,
    generate_prompt,
    is_correct,
    parse_task,
    prompts,
)

__all__ = [
    "ASSISTANTS",
    "CAPITALS",
    "CITIES",
    "FAMILIES",
    "GENERATOR_VERSION",
    "REFUSALS",
    "TIE_NU",
    "W_CORRECT",
    "W_LENGTH",
    "SyntheticReport",
    "Task",
    "answer_utility",
    "arena_report",
    "corpus_texts",
    "davidson",
    "generate_battle",
    "generate_battles",
    "generate_prompt",
    "is_correct",
    "judge",
    "parse_task",
    "prompts",
    "skill_ceilings",
    "turn_utility",
]

_REPORT = ("SyntheticReport", "arena_report", "skill_ceilings")


def __getattr__(name: str):
    # The report fits the cheap baselines (hpref.prediction.baselines, which imports torch), so it is
    # imported on first use: the synthetic-arena dataset is loaded by `hpref --help`.
    if name in _REPORT:
        from hpref.arena import report

        return getattr(report, name)
    raise AttributeError(f"module 'hpref.arena' has no attribute {name!r}")
