"""How a policy learns from its rollouts: the `Algorithm`s (`grpo`: GRPO, RLOO, REINFORCE++ advantages
and the clipped surrogate; `online_dpo`), their numbers (`objectives`), the built-ins' registration
(`builtin`) and `registry.build_algorithm`, the one place an algorithm is built. May import
`placement`, `transport` and the shared modules below (`policy`, `protocols`, `logprobs`,
`rollout_types`, `staleness`); never a room above."""
