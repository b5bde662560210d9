"""The documentation: the site builds strictly (no broken link), its references come from the code,
and the README stays a front door whose links lead somewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("mkdocs")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    # wrong if a page links to a page or anchor-less file that does not exist, a nav entry points
    # nowhere, or a hook failed: `--strict` turns each warning into a failed build
    assert built.returncode == 0, built.stderr[-3000:]
    return out


def test_the_command_reference_is_the_cli_itself(site):
    # Wrong if a command or an option of `hpref` were missing from the site (a hand-written page
    # drifting from the CLI), or the generator stopped reading options.
    import typer.main

    from hpref.cli import app

    index = (site / "commands" / "index.html").read_text()
    root = typer.main.get_command(app)
    for name, command in root.commands.items():
        if not (command.callback is None or command.callback.__module__.startswith("hpref.")):
            continue  # a plugin's command (`register_commands`), added to the app in this process only
        assert f"hpref {name}" in index, name
        page = (site / "commands" / name / "index.html").read_text()  # one page per command
        for sub in [command, *getattr(command, "commands", {}).values()]:
            for param in sub.params:
                for opt in getattr(param, "opts", []):
                    if opt.startswith("--"):
                        assert opt in page, (name, opt)


def test_the_hook_reference_has_every_hookspec_and_its_contract(site):
    # Wrong if a hook a plugin can implement were missing from the plugins page, or its docstring
    # (the contract) were not there.
    from hpref import hookspecs

    page = (site / "plugins" / "index.html").read_text()
    hooks = [n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), "hpref_spec")]
    assert len(hooks) >= 10
    for name in hooks:
        assert name in page, name
    assert "wants_rows" in page  # a sentence of register_rewards' docstring


def test_the_readme_is_a_front_door_whose_links_resolve(site):
    # Wrong if the README grew back into the manual (the front door is ~250 lines at most),
    # dropped the test command CI runs, or linked a page that does not exist; the site's home page is
    # the README itself.
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "make test" in text
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if not re.match(r"^[a-z]+:", target):
            assert (REPO / target).exists(), target
    assert "A 30-second tour" in (site / "index.html").read_text()
