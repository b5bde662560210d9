"""Tiny exports made as users make them (a trainer checkpoint consolidated by `hpref save`), and ONE
running `hpref serve` shared by the module that needs it: Ray Serve takes ~30 s to start on two
cores. The server is the real console script in its own process, with its own local Ray cluster,
so this process never initialises Ray and the tests after it see no cluster of ours."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.rl.tiny import TINY as TINY_LLAMA

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

#: a 1-block, 32-wide Llama: seconds to build, export and load (the rl tests' tiny shape)
TINY = {"name": "tiny-llama", **TINY_LLAMA, "head_dropout": 0.0}
TOKEN = "s3cret-token"
PROMPT = ("What is 12 + 30?",)


def make_export(base: Path, head: str) -> Path:
    """A run folder with a real checkpoint of a `head` model whose weights differ from their seeded
    init (a judge's classes, a reward model's scores and tie term all matter), exported by `hpref save`."""
    import torch

    from hpref.plugins import load_plugins
    from hpref.recipe import dump_toml, load_recipe
    from hpref.save import export
    from hpref.train.checkpoint import save_checkpoint

    run_dir = base / f"{head}-run"
    run_dir.mkdir(parents=True)
    recipe_path = run_dir / "recipe.toml"
    recipe_path.write_text(
        dump_toml(
            {
                "run": {"name": run_dir.name, "output_dir": str(base)},
                "model": {**TINY, "head": head},
                "formatter": {"name": "answers" if head == "reward" else "pab"},
                "train": {"max_length": 256, "micro_batch_tokens": 2048, "swap": "none"},
            }
        )
    )
    recipe = load_recipe(recipe_path)
    model = load_plugins().get("model", "tiny-llama").build(recipe.model.config, num_labels=3)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_checkpoint(run_dir, 3, model=model, optimizer=optimizer, train_state={"epoch": 0}, keep=1)
    return export.save_export(run_dir, base / f"{head}-export")


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """{"judge": folder, "reward": folder}."""
    pytest.importorskip("torch")
    mp = pytest.MonkeyPatch()
    mp.setenv("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))
    try:
        base = tmp_path_factory.mktemp("serve-exports")
        return {head: make_export(base, head) for head in ("judge", "reward")}
    finally:
        mp.undo()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(base: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HPREF_HOME=str(base / "hpref-home"),
        HPREF_CACHE=str(base / "hpref-cache"),
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]),
    )
    return env


class Server:
    """A running `hpref serve` process: its base URL, the token, the process."""

    def __init__(self, url: str, process: subprocess.Popen, log: Path) -> None:
        self.url = url
        self.process = process
        self.log = log
        self.headers = {"Authorization": f"Bearer {TOKEN}"}

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"hpref serve exited ({self.process.returncode}):\n{self.log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"hpref serve not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM, as a service manager stops it (the command shuts Serve and its Ray down), then
        the whole process group if anything is left."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


@contextlib.contextmanager
def serving(export: Path, base: Path, *options: str):
    """`hpref serve EXPORT --token-file F OPTIONS` on a free loopback port, ready; stopped after.
    `base/token` holds the token (`TOKEN`). Shared with tests/rl/test_default_paths.py, whose
    `hpref rl` run takes its `remote` reward from such a server."""
    pytest.importorskip("ray.serve")
    pytest.importorskip("httpx")
    token_file = base / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    log = base / "serve.log"
    command = [sys.executable, "-m", "hpref", "serve", str(export), "--port", str(port)]
    command += ["--token-file", str(token_file), *options]
    with open(log, "w") as out:
        # a session of its own: stop() can end whatever Ray left behind with one killpg
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=server_env(base), start_new_session=True
        )
    running = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        running.wait_ready(timeout=180)
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def server(exports, tmp_path_factory):
    """`hpref serve REWARD_EXPORT --replicas 2 --threads 1 --token-file F` on a free loopback port,
    with small bounds (batches of 8, so 16 requests held per replica, and 8 more waiting per
    replica) that a test can overload with a few hundred requests."""
    options = ["--replicas", "2", "--threads", "1"]
    options += ["--max-batch-size", "8", "--max-queued", "8", "--drain-timeout", "20"]
    with serving(exports["reward"], tmp_path_factory.mktemp("serve"), *options) as running:
        yield running
