"""The house's layering, read from the source: folders are the processes and the layers, an import
only points down, and no two modules import each other (directly or round a loop).

Every import counts, those under ``if TYPE_CHECKING:`` and inside functions too: a reader follows
them all the same.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "kvtransfer", "gateway", "worker", "prefill_svc", "decode_svc", "launcher", "pdctl",
            "benchmarks")

# What each top-level folder may import (besides itself): the floors of the house, bottom up.
MAY_IMPORT = {
    "common": set(),
    "kvtransfer": {"common"},
    "gateway": {"common"},
    "worker": {"common", "kvtransfer"},
    "prefill_svc": {"common", "kvtransfer", "worker"},
    "decode_svc": {"common", "kvtransfer", "worker"},
    "launcher": {"common", "kvtransfer", "gateway", "worker"},  # it starts them, with their own flags
    "pdctl": {"common", "kvtransfer", "gateway", "worker"},
    "benchmarks": set(PACKAGES) | {"tests"},
}


def module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports (``from a.b import c`` names ``a.b.c`` when that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(path, modules) - {name} for name, path in modules.items()}


def test_no_module_imports_itself_round_a_loop():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    loops = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph.get(name, ())):
            if target in PACKAGES:
                continue  # a top-level package's face (``kvtransfer/__init__.py``) hands names on
            if state.get(target) == 1:
                loops.append(path[path.index(target):] + [target] if target in path else [name, target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not loops, "import loops: " + "; ".join(" -> ".join(loop) for loop in loops)


def test_imports_only_point_down_the_floors():
    wrong = []
    for name, targets in import_graph().items():
        top = name.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other != top and other not in MAY_IMPORT[top]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports that point up or across: " + ", ".join(sorted(wrong))


def test_the_checks_see_a_loop_and_an_upward_import(monkeypatch):
    """The checks above can fail: a module of ``common`` importing the worker is both."""
    graph = import_graph()
    graph["common.engine.engine"] = graph["common.engine.engine"] | {"worker.engine_thread"}
    monkeypatch.setattr(sys.modules[__name__], "import_graph", lambda: graph)
    try:
        test_imports_only_point_down_the_floors()
    except AssertionError as exc:
        assert "common.engine.engine -> worker.engine_thread" in str(exc)
    else:
        raise AssertionError("an upward import went unseen")
    try:
        test_no_module_imports_itself_round_a_loop()
    except AssertionError as exc:
        assert "common.engine.engine" in str(exc) and "worker.engine_thread" in str(exc)
    else:
        raise AssertionError("an import loop went unseen")
