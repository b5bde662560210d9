"""The tiny-llama policy config every RL test builds (one block, 32 wide: seconds per test), and
the two-policy `hpref rl` recipe the end-to-end tests run."""

from __future__ import annotations

import textwrap
from pathlib import Path

TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
    "vocab_size": 300,
    "tokenizer_texts": 300,
}


def write_rl_recipe(
    folder: Path,
    name: str,
    *,
    num_rollouts: int = 2,
    save_interval: int = 1,
    time_limit_s: float | None = None,
) -> Path:
    """`folder/<name>.toml`: policies a and b (tiny, seeds 0 and 1), the rule reward, runs under
    `folder/runs`."""
    model = ", ".join(f"{k} = {v}" for k, v in TINY.items())
    limit = f"time_limit_s = {time_limit_s}\n" if time_limit_s is not None else ""
    path = folder / f"{name}.toml"
    path.write_text(
        textwrap.dedent(f"""
        [run]
        name = "{name}"
        output_dir = "{(folder / "runs").as_posix()}"

        [rl]
        num_rollouts = {num_rollouts}
        save_interval = {save_interval}
        eval_interval = 0
        """)
        + limit
        + textwrap.dedent(f"""
        [rl.rollout]
        group_size = 2
        prompts_per_rollout = 2
        max_new_tokens = 4

        [rl.reward]
        name = "rule"

        [rl.defaults]
        lr = 1e-3
        model = {{ {model} }}

        [rl.policies.a]

        [rl.policies.b]
        model = {{ seed = 1 }}
        """)
    )
    return path
