"""Reward functions the tests name as `rule` functions (`function = "tests.rl.labelled:..."`): a
verifiable reward that reads the prompt file's `reference` column, as the README shows it."""

from __future__ import annotations

import re


def matches_reference(prompt, answer, row):
    """1 when the last number in the answer equals the row's reference answer, else 0."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer)
    return float(bool(numbers) and float(numbers[-1]) == float(row["reference"]))


def mentions_reference(prompt, answer, row):
    """1 when the answer contains the row's reference word (case-insensitive), else 0."""
    return float(str(row["reference"]).lower() in answer.lower())


def length(prompt, answer):
    """The answer's length in characters (no row)."""
    return float(len(answer))


def too_many(prompt, answer, row, extra):
    """Takes four arguments: not a rule function."""
    return 0.0
