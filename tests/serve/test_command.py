"""`hpref serve`'s own refusals: everything a user can get wrong is one line and exit 2 before Ray
starts (so each takes a second, not the thirty Ray Serve needs to come up)."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import run_hpref


@pytest.fixture
def export_folder(tmp_path):
    """Enough of an export for the checks that come before loading it."""
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "hpref_model.json").write_text("{}")
    return folder


def refused(*args: str) -> str:
    done = run_hpref("serve", *args, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_user_errors_are_one_line_and_exit_2_before_ray_starts(export_folder, tmp_path):
    """Wrong if a folder that is no export, an unreadable or empty token file, a port already taken
    or more replica threads than this machine's cores got as far as starting Ray (a hang, or a
    traceback from inside a replica) instead of one line naming the option."""
    line = refused(str(tmp_path / "nope"))
    assert line.startswith(f"error: EXPORT: no exported preference model at {tmp_path / 'nope'}")
    line = refused(str(export_folder), "--token-file", str(tmp_path / "missing-token"))
    assert (
        line
        == f"error: --token-file {tmp_path / 'missing-token'}: cannot read it (No such file or directory)"
    )
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    assert refused(str(export_folder), "--token-file", str(empty)) == (
        f"error: --token-file {empty}: is empty; put the token clients will send in it"
    )
    line = refused(str(export_folder), "--replicas", "64", "--threads", "2")
    assert line.startswith("error: --replicas 64 x --threads 2 needs 128 CPUs; this machine has")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused(str(export_folder), "--port", str(port), "--threads", "1")
    assert line.startswith(f"error: --port {port}: cannot listen on 127.0.0.1:{port}")
