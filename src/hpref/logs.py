"""Logging set-up (loguru): a console sink on rank 0 only, and a full log file.

The CLI's own log lives at `$HPREF_HOME/logs/hpref.log` (default `~/.cache/hpref`); a run also
logs to `<run_dir>/logs/rank<N>.log`. Internal errors write their traceback to the log file only, so
the console stays one line long.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

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


def add_log_file(log_file: Path, level: str = "DEBUG", *, delay: bool = False) -> int:
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
        delay=delay,  # True: no file until the first record (an actor with nothing to say)
    )


def file_only():
    """A logger whose records go to the log file but never to the console (tracebacks)."""
    return logger.bind(file_only=True)


class _LoguruHandler(logging.Handler):
    """A stdlib logging handler (loguru's documented InterceptHandler) that hands a library's
    records to loguru at their own level, bound `file_only`: they land in hpref's log files, with
    the logger's name, and never on the console, which keeps hpref's own lines."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a library's malformed format args must not break a run
            message = str(record.msg)
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:  # a library's own level name (vLLM, Ray define none today)
            level = record.levelno
        # the library's own frame, not logging's, names the record's module and line in the file
        frame, depth = logging.currentframe(), 0
        while frame is not None and (depth == 0 or frame.f_code.co_filename == logging.__file__):
            frame, depth = frame.f_back, depth + 1
        file_only().opt(depth=depth, exception=record.exc_info).log(level, f"[{record.name}] {message}")


#: libraries that give their stdlib logger a console handler of their own when imported (Ray, vLLM,
#: torch's `torch._logging`) or print through Python's last-resort handler; transformers has its
#: own switch (`route_transformers_logs`)
LIBRARY_LOGGERS = (
    "ray",
    "vllm",
    "torch",
    "bitsandbytes",
    "triton",
    "peft",
    "accelerate",
    "urllib3",
    "filelock",
)

_ROUTED = False


def route_stdlib_logs(name: str) -> None:
    """Send a library's stdlib logger `name` (and its children) to hpref's log files instead of the
    console; idempotent. Call it after the library is imported: its console handlers (any that is
    not a file's) are removed, as a library adds them on import. For bitsandbytes, whose CPU backend
    warns on import about an optional kernel package an hpref user has no use for; Ray's "Started a
    local Ray instance" and token notes; vLLM's per-weight dtype notes."""
    library = logging.getLogger(name)
    for handler in list(library.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            library.removeHandler(handler)
    if not any(isinstance(h, _LoguruHandler) for h in library.handlers):
        library.addHandler(_LoguruHandler())
    library.propagate = False


def route_library_logs() -> None:
    """Every third-party record to the log file, none to the console; idempotent. The root logger
    gets the handler (a library that logs without a handler of its own reaches it), `warnings.warn`
    from libraries becomes a `py.warnings` record there, and the libraries already imported that
    print on their own are routed (`route_stdlib_logs`; where hpref imports one later, it calls this
    again). hpref's own warnings a user can act on are loguru lines, so they stay."""
    root = logging.getLogger()
    if not any(isinstance(h, _LoguruHandler) for h in root.handlers):
        root.addHandler(_LoguruHandler())
    logging.captureWarnings(True)
    for name in LIBRARY_LOGGERS:
        if name in sys.modules:
            route_stdlib_logs(name)
    if "transformers" in sys.modules:
        route_transformers_logs()


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


#: the run's log folder, set by `hpref rl` for its Ray actors (`quiet_actor_logs`)
ACTOR_LOG_DIR_ENV = "HPREF_ACTOR_LOG_DIR"
_ACTOR_QUIET = False


def quiet_actor_logs() -> None:
    """In a Ray actor's process (a no-op anywhere else): hpref's own lines stay on its stderr, which
    Ray forwards to the driver's console, and the libraries' records (vLLM, transformers, torch)
    go to `<run>/logs/actor-<pid>.log` beside hpref's DEBUG lines (`ACTOR_LOG_DIR_ENV`; without it,
    nowhere). Idempotent."""
    global _ACTOR_QUIET
    if _ACTOR_QUIET or "ray" not in sys.modules:
        return
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return  # the driver, or a test that builds an engine in-process: its handlers stay
    logger.remove()  # loguru's default stderr sink would print file-only records too
    logger.configure(extra={"rank": 0})
    logger.add(  # the driver's console format and level: Ray prefixes the actor's name and pid
        _to_console,
        level="INFO",
        format=CONSOLE_FORMAT,
        colorize=False,
        filter=lambda record: not record["extra"].get("file_only"),
    )
    log = _actor_log()
    if log is not None:
        add_log_file(log, delay=True)
    route_library_logs()
    _ACTOR_QUIET = True


def _actor_log() -> Path | None:
    folder = os.environ.get(ACTOR_LOG_DIR_ENV)
    return Path(folder) / f"actor-{os.getpid()}.log" if folder else None


#: where hpref's console lines go once `divert_output` moved file descriptors 1 and 2: the stream
#: Ray forwards to the driver's console (None: sys.stderr)
_FORWARDED: TextIO | None = None


def _to_console(message: str) -> None:
    """An actor's console sink (`quiet_actor_logs`): what Ray forwards to the driver's console."""
    (_FORWARDED or sys.stderr).write(message)


def divert_output() -> bool:
    """In a Ray actor of `hpref rl` (`quiet_actor_logs` ran) that has a run log folder
    (`ACTOR_LOG_DIR_ENV`; else a no-op, False): file descriptors 1 and 2 write into the actor's log
    file for the rest of the process's life, and hpref's own console lines to the former fd 2,
    which Ray forwards.

    For the vLLM engine's actor, whose libraries write to the process's stdout and stderr from
    places no logging setting reaches: C++ (torch's TORCH_WARN), vLLM's worker processes (they
    inherit both), a handler vLLM installs while it starts. Ray forwards what an actor writes there
    to the driver's console, where a run's first minutes printed 37 such lines (issue #47)."""
    global _FORWARDED
    log = _actor_log()
    if log is None or not _ACTOR_QUIET or _FORWARDED is not None:
        return _FORWARDED is not None
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    forwarded = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    _FORWARDED = forwarded
    return True


@contextmanager
def stderr_to_log(what: str) -> Iterator[None]:
    """File descriptor 2 into the log file (DEBUG) for the block: for C++ code that writes to the
    process's stderr itself, out of reach of Python logging (Ray's client retries, torch's TORCH_WARN
    under vLLM's CPU engine start-up). Python's own stderr in the block is caught too."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace").strip()
            if text:
                logger.debug(f"{what} said:\n{text}")
