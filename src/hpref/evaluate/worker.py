"""One evaluation process: `python -m hpref.evaluate.worker --spec SPEC.json`.

Started by `hpref.evaluate.launch` (N of them through torchrun), exactly as training ranks are.
Every rank loads the model and the battles and calls `hpref.evaluate.runner.run_eval`: the shared
`hpref.prediction.predict` scores this rank's share of the packed sequences (the eval planner gives
each sequence to one rank) and all_gathers the probabilities; rank 0 alone writes predictions and
metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hpref.errors import UserError


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from hpref.evaluate.request import EvalRequest
    from hpref.evaluate.runner import run_eval
    from hpref.logs import hpref_home, route_library_logs, setup_logging
    from hpref.runtime.distributed import init_distributed
    from hpref.runtime.watchdog import die_with_parent, start_heartbeat

    parser = argparse.ArgumentParser(prog="hpref.evaluate.worker")
    parser.add_argument("--spec", required=True, help="JSON file with the EvalRequest")
    args = parser.parse_args(argv)
    # the same liveness as training workers: gone with the launcher, watched by its heartbeat check
    die_with_parent()
    start_heartbeat(int(os.environ.get("RANK", "0")))
    spec = json.loads(Path(args.spec).read_text())
    info = init_distributed("auto")
    # hpref's lines on rank 0's console; every rank's DEBUG and the libraries' records (torch,
    # transformers) in $HPREF_HOME/logs/eval-rank<N>.log, beside the CLI's own log
    setup_logging(hpref_home() / "logs" / f"eval-rank{info.rank}.log", rank=info.rank)
    route_library_logs()
    try:
        code = run_eval(EvalRequest(**spec), device=str(info.device))
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
