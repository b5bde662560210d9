"""The synthetic arena's report: the Bayes floor of a split, the cheap baselines, skill ceilings.

Because every battle carries the distribution its label was drawn from, the Bayes-optimal log loss
("floor") of a split is computable, and a model can be judged by how much of the gap between the
uniform predictor (ln 3) and that floor it closes. Correctness dominates the utility and is
invisible to surface features, so cheap baselines (a length-only and a bag-of-words logistic model
on A−B and |A−B| features) close well under half of the gap; the label prior alone (the tie share
is about 20%, not 33%) closes about 15% of it, so read the baselines against the prior.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from hpref.arena.answers import ASSISTANTS
from hpref.arena.judge import W_CORRECT, davidson, is_refusal, turn_utility
from hpref.arena.world import FAMILIES, is_correct, parse_task
from hpref.data.records import Battle
from hpref.prediction.baselines import cheap_baselines, labels_of
from hpref.prediction.metrics import log_loss


@dataclass
class SyntheticReport:
    """Log losses (nats per battle) on the eval split. `closed(x)` is the share of the gap between
    uniform and the floor that a predictor with log loss x closes (1 = Bayes-optimal)."""

    n_train: int
    n_eval: int
    uniform: float
    bayes_floor: float
    expected_entropy: float
    prior_baseline: float  # the train split's label shares for every battle (what any intercept learns)
    length_baseline: float
    bow_baseline: float
    label_shares: tuple[float, float, float]

    def closed(self, log_loss: float) -> float:
        return (self.uniform - log_loss) / (self.uniform - self.bayes_floor)

    def as_dict(self) -> dict[str, float | int | tuple[float, float, float]]:
        out = asdict(self)
        out["prior_closed"] = self.closed(self.prior_baseline)
        out["length_closed"] = self.closed(self.length_baseline)
        out["bow_closed"] = self.closed(self.bow_baseline)
        return out

    def __str__(self) -> str:
        return (
            f"eval {self.n_eval} battles (train {self.n_train}): uniform {self.uniform:.4f}, "
            f"Bayes floor {self.bayes_floor:.4f} (expected entropy {self.expected_entropy:.4f}), "
            f"label prior {self.prior_baseline:.4f} ({self.closed(self.prior_baseline):.0%} of the gap), "
            f"length-only {self.length_baseline:.4f} ({self.closed(self.length_baseline):.0%} of the gap), "
            f"bag-of-words {self.bow_baseline:.4f} ({self.closed(self.bow_baseline):.0%} of the gap)"
        )


_Turn = tuple[float, bool, str | None]  # (utility without the correctness term, correct, family)


def _decompose(battle: Battle) -> tuple[list[_Turn], list[_Turn]]:
    """Each side's turns split into the utility the judge gives regardless of correctness, whether
    the answer is correct, and the task family (None when correctness cannot matter: no task, or a
    refusal)."""
    sides = []
    for answers in (battle.response_a, battle.response_b):
        padded = tuple(answers) + ("",) * (len(battle.prompt) - len(answers))
        turns: list[_Turn] = []
        for prompt_turn, answer in zip(battle.prompt, padded, strict=False):
            task = parse_task(prompt_turn)
            refusal = is_refusal(answer)
            correct = task is not None and not refusal and is_correct(task, answer)
            rest = turn_utility(prompt_turn, answer) - (W_CORRECT if correct else 0.0)
            turns.append((rest, correct, task.family if task is not None and not refusal else None))
        sides.append(turns)
    return sides[0], sides[1]


def _partial_oracle(sides: tuple[list[_Turn], list[_Turn]], known: frozenset[str], skill: dict[str, float]):
    """(p_a, p_b, p_tie) of a judge that sees everything the true judge sees except whether answers
    to tasks outside `known` families are correct: those bits are marginalised over the cast's mean
    skill for the family (exactly, by enumerating them; a battle has at most 6)."""
    hidden = [(s, t) for s in range(2) for t, (_, _, fam) in enumerate(sides[s]) if fam and fam not in known]
    out = np.zeros(3)
    for bits in range(2 ** len(hidden)):
        weight, chosen = 1.0, {}
        for j, (s, t) in enumerate(hidden):
            bit = bool(bits >> j & 1)
            p = skill[sides[s][t][2]]  # type: ignore[index]
            weight *= p if bit else 1.0 - p
            chosen[(s, t)] = bit
        utilities = [
            sum(rest + W_CORRECT * chosen.get((s, t), correct) for t, (rest, correct, _) in enumerate(turns))
            / len(turns)
            for s, turns in enumerate(sides)
        ]
        out += weight * np.array(davidson(*utilities))
    return out


def skill_ceilings(evaluation: Sequence[Battle]) -> dict[str, float]:
    """What each task family's correctness is worth: log losses on `evaluation` of judges that know
    correctness for no family ("style only": refusals, politeness, markdown, length), for each family
    alone, and for a growing set (most valuable family first, ending at all families = the Bayes
    floor for hard labels). A model's log loss read against these says which skills it has learned;
    the style-only judge is roughly what a model that relates no answer to its prompt can reach."""
    if not evaluation:
        raise ValueError("skill_ceilings needs battles")
    labels = labels_of(evaluation)
    decomposed = [_decompose(b) for b in evaluation]
    skill = {f: sum(a.skill[f] for a in ASSISTANTS) / len(ASSISTANTS) for f in FAMILIES}

    def score(known: Iterable[str]) -> float:
        frozen = frozenset(known)
        return log_loss(np.array([_partial_oracle(d, frozen, skill) for d in decomposed]), labels)

    out = {"style only": score(())}
    alone = {f: score((f,)) for f in FAMILIES}
    out.update({f"{f} alone": v for f, v in alone.items()})
    known: list[str] = []
    for family in sorted(FAMILIES, key=alone.__getitem__):
        known.append(family)
        out["+".join(known)] = alone[family] if len(known) == 1 else score(known)
    return out


def arena_report(
    train: Sequence[Battle], evaluation: Sequence[Battle], max_vocab: int = 1500
) -> SyntheticReport:
    """Uniform, Bayes floor, expected entropy and the two cheap baselines (fitted on `train`) on
    `evaluation`. Every battle needs `truth`; labels may be hard or soft."""
    if not train or not evaluation:
        raise ValueError("the report needs battles in both the train and the eval split")
    y_eval = labels_of(evaluation)
    truth = np.array([b.truth for b in evaluation], dtype=np.float64)
    floor = log_loss(truth, y_eval)
    entropy = log_loss(truth, truth)
    cheap = cheap_baselines(train, evaluation, max_vocab=max_vocab)
    shares = tuple(float(s) for s in y_eval.mean(axis=0))
    return SyntheticReport(
        n_train=len(train),
        n_eval=len(evaluation),
        uniform=math.log(3),
        bayes_floor=floor,
        expected_entropy=entropy,
        prior_baseline=cheap.prior,
        length_baseline=cheap.length,
        bow_baseline=cheap.bow,
        label_shares=shares,  # type: ignore[arg-type]
    )
