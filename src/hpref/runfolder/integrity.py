"""Checksums of a checkpoint's files: written at save time, verified before a checkpoint is trusted.

Why: a flipped block or a copy cut short inside a DCP shard loads without complaint (the bytes are
raw tensor data) and training goes on with NaN weights. So every checkpoint folder carries
`checksums.json`, the size and SHA-256 of every other file in it, and every reader (resume, eval,
save, rl resume) calls `verify` first. Hashing is split across ranks when a process group exists,
so a large checkpoint costs each rank only its share.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from hpref.runfolder.files import write_json_atomic
from hpref.runfolder.layout import CHECKSUMS
from hpref.runfolder.safe_load import CheckpointError

MANIFEST = CHECKSUMS
_CHUNK = 1 << 20


def _digest(path: Path, *, sync: bool) -> dict[str, Any]:
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
        if sync:  # the bytes we vouch for are the bytes on disk
            os.fsync(fh.fileno())
    return {"size": size, "sha256": sha.hexdigest()}


def _files(folder: Path) -> list[str]:
    names = []
    for root, _dirs, files in os.walk(folder):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST:
                names.append(rel)
    return sorted(names)


def _share(names: list[str], rank: int, world: int) -> list[str]:
    return names[rank::world]


def _process_group() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(part: Any, world: int) -> list[Any]:
    if world == 1:
        return [part]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, part)
    return out


def write_manifest(folder: str | Path, *, collective: bool = False) -> dict[str, Any]:
    """Hash (and fsync) every file of `folder` and write `checksums.json` there. With
    `collective=True` every rank of the process group must call it: each hashes its share, rank 0
    writes the manifest."""
    folder = Path(folder)
    rank, world = _process_group() if collective else (0, 1)
    names = _files(folder)
    mine = {name: _digest(folder / name, sync=True) for name in _share(names, rank, world)}
    files: dict[str, Any] = {}
    for part in _gather(mine, world):
        files.update(part)
    manifest = {"algorithm": "sha256", "files": files}
    if rank == 0:
        write_json_atomic(folder / MANIFEST, manifest, indent=1, sort_keys=True)
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The folder's manifest, or None for a checkpoint written before hpref recorded checksums."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        ):
            raise ValueError("'files' is not a map of name -> {size, sha256}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: damaged checksum manifest ({type(exc).__name__}: {exc})") from None
    return manifest


def verify(folder: str | Path, *, collective: bool = False) -> list[str]:
    """Check every file against the folder's manifest; returns the problems (empty = verified).

    Sizes first (cheap, catches truncation), then hashes. A file the manifest does not name is a
    problem too (a shard slipped in). A folder without a manifest gives one problem, "no
    checksums", which callers may treat as a warning for checkpoints of older hpref versions.
    """
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except CheckpointError as exc:  # every rank reads the same file, so all return here together
        return [str(exc)]
    if manifest is None:
        return [f"{folder}: no {MANIFEST} (written before hpref recorded checksums); not verified"]
    expected: dict[str, Any] = manifest["files"]
    rank, world = _process_group() if collective else (0, 1)
    present = set(_files(folder))
    problems: list[str] = []
    if rank == 0:
        problems += [
            f"{folder / n}: missing (the checksum manifest names it)" for n in sorted(set(expected) - present)
        ]
        problems += [f"{folder / n}: not in the checksum manifest" for n in sorted(present - set(expected))]
    for name in _share(sorted(set(expected) & present), rank, world):
        want = expected[name]
        size = (folder / name).stat().st_size
        if size != want["size"]:
            problems.append(
                f"{folder / name}: {size} bytes, the checksum manifest says {want['size']} (truncated?)"
            )
        elif _digest(folder / name, sync=False)["sha256"] != want["sha256"]:
            problems.append(f"{folder / name}: SHA-256 does not match the checksum manifest (corrupt)")
    gathered: list[str] = []
    for part in _gather(problems, world):
        gathered += part
    return gathered


def is_unverified_only(problems: list[str]) -> bool:
    """True when the only problem is a missing manifest (an older checkpoint)."""
    return len(problems) == 1 and f"no {MANIFEST}" in problems[0]


def require_verified(folder: str | Path, *, collective: bool = False) -> None:
    """`verify`, raising a one-line `CheckpointError` on the first problem (a missing manifest is
    only logged: checkpoints written by older hpref versions have none)."""
    from loguru import logger

    problems = verify(folder, collective=collective)
    if is_unverified_only(problems):
        logger.warning(problems[0])
        return
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint does not verify: {problems[0]}{more}")
