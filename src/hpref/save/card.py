"""The sections every export's model card ends with (`README.md` in the folder): the run's eval
metrics and the resolved recipe it was trained with, for the preference-model export
(`save.export.model_card`) and the DPO policy's (`save.policy_export.policy_card`) alike."""

from __future__ import annotations

from typing import Any


def metrics_and_recipe(metrics: dict[str, Any], recipe_toml: str) -> list[str]:
    """The card's "Eval metrics" table (or a line saying there was none) and "Training recipe"."""
    lines = ["## Eval metrics", ""]
    if metrics:
        lines += ["| metric | value |", "|---|---|"]
        lines += [
            f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items()
        ]
    else:
        lines.append("No evaluation was recorded for this checkpoint.")
    lines += ["", "## Training recipe", "", "```toml", recipe_toml.rstrip(), "```", ""]
    return lines
