"""Atomic, durable writes for every file hpref owns, and the one exception: appended logs.

Why: a crash (or a full disk, or `kill -9`) in the middle of `Path.write_text` leaves a truncated
file under the real name, and a `rename` that was never fsynced can be undone by a power cut. So a
file is written to a temporary name beside its target, flushed and fsynced, renamed over the target
(atomic on POSIX), and the folder entry itself is fsynced. A reader sees the old file or the new one,
never half of one.

Logs of one JSON line per step or rollout (`metrics.jsonl`, rl's `metrics/<policy>.jsonl`) are
appended instead (`append_json_line`): rewriting them whole every step would copy the run's history
each time. A crash can lose their last lines or cut the last one; `read_json_lines` drops a cut last
line, and a resume rewrites the log atomically up to the checkpoint it starts from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".part"


def fsync_dir(folder: str | Path) -> None:
    """Make a folder's entries (a rename, a new file) durable. A no-op where the platform cannot."""
    try:
        fd = os.open(str(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically and durably (see the module doc)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, data: Any, **dumps: Any) -> Path:
    return write_text_atomic(path, json.dumps(data, **dumps) + "\n")


def fsync_tree(folder: str | Path) -> None:
    """fsync every file under `folder` and every folder in it (the folder itself last), so that a
    pointer written after this names data that is on disk."""
    folder = Path(folder)
    for root, _dirs, names in os.walk(folder, topdown=False):
        for name in names:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def append_json_line(path: str | Path, record: Any, **dumps: Any) -> None:
    """Append one JSON object as a line of a log (see the module doc: not atomic, not fsynced)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, **dumps) + "\n")


def read_json_lines(path: str | Path) -> list[Any]:
    """The objects of an appended JSON-lines log. A last line without its newline that does not
    parse was cut by a crash mid-append and is dropped; any other bad line is an error."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.splitlines()
    records = []
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines) - 1 and not text.endswith("\n"):
                break
            raise
    return records
