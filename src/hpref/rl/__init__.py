"""Multi-policy RL (`hpref rl`): several policies trained at once on shared rollouts.

- `command`: `hpref rl` and `hpref rl-warmup` from the command line (checks, then the run).
- `driver`: one asyncio task per policy; `run_rl` is the entry point of a run.
- `checks`: what `hpref rl` refuses in a recipe beyond its types (adapters, megatron, reward exports).
- `policy`: a policy's causal LM and tokenizer, its prompts, the padding maths of a step.
- `engines`: generation (the built-in `transformers` engine, registered through `register_engines`,
  and `EngineHost`, the Ray actor around any registered engine).
- `rollouts`: the prompt stream, the staleness policy and the rollout executor (buffers, rewards).
- `trainer`: the GRPO trainer of one policy (its step, weights for the engine, save and load).
- `evaluation`: win rates against the start and the battles of the Bradley-Terry leaderboard.
- `algorithms`: GRPO advantages, the clipped policy loss, k3 KL (pure torch functions).
- `parking`: the leader's rendezvous with its followers for consistent saves and evals.
- `record`: the resume checks against the checkpoint record (`hpref.runfolder.record`).
- `stop`: SIGTERM and Ctrl-C: a save at the leader's next rollout, or a stop at once.
- `protocols`: the `Reward` and `Engine` seams, as `typing.Protocol`s.
- `warmup`: the cached supervised warm-up that makes the policies' starting checkpoint: tiny ones
  on the synthetic arena's answers, or every one on the user's (`warmup_data`: `[rl.warmup] path`).
- `leaderboard`: Bradley-Terry ratings and the metric plots.

The Ray cluster the actors run on is `hpref.runtime.ray_cluster`'s. The `[rl]` recipe section is
typed with the rest of the recipe (`hpref.recipe.rl`). Importing this package imports nothing heavy;
`run_rl` loads torch and Ray when called.
"""

from __future__ import annotations

from typing import Any


def run_rl(
    recipe: Any,
    policies: list[str],
    ray_address: str | None = None,
    resume: str | None = None,
    prompts: Any = None,
    signals: Any = None,
) -> int:
    """Run `hpref rl` (see `hpref.rl.launch.run_rl`)."""
    from hpref.rl.launch import run_rl as _run_rl

    return _run_rl(recipe, policies, ray_address, resume, prompts=prompts, signals=signals)


__all__ = ["run_rl"]
