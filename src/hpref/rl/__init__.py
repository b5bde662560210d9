"""Multi-policy RL (`hpref rl`): several policies trained at once on shared rollouts.

The rooms, top to bottom (an import-linter contract in pyproject.toml keeps the order: a room imports
only from rooms below it; `|` rooms never import each other):

- `command`: `hpref rl` and `hpref rl-warmup` from the command line (checks, then the run);
  `launch`: `run_rl`, the run's entry: build, preflight, start actors, drive, finish.
- `plan/` | `control/`: `hpref rl --plan` (placement and memory estimate) | the driver, the leader's
  parking of its followers, the resume record, SIGTERM/Ctrl-C, the preflight checks.
- `warmup/` | `rollout/` | `trainer/` | `engines/` | `report/`: the supervised warm-up | the rollout
  executor, its episodes, rewards, pairing, evaluation | a policy's trainer actor, its group, FSDP2 sharding,
  backends, saves | the transformers and vLLM engines and their Ray host | metrics and the leaderboard.
- `algorithms/` | `environments/`: GRPO (with RLOO, REINFORCE++), online DPO, their numbers, the
  registry | where episodes happen (`single-turn`, `tool` and its calculator, `signal`,
  `debate`, `propose-solve`), the registry.
- `placement/`: Ray resources and the shared-base decision.
- `transport/`: the rendezvous and the trainer -> engine weight channel.
- shared by every room: `policy` (a policy's causal LM, tokenizer, prompts, padding maths),
  `protocols` (the `Reward`, `Engine`, `Algorithm`, `Environment`, `TrainerBackend` seams), `logprobs` (token
  log-probs and entropy), `rollout_types` (the typed rollout) and `staleness` (how far behind its
  trainer a rollout's weights may be).

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
