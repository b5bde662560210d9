"""Where a rollout's episodes happen (`[rl.environment]`, the `environment` component kind): the
built-ins `single-turn` (a prompt and one answer, every run's default), `tool` (the policy calls tools
written in its answer, over several turns), and the environments several policies play together:
`signal` (the Lewis signalling game), `debate` (two answers, each revised after reading the other,
judged as a pair) and `propose-solve` (a problem proposed once, solved several times); and the
registry that builds whichever a recipe names (`registry.build_environment`)."""
