"""Shared fixtures: run the real `hpref` console script, and keep tests off the user's caches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Logs (HPREF_HOME) and token/tokenizer caches (HPREF_CACHE) of tests go to the session's temporary
    folder, never to ~/.cache. Sub-folder conftests may point HPREF_CACHE elsewhere; theirs wins."""
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("HPREF_HOME", str(base / "hpref-home"))
    monkeypatch.setenv("HPREF_CACHE", str(base / "hpref-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run_hpref(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120):
    """Run `python -m hpref ARGS` in a fresh process: real exit codes, real stdout/stderr."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "hpref", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd or REPO,
        timeout=timeout,
    )
