"""Multi-policy RL (`hpref rl`): several policies trained at once on shared rollouts.

- `algorithms`: GRPO advantages, the clipped policy loss, k3 KL (pure torch functions).
- `parking`: the leader's rendezvous with its followers for consistent saves and evals.
- `record`: the checkpoint record written after a global save, and the resume checks.
- `config`: the `[rl]` recipe section.
- `actors`: engine, rollout executor and trainer (plain classes, made Ray actors by the driver).
- `engines`: the built-in `transformers` engine, registered through the `register_engines` hook.
- `warmup`: the cached supervised warm-up that makes tiny policies' starting checkpoint.
- `driver`: one asyncio task per policy; `run_rl` is the entry point of `hpref rl`.

Importing this package imports nothing heavy; `run_rl` loads torch and Ray when called.
"""

from __future__ import annotations

from typing import Any


def run_rl(
    recipe: Any, policies: list[str], ray_address: str | None = None, resume: str | None = None
) -> int:
    """Run `hpref rl` (see `hpref.rl.driver.run_rl`)."""
    from hpref.rl.driver import run_rl as _run_rl

    return _run_rl(recipe, policies, ray_address, resume)


__all__ = ["run_rl"]
