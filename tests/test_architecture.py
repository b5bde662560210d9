"""The layering docs/architecture.md describes, checked: import-linter's layer contract (in
pyproject.toml), no import cycle between modules, and modules small enough to read."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "hpref"
#: the size past which a module is doing more than one thing (issue #14: "no module over ~500 lines")
MAX_MODULE_LINES = 520
#: the RL wing's tighter bounds (issue #48: "no module of hpref.rl above 450 lines and no function
#: above 80 lines in it"): rooms small enough that a newcomer reads one in a sitting, functions that
#: can be tested in parts
MAX_RL_MODULE_LINES = 450
MAX_RL_FUNCTION_LINES = 80


def test_import_linter_layer_contract_is_kept():
    """`lint-imports` passes: no module imports from a layer above its own, and every top-level
    module is placed in a layer. If this fails, its output names the import chain that climbs a
    layer (fix the import, or move the code to the layer that owns it) or the new module to place."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (the dev extra installs it)")
    done = subprocess.run(
        [lint, "--config", str(SRC.parents[1] / "pyproject.toml")],
        capture_output=True,
        text=True,
        cwd=SRC.parents[1],
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_no_import_cycle_between_modules():
    """No two modules of hpref import each other, directly or through others, counting imports
    inside functions. If this fails, the printed cycle is a pair of modules that each need the
    other: one of them holds code that belongs lower down."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the dev extra)")
    graph = grimp.build_graph("hpref")
    modules = sorted(graph.modules)
    edges = {
        m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in graph.modules)
        for m in modules
    }
    # packages import their children (`__init__` re-exports) and children their package's names:
    # that is one module seen twice, not a cycle between two
    edges = {
        m: [i for i in out if not (i.startswith(m + ".") or m.startswith(i + "."))]
        for m, out in edges.items()
    }
    cycle = _find_cycle(edges)
    assert cycle is None, " -> ".join(cycle or [])


def test_no_module_is_too_long_to_read():
    """Every module under src/hpref stays under MAX_MODULE_LINES lines. If this fails, the named
    module has grown a second concern: split it where the concerns part."""
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long


def test_the_rl_wing_keeps_its_modules_and_functions_short():
    """Every module of hpref.rl stays within MAX_RL_MODULE_LINES and every function in it (methods
    and nested functions too, docstring included) within MAX_RL_FUNCTION_LINES. If this fails, the
    named module or function has grown a second concern: split it where the concerns part (the
    driver's `Driver` and run_rl's named steps are the pattern)."""
    import ast

    rl = SRC / "rl"
    long_modules, long_functions = {}, {}
    for path in sorted(rl.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(SRC))
        if (n := len(text.splitlines())) > MAX_RL_MODULE_LINES:
            long_modules[name] = n
        for node in ast.walk(ast.parse(text)):
            is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if is_function and (n := node.end_lineno - node.lineno + 1) > MAX_RL_FUNCTION_LINES:
                long_functions[f"{name}:{node.lineno} {node.name}"] = n
    assert not long_modules, long_modules
    assert not long_functions, long_functions


def _find_cycle(edges: dict[str, list[str]]) -> list[str] | None:
    """One cycle of the directed graph, as a closed path, or None (iterative DFS, three colours)."""
    colour = dict.fromkeys(edges, 0)  # 0 unseen, 1 on the current path, 2 done
    for root in edges:
        if colour[root]:
            continue
        path = [root]
        stack = [iter(edges[root])]
        colour[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = 2
                stack.pop()
            elif colour.get(nxt, 2) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif colour.get(nxt, 2) == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append(iter(edges[nxt]))
    return None
