"""`hpref rl` and a Ray cluster it joins: `--ray-address` joins a real `ray start --head` (token
authentication on, as Ray sets up by default) on loopback, and a cluster that cannot be reached or
refuses the token is one line, exit 2. (That the local cluster `hpref rl` starts by itself listens
on loopback only is checked in test_stop_signals.py's Ctrl-C run, which starts one: a cluster
start here cost the suite ~15 s.)

The head is this module's own: its own temp dir, port and token, and it is stopped by killing the
processes that carry its temp dir. Never `ray stop`, which stops every Ray cluster on the machine,
including other test sessions'.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from tests.rl.tiny import write_rl_recipe  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc"),
]
RAY = str(Path(sys.executable).parent / "ray")
HPREF = [sys.executable, "-m", "hpref"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_with(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """`ray start --head` on loopback with token authentication, as README's commands (and two
    logical H100s); yields (address, token)."""
    temp = tempfile.mkdtemp(prefix="hr-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = _free_port()
    token = secrets.token_hex(16)
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    args = [RAY, "start", "--head", "--port", str(port), "--num-cpus", "2", "--include-dashboard=false"]
    # two logical GPUs of the type Ray gives an H100 node (its `accelerator_type:H100` resource), for
    # the plan's test; the runs here ask for none
    args += ["--num-gpus", "2", "--resources", json.dumps({"accelerator_type:H100": 1})]
    args += ["--node-ip-address", "127.0.0.1", "--temp-dir", temp, "--disable-usage-stats"]
    try:
        started = subprocess.run(args, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield f"127.0.0.1:{port}", token
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _pids_with(temp):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(2)
        shutil.rmtree(temp, ignore_errors=True)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HPREF_HOME=str(tmp_path / "home"), **extra)
    return env


def test_rl_joins_a_token_protected_head_on_loopback(head, tmp_path):
    """README's commands: `ray start --head ...`, then `hpref rl ... --ray-address 127.0.0.1:PORT`
    with the cluster's token available the way Ray stores it (here RAY_AUTH_TOKEN), RAY_AUTH_MODE
    not set. If this fails with InvalidAuthToken, hpref does not send the token (Ray only does for
    address 'auto'); with "Failed to connect ... <machine address>", the driver took the machine's
    address while the head is on loopback."""
    address, token = head
    recipe = write_rl_recipe(tmp_path, "joined")
    result = subprocess.run(
        [*HPREF, "rl", str(recipe), "--policies", "a,b", "--ray-address", address],
        env=_env(tmp_path, RAY_AUTH_TOKEN=token),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "joined" / "rl_summary.json").read_text())
    assert summary["positions"]["a"] == 2
    # hpref disconnects from a cluster it joined; it does not stop it
    assert _pids_with(f"127.0.0.1:{address.rpartition(':')[2]}"), "the head is gone after the run"


def test_plan_reads_the_joined_clusters_nodes_and_their_gpu_memory(head, tmp_path):
    """`hpref rl --plan --ray-address` against the head: its CPUs and two GPUs come from the
    cluster, a rank that asks a GPU gets GPU 0 of the joined node, each GPU's memory comes from the
    accelerator type Ray reports (H100: 80 GB as sold, 74.5 GiB), the plan fits, starts nothing and
    leaves the head up. Wrong if the plan described this machine instead (no GPU here: the rank
    would be nowhere) or said "fits" without a GPU memory to check it against."""
    address, token = head
    recipe = write_rl_recipe(tmp_path, "planned")
    result = subprocess.run(
        [*HPREF, "rl", str(recipe), "--policies", "a,b", "--plan", "--ray-address", address]
        + ["--set", "rl.policies.a.gpus_per_rank=1"],
        env=_env(tmp_path, RAY_AUTH_TOKEN=token),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert f"on the Ray cluster at {address} (1 node, 2 CPUs, 2 GPUs)" in out, out
    assert re.search(r"^a trainer 0 +\S+ +0\.25 +0 +[0-9.]+ +[0-9.]+ ", out, re.MULTILINE), out
    assert re.search(r"^b trainer 0 +\S+ +0\.25 +- ", out, re.MULTILINE), out
    # Ray's CPUs: the two trainers' (the CPU engines and their executor are the driver's own)
    assert "0.5 of 2 CPUs, 1 of 2 GPUs (74.5 GiB each, H100: 80 GB as sold)" in out, out
    assert out.rstrip().splitlines()[-1] == "fits", out
    assert not (tmp_path / "runs").exists()  # nothing was started, no run folder
    assert _pids_with(f"127.0.0.1:{address.rpartition(':')[2]}"), "the head is gone after the plan"


def test_a_wrong_token_is_one_line_and_exit_2(head, tmp_path):
    """A head that refuses the token: exit 2 and one `error:` line that names the address and says
    what to do. If this fails, the user gets Ray's retry spam and `internal error: ConnectionError`
    (exit 1)."""
    address, _token = head
    recipe = write_rl_recipe(tmp_path, "refused")
    # Ray's driver tries the head NUM_REDIS_GET_RETRIES times a second apart before it gives up:
    # 20 s by default, spent idle here; two tries are enough to see the refusal and what follows
    env = _env(tmp_path, RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_NUM_REDIS_GET_RETRIES="2")
    result = subprocess.run(
        [*HPREF, "rl", str(recipe), "--policies", "a,b", "--ray-address", address],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"--ray-address {address}: could not join" in errors[0], result.stderr
    assert "token" in errors[0]
    assert "internal error" not in result.stderr
    # nothing else: no retry warnings from Ray's client ahead of the line
    others = [line for line in result.stderr.splitlines() if line not in errors and "run folder" not in line]
    assert not others, "\n".join(others[:5])


def test_an_address_nobody_answers_is_one_line_and_exit_2(tmp_path):
    """Nothing listens on the port: exit 2 within seconds, one line."""
    recipe = write_rl_recipe(tmp_path, "nobody")
    address = f"127.0.0.1:{_free_port()}"
    start = time.monotonic()
    result = subprocess.run(
        [*HPREF, "rl", str(recipe), "--policies", "a,b", "--ray-address", address],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: --ray-address {address}: no Ray cluster answers there")
    ), result.stderr
    assert time.monotonic() - start < 120
