"""The suite's own scheduling (`tests/conftest.py`): `make test` hands the longest modules out first."""

from __future__ import annotations

from tests.conftest import LONGEST_MODULES_FIRST, REPO


def test_every_module_named_longest_first_exists_once():
    # Wrong if a renamed or deleted module stays in the list: it would silently lose its place at the
    # head of the queue and the suite's wall time would grow with nobody told why.
    assert len(set(LONGEST_MODULES_FIRST)) == len(LONGEST_MODULES_FIRST)
    missing = [m for m in LONGEST_MODULES_FIRST if not (REPO / m).is_file()]
    assert missing == []


def test_the_longest_modules_are_collected_first(request):
    # Wrong if the collection hook did not run: under `--dist loadfile --no-loadscope-reorder` the
    # order collected is the order the two workers are handed modules.
    collected = [item.nodeid.split("::")[0] for item in request.session.items]
    named = [m for m in LONGEST_MODULES_FIRST if m in collected]
    first = list(dict.fromkeys(collected))[: len(named)]
    assert first == named
