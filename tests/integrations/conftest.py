"""Tiny exports for the TRL and verl adapters (the serve tests' `make_export`: a judge and a reward
model of the rl tests' 1-block Llama, through `hpref save`) and the tiny policy TRL trains."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.serve.conftest import make_export

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_exports(tmp_path_factory):
    """{"judge": folder, "reward": folder}, built once per session."""
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("integration-exports")
    return {head: make_export(base, head) for head in ("judge", "reward")}


def tiny_policy(seed: int = 0):
    """(causal LM, tokenizer): the rl tests' tiny random-init Llama and hpref's cached tiny BPE."""
    from hpref.models.causal_lm import build_policy_model
    from hpref.recipe.rl_policy import PolicyModelConfig
    from tests.rl.tiny import TINY

    return build_policy_model(PolicyModelConfig(**TINY, seed=seed))


#: the docs page whose snippets the suite runs
PAGE = Path(__file__).resolve().parents[2] / "docs" / "trl-verl.md"


def snippets(tag: str) -> list[str]:
    """The code blocks docs/trl-verl.md marks `<!-- test: TAG -->`."""
    found = re.findall(rf"<!-- test: {tag} -->\n```\w+\n(.*?)```", PAGE.read_text(), re.S)
    assert found, f"no '{tag}' snippet in {PAGE}"
    return found
