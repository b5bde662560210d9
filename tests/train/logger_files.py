"""Reading back what the metric loggers wrote (`hpref.builtin.loggers`): TensorBoard's event files
through its own `EventAccumulator`, and an offline W&B run's `.wandb` file, and the check that they
hold metrics.jsonl's numbers at metrics.jsonl's steps (shared by the train and rl logger tests)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

#: W&B's `.wandb` file is a LevelDB-style log ("W&B" header, 32 KiB blocks of CRC-framed chunks) of
#: `wandb_internal_pb2.Record` protobufs; wandb 0.2x no longer ships a Python reader for it
_HEADER, _BLOCK, _CHUNK = 7, 32768, 7
_FULL, _LAST = 1, 4


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, as TensorBoard shows them (a resumed run's purged steps hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), f"TensorBoard shows a step twice in {tag}: {steps}"
        out[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return out


def tensorboard_text(folder: Path, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return acc.Tensors(tag)[-1].tensor_proto.string_val[0].decode()


def wandb_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, chunk, records = _HEADER, b"", []
    while pos + _CHUNK <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk += data[pos + _CHUNK : pos + _CHUNK + length]
        pos += _CHUNK + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def _finished_records(path: Path, timeout_s: float = 30.0) -> list[Any]:
    """The run file's records once it holds W&B's `exit` record: `run.finish()` returns before
    wandb-core's writer has flushed the last of them (seen under load: a file with no history)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_run(
    run_dir: Path, *, killed_starts: bool = False
) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
    """Every offline W&B run folder of the hpref run (one per start, same id): each start's history
    rows in order, and the config. `killed_starts`: starts before the last may have been SIGKILLed
    (their files never get W&B's `exit` record): only the last start's file is waited on."""
    rid = (run_dir / "wandb_run_id.txt").read_text().strip()
    files = sorted(
        (run_dir / "wandb").glob(f"offline-run-*-{rid}*/run-{rid}.wandb"), key=lambda p: p.stat().st_mtime_ns
    )  # in the order of the starts (a second start in the same second is named `...-<id>-1`)
    assert files, f"no offline W&B run {rid} under {run_dir / 'wandb'}"
    history, config = [], {}
    for i, path in enumerate(files):
        history.append([])
        wait = 0.0 if killed_starts and i < len(files) - 1 else 30.0
        for record in _finished_records(path, wait):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history[-1].append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                )
            elif kind == "run":
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    return history, config


def wandb_curves(history: list[list[dict[str, Any]]], axis: str) -> dict[str, dict[int, float]]:
    """name -> step -> value of the names W&B plots against `axis` (`train/step`, `a/rollout`), from
    each start's history in turn. A resumed start's rows at or below the `_step` the starts before
    it reached are left out: W&B drops them when the resumed run is synced."""
    group = axis.rsplit("/", 1)[0] + "/"
    out: dict[str, dict[int, float]] = {}
    reached = -1
    rows = []
    for start in history:
        rows += [row for row in start if row["_step"] > reached]
        reached = max([reached, *(row["_step"] for row in start)])
    for row in rows:
        if axis not in row:
            continue
        for name, value in row.items():
            if name.startswith(group) and name != axis:
                steps = out.setdefault(name, {})
                assert row[axis] not in steps, f"W&B got {name} at {axis} {row[axis]} twice"
                steps[row[axis]] = value
    return out


def assert_curves_match(expected: dict[str, dict[int, float]], *shown: dict[str, dict[int, float]]) -> None:
    """Each logger shows exactly `expected`'s names, steps and values (TensorBoard: float32)."""
    for curves in shown:
        for name, points in expected.items():
            assert name in curves, f"{name} not logged; logged: {sorted(curves)[:20]}"
            assert sorted(curves[name]) == sorted(points), f"{name}: steps {sorted(curves[name])}"
            for step, value in points.items():
                assert curves[name][step] == pytest.approx(value, rel=1e-6, abs=1e-9), f"{name} step {step}"


def train_curves(run_dir: Path) -> dict[str, dict[int, float]]:
    """What the loggers must show for `hpref train`'s metrics.jsonl: `train/<key>`, `eval/<key>`."""
    from hpref.train.metrics import read_metrics

    out: dict[str, dict[int, float]] = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        kind = record["kind"]
        for key, value in record.items():
            if key not in ("kind", "step") and isinstance(value, int | float):
                out.setdefault(f"{kind}/{key.removeprefix(kind + '_')}", {})[record["step"]] = float(value)
    return out
