"""The run's coordination: `driver` (one asyncio task per policy; the leader parks its followers for
consistent saves and evals, `parking`), `record` (the resume checks), `stop` (SIGTERM and Ctrl-C) and
`preflight` (what `hpref rl` refuses before anything starts). May import every room below it
(`warmup`, `rollout`, `trainer`, `engines`, `report` and lower); `plan` is its independent sibling."""
