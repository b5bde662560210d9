"""Two `hpref train` launchers as two nodes on loopback: one run together, or one line when alone.

Each "node" is its own `python -m hpref train` process with `--nnodes 2 --node-rank R` and the same
`--rdzv-endpoint`, one rank per node, exactly what two machines under a scheduler would run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from hpref.runtime.torchrun import free_port
from tests.conftest import REPO
from tests.train.conftest import TOTAL_STEPS, train_losses, write_recipe

pytestmark = pytest.mark.slow


def start_node(recipe, rank: int, port: int, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "hpref", "train", str(recipe), "--nproc-per-node", "1", "--nnodes", "2"]
    argv += ["--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}", *extra]
    return subprocess.Popen(
        argv, cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(node: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = node.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        node.kill()
        node.communicate()
        pytest.fail(f"node still running after {timeout} s: a hang")
    return node.returncode, err


def test_two_nodes_train_one_run_together(tmp_path, two_rank_run):
    """Node 0 and node 1 (one rank each) form one 2-rank run in one run folder: the summary says 2
    ranks, there is one checkpoint with both ranks' shards, both ranks logged every step, and the
    losses are the one-node 2-rank run's. If this fails, the nodes trained separately (two world
    sizes of 1, two checkpoints fighting over one folder), node 1 wrote into the run folder that
    node 0 owns, or the static rendezvous put the ranks in another order (other data shards)."""
    recipe = write_recipe(tmp_path, "nodes")
    port = free_port()
    nodes = [start_node(recipe, rank, port, "--rdzv-timeout", "120") for rank in (0, 1)]
    results = [finish(node, timeout=300) for node in nodes]
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"node {rank} exited {code}: {err[-2000:]}"

    run_dir = tmp_path / "runs" / "nodes"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == TOTAL_STEPS
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert checkpoints == sorted(p.name for p in (two_rank_run / "checkpoints").glob("step-*"))
    last = run_dir / "checkpoints" / checkpoints[-1]
    assert sorted(p.name for p in last.glob("__*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert json.loads((last / "train_state.json").read_text())["world_size"] == 2
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"rank {rank}/2 on cpu" in log
        assert f"step {TOTAL_STEPS}/{TOTAL_STEPS} loss" in log, f"rank {rank} did not reach the last step"
    ours, reference = train_losses(run_dir), train_losses(two_rank_run)
    assert sorted(ours) == list(range(1, TOTAL_STEPS + 1))
    for step in ours:
        assert ours[step] == pytest.approx(reference[step], abs=1e-6), f"step {step}"


def test_a_node_whose_peer_never_arrives_times_out_in_one_line(tmp_path):
    """Node 0 started alone waits `--rdzv-timeout` seconds for node 1, then exits 1 with one error
    line naming the node, the endpoint, the timeout and the fix; node 1 started alone (no node 0 to
    reach) gives up the same way. If this fails, a missing node hangs a launcher for torchrun's 15
    minutes, or the user gets a torch traceback instead of what to check."""
    recipe = write_recipe(tmp_path, "alone")
    ports = free_port(), free_port()
    started = time.monotonic()
    nodes = [start_node(recipe, rank, ports[rank], "--rdzv-timeout", "2") for rank in (0, 1)]
    results = [finish(node, timeout=90) for node in nodes]
    assert time.monotonic() - started < 90

    for rank, (code, err) in enumerate(results):
        assert code == 1, f"node {rank} exited {code}: {err[-2000:]}"
        assert "Traceback" not in err
        errors = [line for line in err.splitlines() if " ERROR " in line]
        assert len(errors) == 1, err
        where = f"at 127.0.0.1:{ports[rank]} within 2 s"
        assert f"node {rank} of 2: no rendezvous with the other node(s) {where}" in errors[0]
        assert "--rdzv-timeout" in errors[0]
    # node 0 waited for a peer, so that is the whole of what it printed (node 1's torch store
    # client logs its own connection retries from C++ before giving up, which hpref cannot silence)
    node0 = [line for line in results[0][1].splitlines() if line.strip()]
    assert len(node0) == 2 and "launching: torchrun" in node0[0], node0
    assert not (tmp_path / "runs" / "alone" / "checkpoints").exists()
