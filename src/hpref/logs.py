"""Logging set-up (loguru): a console sink on rank 0 only, and a full log file.

The CLI's own log lives at `$HPREF_HOME/logs/hpref.log` (default `~/.cache/hpref`); a run also
logs to `<run_dir>/logs/rank<N>.log`. Internal errors write their traceback to the log file only, so
the console stays one line long.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from loguru import logger

CONSOLE_FORMAT = "<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}"
FILE_FORMAT = "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | rank {extra[rank]} | {name}:{line} | {message}"


def hpref_home() -> Path:
    return Path(os.environ.get("HPREF_HOME", Path.home() / ".cache" / "hpref"))


def cli_log_file() -> Path:
    return hpref_home() / "logs" / "hpref.log"


def setup_logging(
    log_file: Path | None = None, *, rank: int = 0, console: bool | None = None, level: str = "INFO"
):
    """Route loguru to the console (rank 0 by default) and to `log_file` (every rank, DEBUG)."""
    logger.remove()
    logger.configure(extra={"rank": rank})
    if console is None:
        console = rank == 0
    if console:
        # A function sink looks sys.stderr up at each write, so rich's progress bar (which swaps
        # stderr while it draws) is not cut by log lines.
        logger.add(
            lambda message: sys.stderr.write(message),
            level=level,
            format=CONSOLE_FORMAT,
            filter=lambda record: not record["extra"].get("file_only"),
            backtrace=False,
            diagnose=False,
        )
    if log_file is not None:
        add_log_file(log_file)
    return logger


def add_log_file(log_file: Path, level: str = "DEBUG") -> int:
    """A full log file sink; returns its handler id.

    `errors="backslashreplace"`: a message can carry text that is not valid Unicode (a lone
    surrogate from an undecodable byte of a user's file, in an exception's message or traceback).
    With loguru's default strict UTF-8 the file sink raised on every such record and loguru printed
    ~50 lines of "--- Logging error in Loguru Handler ---" to the console before hpref's own
    one-line error; escaped, the record is written and nothing spills."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    return logger.add(
        log_file,
        level=level,
        format=FILE_FORMAT,
        backtrace=True,
        diagnose=False,
        enqueue=False,
        encoding="utf-8",
        errors="backslashreplace",
    )


def file_only():
    """A logger whose records go to the log file but never to the console (tracebacks)."""
    return logger.bind(file_only=True)


class _LoguruHandler(logging.Handler):
    """A stdlib logging handler that hands records to loguru at DEBUG: they land in hpref's log
    files (DEBUG) and never on the console (INFO)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a library's malformed format args must not break a run
            message = str(record.msg)
        logger.opt(depth=1).debug(f"[{record.name}] {message}")


_ROUTED = False


def route_stdlib_logs(name: str) -> None:
    """Send a library's stdlib logger `name` (and its children) to hpref's log files at DEBUG
    instead of Python's last-resort stderr handler; idempotent. For bitsandbytes, whose CPU backend
    warns on import about an optional kernel package an hpref user has no use for."""
    library = logging.getLogger(name)
    if not any(isinstance(h, _LoguruHandler) for h in library.handlers):
        library.addHandler(_LoguruHandler())
    library.propagate = False


def route_transformers_logs() -> None:
    """Send transformers' own output (the per-model weight LOAD REPORT tables, warnings, the
    "Loading weights" progress bar) to hpref's log files instead of the user's console.

    Call it after transformers is imported (hpref imports it lazily, where a model or tokenizer is
    built); idempotent. transformers installs its own stderr handler on import, so it is removed
    here rather than configured before the import."""
    global _ROUTED
    if _ROUTED:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.disable_progress_bar()
    hf_logging.add_handler(_LoguruHandler())
    route_stdlib_logs("bitsandbytes")  # transformers and peft import it when it is installed
    _ROUTED = True
