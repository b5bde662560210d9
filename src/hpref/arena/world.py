"""The synthetic arena's world: task families, their vocabulary, and the prompts built from them.

Every task's correct answer is decidable from the prompt's text alone (`parse_task`, `is_correct`):
add, compare (larger/smaller), reverse a word, count a letter, capital of a country, repeat a
phrase. A prompt is 1-3 user turns (`generate_prompt`); prompt i of a stream depends only on
(seed, i) (`prompts`, `battle_rng`).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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
CITIES = sorted(set(CAPITALS.values()), key=len, reverse=True)

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
        named = {c for c in CITIES if re.search(rf"\b{re.escape(c)}\b", answer)}
        return named == {task.answer}
    if task.family == "repeat":
        return task.answer in " ".join(re.findall(r"[a-z]+", answer.lower()))
    return False


# --------------------------------------------------------------------------------------------------
# prompts


def task_prompt(rng: random.Random, family: str) -> tuple[str, str, str]:
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


def turn_count(rng: random.Random, max_turns: int) -> int:
    weights = (0.6, 0.25, 0.15)[:max_turns]
    return rng.choices(range(1, max_turns + 1), weights=weights)[0]


def generate_prompt(
    rng: random.Random, turns: int | None = None, families: Sequence[str] | None = None
) -> tuple[str, ...]:
    """One conversation's user turns (1-3 turns unless `turns` is given)."""
    n = turns if turns is not None else turn_count(rng, 3)
    return tuple(task_prompt(rng, rng.choice(tuple(families or FAMILIES)))[0] for _ in range(n))


def battle_rng(seed: int, index: int, salt: str = "battle") -> random.Random:
    digest = hashlib.blake2b(f"{salt}:{seed}:{index}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def prompts(n: int, seed: int, *, max_turns: int = 3) -> Iterator[tuple[str, ...]]:
    """`n` conversations' user turns for RL rollouts; prompt i depends only on (seed, i)."""
    for i in range(n):
        rng = battle_rng(seed, i, "prompt")
        yield generate_prompt(rng, turn_count(rng, max_turns))
