"""`hpref rl --plan`: `table` (where every actor would go, the printed plan and its verdict) and
`memory` (each actor's memory estimate from the policy's config). Builds no model and starts no actor;
may import the rooms below it to read the same asks and prompts a run uses."""
