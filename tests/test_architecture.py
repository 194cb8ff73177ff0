"""The package's layout rules, read from its source with ``ast``: no import cycles, every
Triton kernel under ``tokenmill/kernels``, the environment read only by ``tokenmill/envs.py``
(and no more than six variables of our own, each documented in README.md)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokenmill"

# Import edges a cycle may still use, each with why (none today).
ALLOWED_EDGES: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its __init__)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ``name`` (a module, or an attribute of one); None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its file (at the top, in a
    function or under ``TYPE_CHECKING``: each is a dependency)."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parent + ([node.module] if node.module else []))
            # ``from package import module`` names the module; anything else, the package.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target and target != module:
                found.add(target)
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _graph_of(level_of) -> dict[str, set[str]]:
    """Import edges between the units ``level_of(module)`` names (None: not a unit)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in IMPORTS.items():
        for target in targets:
            if (module, target) in ALLOWED_EDGES:
                continue
            a, b = level_of(module), level_of(target)
            if a and b and a != b:
                graph[a].add(b)
    return graph


def test_no_import_cycle_between_modules():
    assert _cycles(_graph_of(lambda m: m)) == []


def test_no_import_cycle_between_the_top_level_packages_and_modules():
    """``tokenmill.core``, ``tokenmill.worker``, ``tokenmill.config``, ...: a layered
    package, whatever imports inside a function or under TYPE_CHECKING hide. (The package
    root, ``tokenmill/__init__.py``, is the public API that re-exports from the layers, not
    one of them: code that uses the public API, as the benchmarks do, imports it from
    there.)"""

    def top(module: str) -> str | None:
        return ".".join(module.split(".")[:2]) if module != "tokenmill" else None

    assert _cycles(_graph_of(top)) == []


@pytest.mark.parametrize(
    "package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py")
)
def test_no_import_cycle_between_the_parts_of_a_package(package):
    """Within each package, its subpackages and modules import each other without cycles."""
    depth = package.count(".") + 1

    def part(module: str) -> str | None:  # None: outside the package, or its __init__
        if not module.startswith(package + "."):
            return None
        return ".".join(module.split(".")[: depth + 1])

    assert _cycles(_graph_of(part)) == []


def _decorators(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        for deco in getattr(node, "decorator_list", []):
            found.append(ast.unparse(deco.func if isinstance(deco, ast.Call) else deco))
    return found


def test_triton_kernels_live_in_tokenmill_kernels():
    outside = [
        name for name, path in MODULES.items()
        if not name.startswith("tokenmill.kernels")
        and any(d in ("triton.jit", "triton.autotune") for d in _decorators(path))
    ]  # fmt: skip
    assert outside == []


def _reads_environment(path: Path) -> bool:
    text = path.read_text()
    return bool(re.search(r"\bos\.environ\b|\bos\.getenv\b|\bgetenv\(", text)) or bool(
        re.search(r"^\s*from tokenmill import envs\b|^\s*import tokenmill\.envs\b", text, re.M)
    )


@pytest.mark.parametrize("package", ["tokenmill.model", "tokenmill.kernels"])
def test_models_and_kernels_do_not_read_the_environment(package):
    readers = [name for name, path in MODULES.items()
               if name.startswith(package) and _reads_environment(path)]  # fmt: skip
    assert readers == []


def test_few_environment_variables_each_documented():
    names = set(re.findall(r"TOKENMILL_[A-Z0-9_]+", (PACKAGE / "envs.py").read_text()))
    elsewhere = {
        name
        for module, path in MODULES.items()
        if module != "tokenmill.envs"
        for name in re.findall(r"[\"'](TOKENMILL_[A-Z0-9_]+)[\"']", path.read_text())
    }
    assert elsewhere <= names, "read them through tokenmill/envs.py"
    assert len(names) <= 6
    readme = (ROOT / "README.md").read_text()
    assert sorted(n for n in names if n not in readme) == []
