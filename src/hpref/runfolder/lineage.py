"""Which saves of a run folder are its current timeline: each save names the save it continued from.

A run's pointer to its newest save (`checkpoints/latest` of a training run, `record.json` of an
`hpref rl` run) is written after the save's files are complete. A write of that pointer that fails
(a full disk) leaves it naming the save before, and a resume that trusts it goes back one save. The
newest folder is not the answer either: after `hpref train --resume .../step-N` from an older save,
the saves past N belong to a timeline the user abandoned, and the pointer is what says so.

So every save records its lineage (`Lineage`: an id of its own, the name and id of the save it
continued from, and when it was written) and the pointer stays the anchor: the current timeline's
newest save is the pointer's target, or the newest save that descends from it (`head`). The parent
of a save is what the pointer named when it was written; a resume first points the pointer at the
save it resumed from, so a resumed timeline's saves descend from that save and an abandoned
timeline's do not, whatever their step. The ids matter because a name is reused: the same step
saved again after a resume from before it replaces that folder, and the abandoned saves that named
the old folder as their parent must not count as its children. One window is left: between a
resume from an older save and its first save, the abandoned saves still descend from the pointer's
target, so `--resume auto` after a crash in that window continues the run's newest save, as before
the resume.

Saves of older hpref versions carry no lineage: a pointer to one of them is followed as it is, and
the saves before it count as its ancestors (the order of their names), as they did.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the key under which a save's JSON (`train_state.json`, an rl save's record) holds its lineage
LINEAGE_KEY = "lineage"


@dataclass(frozen=True)
class Lineage:
    id: str
    parent: str | None = None  # the folder name of the save this one continued from
    parent_id: str | None = None
    saved_ns: int = 0  # `time.time_ns()` when written: the newer of two children of one save wins

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "parent": self.parent, "parent_id": self.parent_id, "saved_ns": self.saved_ns}

    @classmethod
    def from_json(cls, data: Any) -> Lineage | None:
        """The lineage of a save's JSON (its `LINEAGE_KEY` item), None when it has none or a broken one
        (a save of an older hpref version, or damaged: checksums refuse the latter before a load)."""
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            return None
        parent, parent_id, saved = data.get("parent"), data.get("parent_id"), data.get("saved_ns", 0)
        if not all(isinstance(v, str | None) for v in (parent, parent_id)) or not isinstance(saved, int):
            return None
        return cls(data["id"], parent, parent_id, saved)


Reader = Callable[[Path], "Lineage | None"]


def child_of(name: str, parent: Path | None, read: Reader) -> Lineage:
    """The lineage of a new save called `name`, continuing from `parent` (what the pointer names;
    None for a run's first save). The same step saved twice replaces its folder: the new save takes
    the old one's parent, never itself."""
    if parent is not None and parent.name == name:
        own = read(parent)
        if own is None:
            return Lineage(uuid.uuid4().hex, None, None, time.time_ns())
        return Lineage(uuid.uuid4().hex, own.parent, own.parent_id, time.time_ns())
    if parent is None:
        return Lineage(uuid.uuid4().hex, None, None, time.time_ns())
    above = read(parent)
    return Lineage(uuid.uuid4().hex, parent.name, above.id if above else None, time.time_ns())


def _is_child(child: Lineage | None, parent: Path, parent_lineage: Lineage | None) -> bool:
    if child is None or child.parent != parent.name:
        return False
    return child.parent_id == (parent_lineage.id if parent_lineage else None)


def head(start: Path, saves: Sequence[Path], read: Reader) -> Path:
    """The newest save of `start`'s timeline: `start`, or the save that continues it (the newest
    written, where two do), followed as far as it goes."""
    lineages = {save: read(save) for save in saves}
    current, seen = start, {start}
    while True:
        above = lineages.get(current) or read(current)
        children = [s for s in saves if s not in seen and _is_child(lineages[s], current, above)]
        if not children:
            return current
        current = max(children, key=lambda s: lineages[s].saved_ns)  # type: ignore[union-attr]
        seen.add(current)


def ancestors(newest: Path, saves: Sequence[Path], read: Reader) -> list[Path]:
    """`newest` and the saves it descends from, newest first, as far as they are kept (`saves`:
    oldest first). A save without lineage (an older hpref's) is followed by every save before it."""
    by_name = {save.name: save for save in saves}
    chain, current = [newest], newest
    while True:
        own = read(current)
        if own is None:
            older = list(saves[: saves.index(current)]) if current in saves else []
            return chain + older[::-1]
        parent = by_name.get(own.parent) if own.parent else None
        if parent is None or parent in chain:
            return chain
        above = read(parent)
        if (above.id if above else None) != own.parent_id:
            return chain  # the parent's folder was replaced by a later save of the same step
        chain.append(parent)
        current = parent
