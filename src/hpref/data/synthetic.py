"""The synthetic arena: battles whose true outcome probabilities are known.

A quality anchor no real data set gives: because every battle carries the distribution its label was
drawn from, the Bayes-optimal log loss ("floor") of a split is computable, and a model can be judged
by how much of the gap between the uniform predictor (ln 3) and that floor it closes.

How a battle is made
  prompt   1-3 user turns, each a task from a family whose correct answer is decidable from the text
           alone: add, compare (larger/smaller), reverse a word, count a letter, capital of a country,
           repeat a phrase.
  answers  two of eight simulated assistants answer every turn. Each has a skill per family (the
           chance of a correct answer), a verbosity (filler sentences), a style mix (terse, sentence,
           friendly, markdown) and a refusal rate. Wrong answers look exactly like right ones (a near
           miss of the same form), so only relating the answer to the prompt tells them apart.
  judge    a latent utility per answer, computed from the text alone by `answer_utility`: mean over
           turns of 4 x correct - 1.4 x refusal + small bonuses for politeness, markdown and length
           (saturating, and falling for rambling answers). The outcome follows Davidson's
           Bradley-Terry model with ties: P(A) ∝ e^uA, P(B) ∝ e^uB, P(tie) ∝ nu·e^((uA+uB)/2).

Because correctness dominates the utility and is invisible to surface features, cheap baselines (a
length-only and a bag-of-words logistic model on A−B and |A−B| features) close well under half of
the gap between ln 3 and the floor; `arena_report` measures exactly that. The label prior alone (the
tie share is about 20%, not 33%) closes about 15% of it, so read the baselines against the prior.

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

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from hpref.data.base import BattleSource, DatasetConfig
from hpref.data.baselines import cheap_baselines, labels_of
from hpref.data.records import Battle, Probs
from hpref.prediction.metrics import log_loss

GENERATOR_VERSION = "1"  # bump when generated battles change, so token caches are not reused

# judge weights
W_CORRECT = 4.0
W_REFUSAL = 1.4
W_POLITE = 0.25
W_MARKDOWN = 0.1
W_LENGTH = 0.02  # per word up to LENGTH_CAP words
LENGTH_CAP = 20
RAMBLE_START = 45
W_RAMBLE = 0.03  # per word beyond RAMBLE_START
TIE_NU = 0.8

FAMILIES = ("add", "compare", "reverse", "count", "capital", "repeat")

WORDS = (
    "apple",
    "banana",
    "planet",
    "garden",
    "silver",
    "window",
    "pencil",
    "rocket",
    "forest",
    "candle",
    "bridge",
    "orange",
    "mirror",
    "basket",
    "dragon",
    "pepper",
    "castle",
    "jungle",
    "button",
    "letter",
    "summer",
    "winter",
    "spring",
    "autumn",
    "monkey",
    "turtle",
    "rabbit",
    "parrot",
    "tomato",
    "carrot",
    "island",
    "valley",
    "desert",
    "canyon",
    "harbor",
    "meadow",
    "violin",
    "guitar",
    "trumpet",
    "piano",
    "anchor",
    "marble",
    "velvet",
    "cotton",
    "copper",
    "nickel",
    "bottle",
    "saddle",
    "ladder",
    "hammer",
)
CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Austria": "Vienna",
    "Poland": "Warsaw",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Greece": "Athens",
    "Ireland": "Dublin",
    "Hungary": "Budapest",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "Delhi",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Cuba": "Havana",
    "Russia": "Moscow",
    "Turkey": "Ankara",
    "Iran": "Tehran",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Argentina": "Buenos Aires",
}
_CITIES = sorted(set(CAPITALS.values()), key=len, reverse=True)

FILLERS = (
    "Let me think about this.",
    "Here is what I found.",
    "I hope this helps!",
    "This is a common kind of question.",
    "Let me know if you need anything else.",
    "I checked this carefully.",
    "Good question.",
    "Thanks for asking.",
)
REFUSALS = (
    "I'm sorry, but I can't help with that.",
    "I cannot assist with this request.",
    "Sorry, I am not able to answer that.",
)
POLITE_MARKERS = ("Sure!", "Of course!", "Happy to help!")

# (template, family); {a}, {b}, {w}, {c}, {country}, {phrase} are filled in by the generator.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": ("What is {a} + {b}?", "Compute {a} plus {b}.", "Add {a} and {b}."),
    "compare": ("Which is larger: {a} or {b}?", "Which is smaller: {a} or {b}?"),
    "reverse": ("Reverse the word '{w}'.", "Write '{w}' backwards."),
    "count": ("How many times does the letter '{c}' appear in '{w}'?", "Count the letter '{c}' in '{w}'."),
    "capital": ("What is the capital of {country}?", "Name the capital city of {country}."),
    "repeat": ("Repeat after me: {phrase}", "Say exactly this: {phrase}"),
}

# --------------------------------------------------------------------------------------------------
# tasks: what the judge can decide from a prompt's text


@dataclass(frozen=True)
class Task:
    family: str
    answer: str  # the correct answer, as the generator writes it


_PATTERNS = (
    ("add", re.compile(r"^(?:What is (\d+) \+ (\d+)\?|Compute (\d+) plus (\d+)\.|Add (\d+) and (\d+)\.)$")),
    ("compare", re.compile(r"^Which is (larger|smaller): (\d+) or (\d+)\?$")),
    ("reverse", re.compile(r"^(?:Reverse the word '([a-z]+)'\.|Write '([a-z]+)' backwards\.)$")),
    (
        "count",
        re.compile(
            r"^(?:How many times does the letter '([a-z])' appear in '([a-z]+)'\?"
            r"|Count the letter '([a-z])' in '([a-z]+)'\.)$"
        ),
    ),
    ("capital", re.compile(r"^(?:What is the capital of|Name the capital city of) ([A-Za-z ]+?)[?.]$")),
    ("repeat", re.compile(r"^(?:Repeat after me|Say exactly this): ([a-z ]+)$")),
)


def parse_task(prompt_turn: str) -> Task | None:
    """The task a user turn asks for, or None when it is not one of the arena's families."""
    text = prompt_turn.strip()
    for family, pattern in _PATTERNS:
        m = pattern.match(text)
        if m is None:
            continue
        groups = [g for g in m.groups() if g is not None]
        if family == "add":
            return Task(family, str(int(groups[0]) + int(groups[1])))
        if family == "compare":
            a, b = int(groups[1]), int(groups[2])
            return Task(family, str(max(a, b) if groups[0] == "larger" else min(a, b)))
        if family == "reverse":
            return Task(family, groups[0][::-1])
        if family == "count":
            return Task(family, str(groups[1].count(groups[0])))
        if family == "capital":
            city = CAPITALS.get(groups[0])
            return None if city is None else Task(family, city)
        return Task(family, groups[0])
    return None


_INT = re.compile(r"-?\d+")


def is_correct(task: Task, answer: str) -> bool:
    """Whether an answer solves the task. Numeric tasks read the last integer in the answer; word
    tasks need the exact word; capital answers must name the right city and no other capital (so
    listing every capital does not count)."""
    if task.family in ("add", "compare", "count"):
        numbers = _INT.findall(answer)
        return bool(numbers) and numbers[-1] == task.answer
    if task.family == "reverse":
        return task.answer in re.findall(r"[a-z]+", answer.lower())
    if task.family == "capital":
        named = {c for c in _CITIES if re.search(rf"\b{re.escape(c)}\b", answer)}
        return named == {task.answer}
    if task.family == "repeat":
        return task.answer in " ".join(re.findall(r"[a-z]+", answer.lower()))
    return False


def _is_refusal(answer: str) -> bool:
    return any(r in answer for r in REFUSALS)


def turn_utility(prompt_turn: str, answer: str) -> float:
    """The judge's utility of one answer to one user turn (see the module docstring)."""
    task = parse_task(prompt_turn)
    refusal = _is_refusal(answer)
    u = 0.0
    if task is not None and not refusal and is_correct(task, answer):
        u += W_CORRECT
    if refusal:
        u -= W_REFUSAL
    if answer.lstrip().startswith(POLITE_MARKERS):
        u += W_POLITE
    if "**" in answer:
        u += W_MARKDOWN
    words = len(answer.split())
    u += W_LENGTH * min(words, LENGTH_CAP) - W_RAMBLE * max(0, words - RAMBLE_START)
    return u


def _as_turns(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def answer_utility(prompt: str | Sequence[str], answer: str | Sequence[str]) -> float:
    """Latent utility of one assistant's whole answer: the mean over turns of `turn_utility`.
    Missing answer turns count as empty answers."""
    turns = _as_turns(prompt)
    answers = _as_turns(answer)
    if not turns:
        return 0.0
    answers = answers + ("",) * (len(turns) - len(answers))
    return sum(turn_utility(p, a) for p, a in zip(turns, answers, strict=False)) / len(turns)


def davidson(u_a: float, u_b: float, nu: float = TIE_NU) -> Probs:
    """Davidson's Bradley-Terry model with ties: (P(A wins), P(B wins), P(tie))."""
    m = max(u_a, u_b)
    ea, eb = math.exp(u_a - m), math.exp(u_b - m)
    et = nu * math.exp((u_a + u_b) / 2 - m)
    z = ea + eb + et
    return (ea / z, eb / z, et / z)


def judge(prompt: str | Sequence[str], answer_a: str | Sequence[str], answer_b: str | Sequence[str]) -> Probs:
    """The synthetic arena's ground-truth judge: the true (p_a, p_b, p_tie) of a battle."""
    return davidson(answer_utility(prompt, answer_a), answer_utility(prompt, answer_b))


# --------------------------------------------------------------------------------------------------
# generation


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


def _task_prompt(rng: random.Random, family: str) -> tuple[str, str, str]:
    """(prompt text, correct answer, a plausible wrong answer of the same form)."""
    template = rng.choice(TEMPLATES[family])
    if family == "add":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        right = a + b
        wrong = right + rng.choice((-10, -2, -1, 1, 2, 10))
        return template.format(a=a, b=b), str(right), str(wrong)
    if family == "compare":
        a, b = rng.sample(range(10, 100), 2)
        right = max(a, b) if "larger" in template else min(a, b)
        return template.format(a=a, b=b), str(right), str(a + b - right)
    if family == "reverse":
        w = rng.choice(WORDS)
        right = w[::-1]
        i = rng.randrange(len(w) - 1)
        wrong = right[:i] + right[i + 1] + right[i] + right[i + 2 :]
        if wrong == right:
            wrong = w
        return template.format(w=w), right, wrong
    if family == "count":
        w = rng.choice(WORDS)
        c = rng.choice(w) if rng.random() < 0.8 else rng.choice("aeioulnrst")
        right = w.count(c)
        wrong = right + 1 if right == 0 or rng.random() < 0.5 else right - 1
        return template.format(c=c, w=w), str(right), str(wrong)
    if family == "capital":
        country = rng.choice(sorted(CAPITALS))
        right = CAPITALS[country]
        wrong = rng.choice([c for c in CAPITALS.values() if c != right])
        return template.format(country=country), right, wrong
    words = rng.sample(WORDS, rng.randint(3, 5))
    right = " ".join(words)
    swapped = list(words)
    i = rng.randrange(len(words) - 1)
    swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
    if rng.random() < 0.5:
        swapped[rng.randrange(len(words))] = rng.choice([w for w in WORDS if w not in words])
    return template.format(phrase=right), right, " ".join(swapped)


def _turn_count(rng: random.Random, max_turns: int) -> int:
    weights = (0.6, 0.25, 0.15)[:max_turns]
    return rng.choices(range(1, max_turns + 1), weights=weights)[0]


def generate_prompt(
    rng: random.Random, turns: int | None = None, families: Sequence[str] | None = None
) -> tuple[str, ...]:
    """One conversation's user turns (1-3 turns unless `turns` is given)."""
    n = turns if turns is not None else _turn_count(rng, 3)
    return tuple(_task_prompt(rng, rng.choice(tuple(families or FAMILIES)))[0] for _ in range(n))


def _battle_rng(seed: int, index: int, salt: str = "battle") -> random.Random:
    digest = hashlib.blake2b(f"{salt}:{seed}:{index}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def prompts(n: int, seed: int, *, max_turns: int = 3) -> Iterator[tuple[str, ...]]:
    """`n` conversations' user turns for RL rollouts; prompt i depends only on (seed, i)."""
    for i in range(n):
        rng = _battle_rng(seed, i, "prompt")
        yield generate_prompt(rng, _turn_count(rng, max_turns))


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
    rng = _battle_rng(seed, index)
    a, b = rng.sample(ASSISTANTS, 2)
    prompt, answers_a, answers_b = [], [], []
    for _ in range(_turn_count(rng, max_turns)):
        family = rng.choice(tuple(families or FAMILIES))
        text, right, wrong = _task_prompt(rng, family)
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


# --------------------------------------------------------------------------------------------------
# the dataset component


class SyntheticArenaConfig(DatasetConfig):
    num_battles: int = Field(4000, ge=1, description="battles generated (before the fold split)")
    seed: int | None = Field(None, description="generator seed; default: the run seed")
    max_turns: int = Field(3, ge=1, le=3, description="most user turns per conversation")
    labels: Literal["drawn", "soft"] = Field(
        "drawn", description="drawn = one-hot outcome drawn from the truth; soft = the true probabilities"
    )
    families: list[str] | None = Field(
        None, description=f"task families (default all: {', '.join(FAMILIES)})"
    )

    @field_validator("families")
    @classmethod
    def _known_families(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            unknown = [f for f in value if f not in FAMILIES]
            if unknown or not value:
                raise ValueError(f"unknown task families {unknown}; known: {', '.join(FAMILIES)}")
        return value


class SyntheticArena(BattleSource):
    """The `synthetic-arena` component: generated battles, with `report()` for floor and baselines."""

    def __init__(self, config: SyntheticArenaConfig, seed: int) -> None:
        self.data_seed = config.seed if config.seed is not None else seed
        super().__init__(config, seed, f"synthetic-arena(seed={self.data_seed}, n={config.num_battles})")

    def _all(self) -> Iterator[Battle]:
        c = self.config
        return generate_battles(
            c.num_battles, self.data_seed, max_turns=c.max_turns, labels=c.labels, families=c.families
        )

    def _rows(self):
        return enumerate(self._all(), start=1)

    def _parse(self, row: Battle) -> Battle:
        return row

    def _data_identity(self) -> str:
        return f"synthetic-arena:v{GENERATOR_VERSION}:seed={self.data_seed}"

    def report(self, folds: int | None = None, fold: int | None = None) -> SyntheticReport:
        """Floor and baselines: baselines fitted on the train folds, everything scored on the eval
        fold (the configured `folds`/`fold`, or 5 folds / fold 0 when the config does not split)."""
        return arena_report(*self._report_split(folds, fold))

    def skill_ceilings(self, folds: int | None = None, fold: int | None = None) -> dict[str, float]:
        """`skill_ceilings` on the eval fold `report` scores."""
        return skill_ceilings(self._report_split(folds, fold)[1])

    def _report_split(self, folds: int | None, fold: int | None) -> tuple[list[Battle], list[Battle]]:
        """(train, eval) battles of the fold `report` and `skill_ceilings` score on."""
        from hpref.data.splits import FoldAssigner

        c = self.config
        k = folds or (c.folds if c.folds > 1 else 5)
        held_out = fold if fold is not None else (c.fold if c.folds > 1 else 0)
        assigner = FoldAssigner(k, c.split_seed)
        train, evaluation = [], []
        for battle in self._all():
            (evaluation if assigner.fold_of(battle) == held_out else train).append(battle)
        return train, evaluation


# --------------------------------------------------------------------------------------------------
# the report: floor and cheap baselines


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
            refusal = _is_refusal(answer)
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
