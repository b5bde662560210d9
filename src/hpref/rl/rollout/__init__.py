"""From prompts to a typed `Rollout`: the `executor` (the prompt stream, buffers, rewards, staleness,
opponents), `rewards` (the run's weighted reward set), `pairing` (answers paired and judged for an
algorithm that asks for preferences) and `evaluation` (win rates against the start, battles). It
knows algorithms only through `algorithms.registry` and the `Algorithm` protocol (an import-linter
contract) and never imports engine or trainer code."""
