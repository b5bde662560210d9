"""GRPO really optimises: the real actors (in-process) learn a reward a random policy scores badly on.

The reward is minus the answer's length, so the best policy ends every answer at once (eos first).
A random-init tiny model writes ~12 characters; within 40 rollouts the answers must be near empty.
If the sign of the advantage, the masking of the eos token, or the weight push to the engine were
wrong, the reward would stay flat (or get worse).
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from hpref.recipe.rl import parse_rl_section  # noqa: E402
from hpref.rl.control.driver import Handles, drive  # noqa: E402
from hpref.rl.engines.transformers_engine import EngineActor  # noqa: E402
from hpref.rl.report.metrics import MetricsWriter  # noqa: E402
from hpref.rl.rollout.executor import RolloutExecutor  # noqa: E402
from hpref.rl.trainer.actor import TrainerActor  # noqa: E402
from tests.rl.local_actor import LocalActor  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402


def test_grpo_learns_to_answer_briefly(tmp_path, monkeypatch):
    (tmp_path / "brevity_reward.py").write_text(
        "def score(prompt, answer):\n    return -float(len(answer))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = parse_rl_section(
        {
            "num_rollouts": 40,
            "rollout": {"group_size": 4, "prompts_per_rollout": 4, "max_new_tokens": 12},
            "reward": {"name": "rule", "function": "brevity_reward:score"},
            "defaults": {"model": TINY, "lr": 3e-2},
            "policies": {"a": {}},
        },
        "test",
    )
    engines = {"a": LocalActor(EngineActor("a", cfg.policies["a"].model))}
    handles = Handles(
        LocalActor(RolloutExecutor(cfg, ["a"], engines)),
        engines,
        {"a": LocalActor(TrainerActor("a", cfg.policies["a"], cfg.update_weights_interval))},
    )
    metrics = MetricsWriter(None)
    asyncio.run(drive(cfg, ["a"], handles, tmp_path / "run", {"a": 0}, metrics))
    rewards = [row["reward_mean"] for row in metrics.rows["a"]]
    assert len(rewards) == 40
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < -8.0, rewards  # a random policy rambles ...
    assert last > -1.0, rewards  # ... and GRPO teaches it to stop
    versions = [row["weight_version"] for row in metrics.rows["a"]]
    assert versions == list(range(1, 41))  # the engine got every update
