"""What a run reports: `metrics` (the metrics rows of a rollout, an eval and the run's summary) and
`leaderboard` (Bradley-Terry ratings over the policies' battles and the metric plots)."""
