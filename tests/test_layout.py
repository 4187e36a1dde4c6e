"""The layout stays as docs/architecture.md draws it: dependencies between packages point one way,
stage logic reaches its models through engines and the broker through the stage runner, and no
module grows past 450 lines.

A package is a folder of stream_rlhf (`stream_rlhf.broker.control.core` is in `broker`); the modules
at the root (`stage.py`, `distributed.py`, `config.py`, ...) belong to no package. A package
depends on another when one of its modules imports the other at module level (an import inside a
function or under `if TYPE_CHECKING:` is not a dependency of the package's import)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "stream_rlhf"
MAX_LINES = 450
STAGES_MAY_NOT_IMPORT = ("models", "broker")


def _package(module: str) -> str | None:
    """The package of a dotted stream_rlhf module name; None for a root module or outside code."""
    parts = module.split(".")
    if parts[0] != "stream_rlhf" or len(parts) < 2 or (ROOT / f"{parts[1]}.py").exists():
        return None
    return parts[1]


def _imports(tree: ast.Module, top_level_only: bool) -> list[str]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(ROOT.rglob("*.py"))}


def _package_of_file(path: Path) -> str | None:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else None


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for path, tree in _modules().items():
        src = _package_of_file(path)
        for name in _imports(tree, top_level_only=True):
            dst = _package(name)
            if src and dst and dst != src:
                edges.setdefault(src, set()).add(dst)
                why.setdefault((src, dst), f"{path.relative_to(ROOT.parent)} imports {name}")
    cycles = _cycles(edges)
    described = [
        f"{' <-> '.join(cycle)}: " + "; ".join(why[(a, b)] for a in cycle for b in cycle if (a, b) in why)
        for cycle in cycles
    ]
    assert not cycles, "import cycles between packages:\n" + "\n".join(described)


def test_stage_logic_imports_neither_models_nor_broker():
    wrong = []
    for path, tree in _modules().items():
        if _package_of_file(path) != "stages":
            continue
        for name in _imports(tree, top_level_only=False):
            if _package(name) in STAGES_MAY_NOT_IMPORT:
                wrong.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    assert not wrong, "stages/ reaches past its engines or into the broker:\n" + "\n".join(wrong)


def test_no_module_over_the_line_limit():
    long = [f"{path.relative_to(ROOT.parent)}: {n} lines" for path in sorted(ROOT.rglob("*.py"))
            if (n := path.read_text().count("\n")) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them by what they do):\n" + "\n".join(long)


def test_the_checks_see_a_cycle_and_a_forbidden_import():
    """The checks above would fail on a cycle: fed one by hand, they find it."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _package("stream_rlhf.models.checkpoint") == "models"
    assert _package("stream_rlhf.stage") is None
    tree = ast.parse("def f():\n    from stream_rlhf.broker.control import messages\n")
    assert _imports(tree, top_level_only=False) == ["stream_rlhf.broker.control"]
    assert _imports(tree, top_level_only=True) == []
