"""The package's shape: public names stay the documented objects whatever is imported first, and no
module imports a module that imports it back."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import mpsimpact

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"mpsimpact": ROOT / "src" / "mpsimpact", "mpsimpact.scenarios": ROOT / "scenarios"}

# Prints, for every public name, what it is after the given imports ran first.
PROBE = """
import importlib, inspect, json, pkgutil, sys
import mpsimpact
import mpsimpact.scenarios
def submodules():
    names = [f"mpsimpact.{m.name}" for m in pkgutil.iter_modules(mpsimpact.__path__)]
    return names + [f"mpsimpact.scenarios.{m.name}" for m in pkgutil.iter_modules(mpsimpact.scenarios.__path__)]
def kinds():
    return {name: ("module" if inspect.ismodule(getattr(mpsimpact, name)) else
                   "documented" if getattr(mpsimpact, name) is getattr(importlib.import_module(mpsimpact._EXPORTS[name]), name)
                   else "other") for name in mpsimpact.__all__}
if sys.argv[1] == "submodules-first":
    for name in submodules():
        importlib.import_module(name)
    print(json.dumps(kinds()))
else:
    first = kinds()
    for name in submodules():
        importlib.import_module(name)
    print(json.dumps({name: first[name] if first[name] != "documented" else kind for name, kind in kinds().items()}))
"""


def module_files() -> dict[str, Path]:
    files = {}
    for package, folder in SOURCES.items():
        for path in folder.glob("*.py"):
            files[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return files


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """Every project module an import statement in `path` names, at any depth (in functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in known}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_module_imports_a_module_that_imports_it_back():
    files = module_files()
    graph = {name: imported_modules(path, set(files)) - {name} for name, path in files.items()}
    assert "mpsimpact.workload" in graph["mpsimpact.training"]  # the walker sees imports at all
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]


def test_no_public_name_is_also_a_submodule_name():
    submodules = set(module_files())
    assert not {f"mpsimpact.{name}" for name in mpsimpact.__all__} & submodules


def test_public_names_are_the_documented_objects_in_either_import_order():
    for order in ("submodules-first", "names-first"):
        result = subprocess.run([sys.executable, "-c", PROBE, order], capture_output=True, text=True, check=True)
        kinds = json.loads(result.stdout)
        assert set(kinds) == set(mpsimpact.__all__)
        assert {name: kind for name, kind in kinds.items() if kind != "documented"} == {}, order


def test_the_readme_guard_one_liner_works_after_emulate_and_after_importing_the_module():
    script = (
        "import torch, mpsimpact\n"
        "with mpsimpact.emulate(index_bits=20):\n"
        "    pass\n"
        "import mpsimpact.safeguard\n"
        "with mpsimpact.guard('chunk'):\n"
        "    torch.ones(2, 2) @ torch.ones(2, 2)\n"
        "print(type(mpsimpact.guard).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "function"
