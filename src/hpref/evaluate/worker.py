"""One evaluation process: `python -m hpref.evaluate.worker --spec SPEC.json`.

`hpref eval --nproc-per-node N` (N > 1) writes its arguments to a JSON spec and starts N of these
through torchrun, exactly as `hpref train` starts training ranks. Every rank loads the model and
the battles, scores its share of the packed sequences (the eval planner gives each sequence to one
rank), and `predict` all_gathers the probabilities; rank 0 alone writes predictions and metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from hpref.errors import UserError


def launch_eval(spec: dict[str, Any], nproc: int, run_dir: Path) -> int:
    """Run `eval_command(**spec)` on `nproc` local processes through torchrun; the exit code."""
    import tempfile

    from hpref.train.launch import free_port, run_torchrun

    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=run_dir, delete=False) as f:
        json.dump(spec, f, default=str)
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


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from hpref.evaluate.cli import eval_command
    from hpref.logs import setup_logging
    from hpref.train.watchdog import die_with_parent, start_heartbeat
    from hpref.train.worker import init_distributed

    parser = argparse.ArgumentParser(prog="hpref.evaluate.worker")
    parser.add_argument("--spec", required=True, help="JSON file with eval_command's arguments")
    args = parser.parse_args(argv)
    # the same liveness as training workers: gone with the launcher, watched by its heartbeat check
    die_with_parent()
    start_heartbeat(int(os.environ.get("RANK", "0")))
    spec = json.loads(Path(args.spec).read_text())
    info = init_distributed("auto")
    setup_logging(None, rank=info.rank)
    spec["device"] = str(info.device)
    try:
        code = eval_command(**spec)
        # Rank 0 writes predictions and metrics after the gather; a rank that tore the gloo group
        # down under it first aborted the process at exit (seen in CI as SIGABRT on rank 1).
        dist.barrier()
        return code
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
