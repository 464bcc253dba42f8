"""Recounts the house's figures from the source, so each pass can compare with the last.

    python tests/architecture_figures.py          # a table
    python tests/architecture_figures.py --json   # the same figures as JSON

Counted under ``distrain/_src``: modules and lines, imports between them (top-level,
function-local and type-only alike, as ``tests/test_architecture.py`` reads them), the
import cycles (and which of them hold only type-only edges), modules over 500 lines,
functions over 100 lines, file names used by more than one module of the package, and
the modules that import the public package ``distrain`` itself.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "distrain" / "_src"
MODULE_LINES = 500
FUNCTION_LINES = 100


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _type_only_lines(tree: ast.Module) -> set[int]:
    """Line numbers of imports inside ``if TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    lines.add(inner.lineno)
    return lines


def edges() -> dict[str, dict[str, bool]]:
    """``{module: {imported module: type-only}}`` for imports inside ``distrain._src``."""
    paths = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, dict[str, bool]] = {m: {} for m in paths}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        typed = _type_only_lines(tree)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in paths and t != name:
                    only_types = node.lineno in typed
                    graph[name][t] = graph[name].get(t, True) and only_types
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.add(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        out.append(component)
    return out


def long_functions() -> dict[str, int]:
    """``{"module:function": lines}`` for functions over ``FUNCTION_LINES`` lines."""
    out = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_LINES:
                    out[f"{module_name(path)}:{node.name}"] = lines
    return dict(sorted(out.items()))


def long_modules() -> dict[str, int]:
    """``{module: lines}`` for modules over ``MODULE_LINES`` lines."""
    out = {module_name(p): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    return dict(sorted((m, n) for m, n in out.items() if n > MODULE_LINES))


def shared_file_names() -> dict[str, list[str]]:
    """File names used by more than one module of the package (``__init__`` aside)."""
    by_name = collections.defaultdict(list)
    for p in (ROOT / "distrain").rglob("*.py"):
        if p.name != "__init__.py":
            by_name[p.name].append(str(p.relative_to(ROOT)))
    return {k: sorted(v) for k, v in sorted(by_name.items()) if len(v) > 1}


def public_package_imports() -> list[str]:
    """Modules under ``_src`` that import ``distrain`` or one of its public modules."""
    out = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n == "distrain" or (n.startswith("distrain.") and "._src" not in n)
                   for n in names):  # fmt: skip
                out.add(module_name(path))
    return sorted(out)


def figures() -> dict:
    graph = edges()
    plain = {m: set(targets) for m, targets in graph.items()}
    value_graph = {m: {t for t, typed in ts.items() if not typed} for m, ts in graph.items()}
    found = cycles(plain)
    value_cycles = cycles(value_graph)
    files = list(SRC.rglob("*.py"))
    return {
        "modules": len(files),
        "lines": sum(len(p.read_text().splitlines()) for p in files),
        "imports": sum(len(t) for t in graph.values()),
        "cycles": len(found),
        "cycles_type_only": len(found) - len(value_cycles),
        "cycles_not_type_only": [sorted(c) for c in value_cycles],
        f"modules_over_{MODULE_LINES}_lines": long_modules(),
        f"functions_over_{FUNCTION_LINES}_lines": long_functions(),
        "file_names_used_twice": shared_file_names(),
        "modules_importing_the_public_package": public_package_imports(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    result = figures()
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for key, value in result.items():
        if isinstance(value, dict | list) and value:
            print(f"{key}:")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                print(f"  {k}: {v}")
        else:
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
