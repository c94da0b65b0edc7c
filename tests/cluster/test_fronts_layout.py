"""The layout of the fronts: `cbserve.serving` (the protocol) imports no Ray, not even through
what it imports, and nothing of `cluster` or `batch`; within it, what runs where a request
arrives (`serving.front`) and what runs next to the engine (`serving.replica`) import only what
they share, not each other; `cluster` (Ray Serve) does not import `batch`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module(p): p for p in sorted((ROOT / "cbserve" / package).rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_serving_imports_no_ray() -> None:
    modules = [m for m in _modules("serving") if not m.endswith("protos.build")]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(k for k in sys.modules if k == 'ray' or k.startswith('ray.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert len(modules) > 10


def test_serving_imports_no_front_and_cluster_imports_no_batch() -> None:
    """(Import cycles and the engine's side: tests/test_layout.py.)"""
    for package, banned in (("serving", ("cbserve.cluster", "cbserve.batch", "ray")), ("cluster", ("cbserve.batch",))):
        for name, path in _modules(package).items():
            bad = sorted(d for d in _imports(path) if d.startswith(banned))
            assert not bad, f"{name} imports {bad}"


def test_the_front_and_the_replica_share_only_the_protocol() -> None:
    sides = {"front": "cbserve.serving.replica", "replica": "cbserve.serving.front"}
    for side, other in sides.items():
        modules = _modules(f"serving/{side}")
        assert len(modules) >= 2, side
        for name, path in modules.items():
            bad = sorted(d for d in _imports(path) if d == other or d.startswith(other + "."))
            assert not bad, f"{name} imports {bad}"
