"""Shared fixtures of the RL tests: a private tokenizer cache, offline transformers."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Tokenizers are trained into a session-private cache, never ~/.cache/hpref."""
    monkeypatch.setenv("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))


def start_ray() -> None:
    """Start the shared local Ray cluster in this process (`ray_cluster`'s), unless one is up."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="session")
def _ray_for_the_session():
    """Shuts down, at the end of the session, the local Ray cluster `ray_cluster` started."""
    yield
    ray = __import__("sys").modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_cluster(_ray_for_the_session):
    """One local Ray cluster (2 CPUs) for every test that runs actors in this process: starting one
    costs ~10 s here, once per module it cost a minute of the suite. `hpref rl` joins it (and leaves
    it running) as it joins any cluster already initialised in its process. A test that needs Ray
    down (one that checks what `hpref rl` starts and stops itself) asks for `without_ray`, which
    brings this one back afterwards."""
    start_ray()


@pytest.fixture
def without_ray():
    """No Ray cluster in this process during the test; the shared one (`ray_cluster`), if it was up,
    is started again after."""
    ray = pytest.importorskip("ray")
    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    yield
    if was_up:
        start_ray()
