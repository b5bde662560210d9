"""A save and its resume where policies play one episode together (#50 point 6), in process: the
rollout executor over two tiny transformers engines, no Ray, no trainer. A joint rollout is played
once for every seated policy, so a save must keep each policy's part of it, whichever policy's
prefetch started it: a part left out is played again after the resume, at the partners' newer
weights, and the resumed run is no longer the one never stopped."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

from hpref.recipe.rl import parse_rl_section  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402


def _config():
    return parse_rl_section(
        {
            "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 4, "max_buffered": 1},
            # b speaks, a listens: a's episodes hold b's message, so they depend on b's weights
            "environment": {"name": "signal", "roles": {"speaker": "b", "listener": "a"}},
            "defaults": {"model": TINY},
            "policies": {"a": {}, "b": {"model": {"seed": 1}}},
            # no weight push in this test: every buffered rollout stays fresh enough to be used
            "update_weights_interval": 100,
        },
        "r.toml",
    )


def test_a_save_keeps_every_seated_policys_part_of_a_joint_rollout(tmp_path):
    """b runs a rollout ahead of a (lockstep allows one): b's prefetch plays rollout 2's episodes
    for both. The save then holds a's part of rollout 2 beside b's, and after b's weights move (its
    push after rollout 1) a resumed executor gives a the very episodes of rollout 2 the run never
    stopped gave it. Wrong if a save kept only the parts some policy had asked for (a's part was
    then played again with b's newer weights: other messages, another rollout, another run)."""
    from hpref.rl.engines.transformers_engine import EngineActor
    from hpref.rl.rollout.executor import RolloutExecutor
    from tests.rl.local_actor import LocalActor

    config = _config()
    engines = {p: LocalActor(EngineActor(p, config.policies[p].model)) for p in "ab"}
    save = tmp_path / "save"

    async def scenario():
        executor = RolloutExecutor(config, ["a", "b"], engines)
        await executor.get(0, "a")
        await executor.get(0, "b")
        await executor.get(1, "b")  # b one ahead: its prefetch started rollout 2, for a as well
        await executor.save(str(save))
        unstopped = [await executor.get(r, "a") for r in (1, 2)]
        # b's push after its rollout 1: new weights, which a replayed rollout 2 would meet
        engine = engines["b"]
        state = {k: v + 0.5 * torch.randn_like(v) for k, v in engine._obj.model.state_dict().items()}
        await engine.begin_update.remote(1)
        await engine.load_weights.remote(state)
        await engine.commit_update.remote()
        resumed = RolloutExecutor(config, ["a", "b"], engines)
        await resumed.load(str(save))
        return unstopped, [await resumed.get(r, "a") for r in (1, 2)]

    unstopped, resumed = asyncio.run(scenario())
    buffered = json.loads((save / "executor.json").read_text())["buffered"]
    assert [r["rollout_id"] for r in buffered["b"]] == [2]
    assert [r["rollout_id"] for r in buffered["a"]] == [1, 2]  # its part of rollout 2 too
    for ours, theirs in zip(resumed, unstopped, strict=True):
        assert ours.prompt_ids == theirs.prompt_ids and ours.completions == theirs.completions
        assert ours.logprobs == theirs.logprobs and ours.rewards == theirs.rewards
