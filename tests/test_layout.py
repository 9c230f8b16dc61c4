"""The package's layout keeps its promises: imports point one way (no cycle among modules), files stay small."""

from __future__ import annotations

import ast
import os

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "piecewise")


def _modules() -> dict[str, str]:
    found = {}
    for root, _, files in os.walk(SRC):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                parts = os.path.relpath(path, os.path.dirname(SRC))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """Modules of the package that ``module`` imports, anywhere in the file (in functions and under
    ``if TYPE_CHECKING:`` too: a circle for type hints is a circle)."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def test_no_import_cycle_among_the_package_modules():
    modules = _modules()
    graph = {m: _imports(m, p, set(modules)) for m, p in modules.items()}
    for module in graph:  # a package's __init__ importing its own submodules is not a cycle through them
        graph[module] = {t for t in graph[module] if not t.startswith(module + ".") or not module}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target] if target in stack else [node, target])
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_file_outside_the_kernels_is_over_400_lines():
    long = {}
    for module, path in _modules().items():
        if ".kernels" not in module:
            lines = sum(1 for _ in open(path))
            if lines > 400:
                long[module] = lines
    assert not long, long
