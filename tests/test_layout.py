"""The rules of the house (DESIGN.md), checked on the source: no import cycles, the engine never
imports the serving layers or Ray, kernels are leaves, the scheduler holds no tensors, no
function is longer than one screen, and no two modules share a file name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "cbserve"
MAX_FUNCTION_LINES = 60
ENGINE = ("cbserve.scheduler", "cbserve.workers", "cbserve.kernels", "cbserve.api", "cbserve.manager",
          "cbserve.engine_loop", "cbserve.config", "cbserve.outputs", "cbserve.output_store", "cbserve.errors")
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


# The engine's parts: the manager and its loop ask the engine (`num_waiting`, `free_cache()`,
# `needs_warmup`, `vocab_size`, ...) instead of reaching into them.
ENGINE_PARTS = {"cache", "runner", "scheduler", "shape", "block_manager", "sampler", "host_pool", "node_pool",
                "parallel", "requests", "packed_linears", "attention_backend"}
ENGINE_USERS = ("cbserve.manager", "cbserve.engine_loop")


def _is_engine(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine")


def engine_internals(source: str) -> list[str]:
    """`engine.<part>` and `engine._private` in `source` (`engine` a name or an attribute)."""
    found = {(node.lineno, ast.unparse(node)) for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Attribute) and _is_engine(node.value)
             and (node.attr in ENGINE_PARTS or node.attr.startswith("_"))}
    return [f"line {line}: {text}" for line, text in sorted(found)]


@pytest.mark.parametrize("name", ENGINE_USERS)
def test_the_manager_uses_no_engine_internals(name: str) -> None:
    found = engine_internals(MODULES[name].read_text())
    assert not found, f"{name} reaches into the engine: {found}"


def test_the_engine_internals_check_can_fail() -> None:
    """The manager as it was before the engine loop's split is found."""
    old = ("def destroy(self):\n    self.engine.cache.k.clear()\n"
           "def warmup(self):\n    engine = self.engine\n    if engine.runner.graphs is None:\n        return\n"
           "def room(self):\n    return len(self.engine.scheduler.waiting) + self.engine._in_flight\n")
    assert engine_internals(old) == ["line 2: self.engine.cache", "line 5: engine.runner",
                                     "line 8: self.engine._in_flight", "line 8: self.engine.scheduler"]
    assert engine_internals("def f(self):\n    return self.engine.num_waiting, engine.vocab_size, x.cache\n") == []


@pytest.mark.parametrize("name", sorted(m for m in MODULES if within(m, ("cbserve.kernels",))))
def test_kernels_are_leaves(name: str) -> None:
    bad = sorted(i for i in imports(name) if within(i, ("cbserve",)) and not within(i, ("cbserve.kernels",)))
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if within(m, ("cbserve.scheduler",))))
def test_the_scheduler_holds_no_tensors(name: str) -> None:
    bad = sorted(i for i in imports(name) if within(i, ("torch", "cbserve.workers", "cbserve.kernels")))
    assert not bad, f"{name} imports {bad}"


# A request's scheduling state: only the scheduler's modules change it (`Scheduler.update` takes
# each step's outcome back), and only they use the block manager.
SCHEDULER_STATE = {"num_computed", "status", "num_inflight", "block_ids", "num_hashed_blocks", "num_released_blocks",
                   "host_block_ids", "num_offloaded_tokens"}


def bookkeeping(source: str) -> list[str]:
    """Assignments to a request's scheduling state and calls of block manager methods in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        found += [f"line {node.lineno}: sets .{t.attr}" for t in targets
                  if isinstance(t, ast.Attribute) and t.attr in SCHEDULER_STATE]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "block_manager"):
            found.append(f"line {node.lineno}: calls block_manager.{node.func.attr}")
    return found


@pytest.mark.parametrize("name", sorted(m for m in MODULES if within(m, ENGINE) and not within(m, ("cbserve.scheduler",))))
def test_the_scheduler_does_its_own_bookkeeping(name: str) -> None:
    found = bookkeeping(MODULES[name].read_text())
    assert not found, f"{name} does the scheduler's bookkeeping: {found}"


def test_the_bookkeeping_check_can_fail() -> None:
    """The engine's step as it was before `Scheduler.update` is found."""
    old = ("def _advance(self, batch):\n    for s in batch:\n        s.request.num_computed += s.num_query_tokens\n"
           "        s.request.status = RequestStatus.DECODING\n        self.block_manager.register_full_pages(s.request)\n")
    assert bookkeeping(old) == ["line 3: sets .num_computed", "line 4: sets .status",
                                "line 5: calls block_manager.register_full_pages"]
    assert bookkeeping("def f(self):\n    self.scheduler.update(plan, result)\n    n = r.num_computed\n") == []


# The engine is built in one place: the factory makes and wires its parts (a test that swaps a
# part builds them there too, then calls EngineCore itself).
ENGINE_BUILDERS = {"cbserve/workers/factory.py", "tests/workers/test_factory.py"}


def engine_constructions(source: str) -> list[str]:
    return [f"line {node.lineno}" for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and ast.unparse(node.func).split(".")[-1] == "EngineCore"]


def test_engines_are_built_by_the_factory() -> None:
    tree = ROOT.parent
    sources = [p for folder in ("cbserve", "tests", "bench") for p in (tree / folder).rglob("*.py")]
    found = {str(p.relative_to(tree)): lines for p in sources
             if str(p.relative_to(tree)) not in ENGINE_BUILDERS and (lines := engine_constructions(p.read_text()))}
    assert not found, f"EngineCore built outside workers/factory.py (use build_engine): {found}"
    assert engine_constructions("e = engine.EngineCore(model, gc, cfg)\nf = build_engine(model)\n") == ["line 1"]


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


def shared_basenames(paths: list[Path]) -> dict[str, list[str]]:
    """File names that more than one module has (packages' `__init__`/`__main__` aside)."""
    by_name: dict[str, list[str]] = {}
    for path in paths:
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT.parent)))
    return {name: sorted(found) for name, found in by_name.items() if len(found) > 1}


def test_no_two_modules_share_a_file_name() -> None:
    """A file name says which module it is: in a traceback, a search, an editor's tab."""
    shared = shared_basenames(list(ROOT.rglob("*.py")))
    assert not shared, f"file names used by several modules: {shared}"


def test_the_checks_can_fail() -> None:
    """Planted faults are found: a cycle, an engine module importing Ray, a long function, a file
    name used twice."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "ray" in imports("x", "def f():\n    import ray\n")
    assert long_functions("def f():\n" + "    x = 1\n" * 70) == [("f", 71)]
    assert long_functions("@triton.jit\ndef k():\n" + "    x = 1\n" * 70) == []
    planted = [ROOT / "a" / "errors.py", ROOT / "b" / "errors.py", ROOT / "a" / "__init__.py", ROOT / "b" / "__init__.py"]
    assert shared_basenames(planted) == {"errors.py": ["cbserve/a/errors.py", "cbserve/b/errors.py"]}
