"""The launcher of a multi-process `hpref eval`, as `hpref.train.launch` is training's.

`hpref eval --nproc-per-node N` (N > 1) writes its `EvalRequest` to a JSON spec in the run
folder and starts N `hpref.evaluate.worker` processes through torchrun (the same `run_torchrun` that
starts training ranks: heartbeat watchdog, failing rank named); the spec is removed afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpref.evaluate.request import EvalRequest


def launch_eval(request: EvalRequest, nproc: int, run_dir: Path) -> int:
    """Run `run_eval(request)` on `nproc` local processes through torchrun; the exit code."""
    from hpref.runtime.torchrun import free_port, run_torchrun

    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=run_dir, delete=False) as f:
        json.dump(dataclasses.asdict(request), f, default=str)
        spec_path = f.name
    argv = [
        "--nproc-per-node", str(nproc), "--nnodes", "1", "--max-restarts", "0",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--module", "hpref.evaluate.worker", "--spec", spec_path,
    ]  # fmt: skip
    try:
        return run_torchrun(argv, run_dir)
    finally:
        Path(spec_path).unlink(missing_ok=True)
