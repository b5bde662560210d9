"""Running `hpref rl` as a user does (its own process, its own local Ray cluster) and reading what
its console showed: the lines that are not hpref's are the noise issue #40 moved to the log files."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

HPREF = [sys.executable, "-m", "hpref"]
#: a console line of hpref's (`hpref.logs.CONSOLE_FORMAT`), an actor's with Ray's prefix
HPREF_LINE = re.compile(r"(\(\w+ pid=\d+(, ip=[\d.]+)?\) )?\d\d:\d\d:\d\d (INFO|SUCCESS|WARNING|ERROR) ")
#: the terminal colours Ray puts around an actor's prefix (also when the console is a file)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def cli_env(tmp_path: Path) -> dict[str, str]:
    """The test's environment without the session's Ray address (the command starts its own
    cluster) and with a private hpref home and cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HPREF_HOME=str(tmp_path / "home"), HPREF_CACHE=str(tmp_path / "cache"))
    return env


def foreign_lines(console: str) -> list[str]:
    """The console's lines that are not hpref's (time, level, message; an actor's with Ray's
    "(Name pid=N) " before it): a library's log line, a progress bar, Ray's start-up notes."""
    lines = [ANSI.sub("", line) for line in console.splitlines()]
    return [line for line in lines if line.strip() and not HPREF_LINE.match(line)]
