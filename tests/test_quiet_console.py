"""The console keeps hpref's own lines; third-party libraries' logs and warnings go to the log file
(`hpref.logs.route_library_logs`, issue #40), and `hpref doctor` reports what the install can do."""

from __future__ import annotations

import json
import logging
import socket
import warnings

from tests.conftest import run_hpref_here


def test_library_records_go_to_the_log_file_not_the_console(tmp_path, capsys):
    """A transformers warning, a Ray-style library logger with its own stderr handler, and a
    library's `warnings.warn` all land in the log file at their level and none on the console,
    while hpref's own line stays on it. Wrong if any library line reaches the console (the noise
    this routing removes) or is lost from the log file (where a failed run is debugged)."""
    from loguru import logger

    from hpref.logs import _LoguruHandler, route_library_logs, setup_logging

    hf = logging.getLogger("transformers")
    hf_level = hf.level
    hf.setLevel(logging.WARNING)  # an engine test before this one may have left it at ERROR
    own = logging.getLogger("hpref_test_lib")
    own.addHandler(logging.StreamHandler())  # as Ray and vLLM add theirs on import
    log = tmp_path / "run.log"
    root = logging.getLogger()
    try:
        setup_logging(log, console=True)
        # an earlier test's routing in this process left logging's capture on while pytest put
        # warnings.showwarning back: off, so that route_library_logs turns it on afresh
        logging.captureWarnings(False)
        route_library_logs()
        from hpref.logs import route_stdlib_logs

        route_stdlib_logs("hpref_test_lib")
        hf.warning("transformers says hello")
        own.warning("library line with its own handler")
        logging.getLogger("some.unknown.lib").error("unknown library error")
        with warnings.catch_warnings():  # whatever filters earlier tests' imports left behind
            warnings.simplefilter("always")
            warnings.warn("a library's deprecation note", DeprecationWarning, stacklevel=1)
        logger.info("hpref's own line")
        console = capsys.readouterr().err
    finally:
        logger.remove()
        logging.captureWarnings(False)
        for handler in [h for h in root.handlers if isinstance(h, _LoguruHandler)]:
            root.removeHandler(handler)
        own.handlers.clear()
        hf.setLevel(hf_level)
    assert "hpref's own line" in console
    for noise in ("transformers says hello", "own handler", "unknown library error", "deprecation note"):
        assert noise not in console, console
    text = log.read_text()
    assert "WARNING | rank 0" in text and "[transformers] transformers says hello" in text
    assert "[hpref_test_lib] library line with its own handler" in text
    assert "ERROR   | rank 0" in text and "[some.unknown.lib] unknown library error" in text
    assert "[py.warnings]" in text and "deprecation note" in text
    assert "| logging:" not in text  # records name the library's module and line, not logging's


def test_doctor_reports_and_exits_0(tmp_path, monkeypatch):
    """`hpref doctor --json`: every section present, a Ray address that does not answer and a
    missing ../shared reported as such, and still exit 0. Wrong if the doctor judged (exit != 0),
    started or joined a cluster, or imported an extra to find its version."""
    import sys

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    heavy = {"vllm", "megatron", "flash_attn", "wandb", "tensorboard"} - set(sys.modules)
    result = run_hpref_here("doctor", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"system", "extras", "services"}
    assert report["system"]["hpref"] and report["system"]["torch"].endswith("build)")
    assert report["system"]["cuda devices"]  # a list of devices or "none"
    flash = report["extras"]["flash-attn"]
    assert flash == "not installed" or flash.startswith("flash"), flash
    assert report["services"]["ray"] == f"127.0.0.1:{port}: does not answer (Connection refused)"
    assert report["services"]["shared data"].startswith("not found")
    assert not heavy & set(sys.modules), heavy & set(sys.modules)

    from hpref.check.doctor import cpu_flags

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16 amx_tile\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512_bf16", "amx_tile"}


def test_stderr_to_log_moves_fd_2_writes_into_the_log_file(tmp_path, capfd):
    """What C++ writes to fd 2 itself (torch's TORCH_WARN under vLLM's CPU start-up, Ray's client
    retries) lands in the log file at DEBUG, not on the console, and fd 2 is the console again after
    the block. Wrong if the console shows the write, the log lost it, or stderr stayed redirected."""
    import os

    from loguru import logger

    from hpref.logs import setup_logging, stderr_to_log

    log = tmp_path / "run.log"
    try:
        setup_logging(log, console=False)
        with stderr_to_log("the engine"):
            os.write(2, b"[W utils.cpp:68] Warning: NUMA binding\n")
        os.write(2, b"after the block\n")
    finally:
        logger.remove()
    err = capfd.readouterr().err
    assert "NUMA binding" not in err and "after the block" in err
    assert (
        "DEBUG   | rank 0" in log.read_text()
        and "the engine said:\n[W utils.cpp:68] Warning: NUMA" in log.read_text()
    )


DIVERTED = """
import os, subprocess, sys
from loguru import logger
import hpref.logs as logs
logs._ACTOR_QUIET = True  # as quiet_actor_logs leaves a Ray actor: its console sink, no Ray here
logger.remove()
logger.add(logs._to_console, format=logs.CONSOLE_FORMAT, colorize=False)
assert logs.divert_output() and logs.divert_output()  # idempotent
os.write(1, b"C++ on stdout\\n")
os.write(2, b"[W cpu.cpp:1] TORCH_WARN on stderr\\n")
print("a library's print", flush=True)
subprocess.run([sys.executable, "-c", "print('a worker process it started')"], check=True)
logger.info("hpref's own line")
"""


def test_a_diverted_actor_keeps_only_hprefs_lines_on_its_console(tmp_path):
    """`divert_output`, as the vLLM engine's actor calls it: what C++ writes to fd 1 and 2, a
    library's print and a child process (vLLM's workers inherit both) land in the actor's log file,
    and only hpref's own line stays on the stream Ray forwards to the driver's console. Wrong if any
    of them reaches the console (issue #47's 37 forwarded vLLM lines) or is lost from the log."""
    import os
    import subprocess
    import sys

    from hpref.logs import ACTOR_LOG_DIR_ENV

    env = {**os.environ, ACTOR_LOG_DIR_ENV: str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", DIVERTED], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert [line.split(" ", 1)[1] for line in done.stderr.splitlines()] == ["INFO    hpref's own line"]
    (log,) = tmp_path.glob("actor-*.log")
    text = log.read_text()
    for line in ("C++ on stdout", "TORCH_WARN on stderr", "a library's print", "a worker process"):
        assert line in text, text
    assert "hpref's own line" not in text
