"""Where a rollout's episodes happen (`[rl.environment]`, the `environment` component kind): the
built-ins `single-turn` (a prompt and one answer, every run's default) and `tool` (the policy calls
tools written in its answer, over several turns), and the registry that builds whichever a recipe
names (`registry.build_environment`)."""
