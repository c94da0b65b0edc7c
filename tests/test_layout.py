"""The rules of the house (DESIGN.md), checked on the source: no import cycles, the engine never
imports the serving layers or Ray, kernels are leaves, the scheduler holds no tensors, and no
function is longer than one screen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "cbserve"
MAX_FUNCTION_LINES = 60
ENGINE = ("cbserve.scheduler", "cbserve.workers", "cbserve.kernels", "cbserve.api", "cbserve.manager",
          "cbserve.config", "cbserve.outputs", "cbserve.output_store", "cbserve.errors")
FRONTS = ("cbserve.serving", "cbserve.cluster", "cbserve.batch", "ray")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py") if "protos" not in p.parts}


def imports(name: str, source: str | None = None) -> set[str]:
    """Every module `name` imports, at its top or inside a function (a lazy import still ties them)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source if source is not None else MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycles() -> None:
    graph = {m: {i for i in imports(m) if i in MODULES and i != "cbserve"} for m in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("name", sorted(m for m in MODULES if within(m, ENGINE)))
def test_the_engine_never_imports_a_front_or_ray(name: str) -> None:
    bad = sorted(i for i in imports(name) if within(i, FRONTS))
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if within(m, ("cbserve.kernels",))))
def test_kernels_are_leaves(name: str) -> None:
    bad = sorted(i for i in imports(name) if within(i, ("cbserve",)) and not within(i, ("cbserve.kernels",)))
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if within(m, ("cbserve.scheduler",))))
def test_the_scheduler_holds_no_tensors(name: str) -> None:
    bad = sorted(i for i in imports(name) if within(i, ("torch", "cbserve.workers", "cbserve.kernels")))
    assert not bad, f"{name} imports {bad}"


def _is_triton_kernel(node: ast.AST) -> bool:
    return any("jit" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def long_functions(source: str) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append((node.name, lines))
    return found


def test_functions_fit_on_one_screen() -> None:
    long = [f"{name}.{fn}: {n} lines" for name, path in MODULES.items() for fn, n in long_functions(path.read_text())]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_checks_can_fail() -> None:
    """Planted faults are found: a cycle, an engine module importing Ray, a long function."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "ray" in imports("x", "def f():\n    import ray\n")
    assert long_functions("def f():\n" + "    x = 1\n" * 70) == [("f", 71)]
    assert long_functions("@triton.jit\ndef k():\n" + "    x = 1\n" * 70) == []
