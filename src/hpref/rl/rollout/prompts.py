"""The prompt stream of `hpref rl`: the `[rl.prompts]` source built from its registered component,
and the prompts of a rollout. Every policy answers the same prompts at the same rollout id (prompt
i of the stream depends only on (seed, i)), each sampled with a seed of (policy, rollout), so a
resumed run draws what an uninterrupted one does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpref.data.prompts import Prompt, stream_rng
from hpref.recipe.rl import RLConfig, RolloutConfig

if TYPE_CHECKING:
    from hpref.rl.protocols import PromptSource


def build_prompt_source(config: RLConfig) -> Any:
    """The `[rl.prompts]` component (`hpref.rl.protocols.PromptSource`); reads its file now, so a bad
    file or one without usable prompts is a `UserError` before any actor starts."""
    from hpref.plugins import load_plugins
    from hpref.recipe.rl import resolve_prompts

    if config.prompts_config is None:
        config.prompts_config = resolve_prompts(config.prompts)
    return load_plugins().get("prompts", config.prompts.name).build(config.prompts_config)


def rollout_prompts(source: PromptSource, rollout: RolloutConfig, rollout_id: int) -> list[Prompt]:
    """The prompts of rollout `rollout_id`: prompt i of the stream depends only on (seed, i), so every
    policy answers the same prompts at the same rollout id and a restored position replays nothing."""
    first = rollout_id * rollout.prompts_per_rollout
    return source.train_prompts(rollout.seed, first, rollout.prompts_per_rollout)


def sample_seed(seed: int, policy: str, rollout_id: int) -> int:
    """The sampling seed of one policy's rollout: regenerating it gives the same answers."""
    return stream_rng("sample", seed, policy, rollout_id).getrandbits(62)
