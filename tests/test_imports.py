"""The package's shape: public names stay the documented objects whatever is imported first, imports
go one way through the layers (docs/fault-model.md is the engine's; docs/development.md's "Layout" lists them), and no
module imports a module that imports it back."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mpsimpact

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"mpsimpact": ROOT / "src" / "mpsimpact", "mpsimpact.scenarios": ROOT / "scenarios"}

# Prints, for every public name, what it is after the given imports ran first.
PROBE = """
import importlib, inspect, json, pkgutil, sys
import mpsimpact
import mpsimpact.scenarios
def submodules():
    return [m.name for m in pkgutil.walk_packages(mpsimpact.__path__, "mpsimpact.")]
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
        for path in folder.rglob("*.py"):
            parts = (package, *path.relative_to(folder).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
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
    assert "mpsimpact.runs.device_pass" in graph["mpsimpact.runs.training"]  # the walker sees imports at all
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]


# Layers from the bottom; a module imports only modules of lower rank, or of its own subpackage.
# errors, bounds and variables are leaves for everyone; config and output for everyone above the modes.
RANKS = {
    "errors": 0, "bounds": 0.5, "variables": 0.75, "engine": 1, "modes": 2, "attention": 2.5, "config": 3,
    "output": 4, "pytest_plugin": 4.5, "prediction": 5, "models": 6, "runs": 7, "scenarios": 7.5, "upgrade": 8,
    "reports": 9, "commands": 10, "cli": 11, "__main__": 12,
}
SCENARIO_MAY_IMPORT = {"runs", "models", "errors", "scenarios"}


def room(module: str) -> str:
    """The layer a module lives in: its subpackage, or its own name for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every import that goes sideways or up through the layers."""
    bad = []
    for module, imported in graph.items():
        here = room(module)
        if here == "__init__":
            continue  # the package face imports nothing at top (lazy exports)
        for target in imported:
            there = room(target)
            if there == here and here not in ("config", "errors", "cli"):
                continue  # inside one subpackage
            allowed = there in SCENARIO_MAY_IMPORT if here == "scenarios" else RANKS[there] < RANKS[here]
            if not allowed:
                bad.append((module, target))
    return sorted(bad)


def torch_at_top(path: Path) -> bool:
    """Whether a module imports torch in its top-level statements."""
    for node in ast.parse(path.read_text()).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(name == "torch" or name.startswith("torch.") for name in names):
            return True
    return False


def project_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(path, set(files)) - {name} for name, path in files.items()}


def test_imports_go_down_the_layers_only():
    graph = project_graph()
    assert set(map(room, graph)) - {"__init__"} <= set(RANKS)  # every module has a room
    assert "mpsimpact.engine.faults" in graph["mpsimpact.modes.guard"]  # the walker sees imports at all
    assert layer_violations(graph) == []


def test_the_package_top_holds_the_face_and_the_leaves_and_every_other_module_lives_in_a_room():
    # shared/ARCHITECTURE.md's top: the face (__init__, cli and python -m's __main__; attention is a room whose
    # face is the package), errors and config; beside them the leaves the engine and the modes read (bounds,
    # variables). Nothing else lies loose, and no module keeps names for others to import from it.
    folder = SOURCES["mpsimpact"]
    top = {path.stem for path in folder.glob("*.py")}
    rooms = {path.name for path in folder.iterdir() if (path / "__init__.py").is_file()}
    assert top == {"__init__", "__main__", "cli", "config", "errors", "bounds", "variables"}
    assert rooms == {"attention", "engine", "modes", "prediction", "models", "runs", "upgrade", "reports",
                     "commands", "output", "pytest_plugin"}
    assert set(RANKS) == top - {"__init__"} | rooms | {"scenarios"}
    kept = {name: found for name, path in module_files().items() if (found := reexported(path.read_text()))}
    assert kept == {}
    old_guard = "from mpsimpact.modes.guard_mode import HELD_BYTES, GuardMode  # noqa: F401\nmode = GuardMode\n"
    assert reexported(old_guard) == ["HELD_BYTES"]  # what modes/guard.py kept for old import paths is found


def reexported(source: str) -> list[str]:
    """The names a module imports from the project at its top and never uses itself: kept there only for
    others to import (a compatibility re-export)."""
    tree = ast.parse(source)
    imported = [alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("mpsimpact") for alias in node.names]
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    return [name for name in imported if name not in used]


def test_the_layer_check_catches_a_planted_violation():
    graph = project_graph()
    graph["mpsimpact.engine.faults"] = graph["mpsimpact.engine.faults"] | {"mpsimpact.runs.runner"}
    graph["mpsimpact.scenarios.sentiment"] = graph["mpsimpact.scenarios.sentiment"] | {"mpsimpact.reports.run"}
    assert layer_violations(graph) == [
        ("mpsimpact.engine.faults", "mpsimpact.runs.runner"),
        ("mpsimpact.scenarios.sentiment", "mpsimpact.reports.run"),
    ]


def test_the_engine_imports_no_other_subpackage_but_the_leaves_and_no_torch_at_top():
    # The leaves: errors, and bounds (a profile.json is read as every file is: Note [Only regular files]).
    graph = project_graph()
    engine = {name for name in graph if room(name) == "engine"}
    assert len(engine) >= 3
    assert {(m, t) for m in engine for t in graph[m] if room(t) not in ("engine", "errors", "bounds")} == set()
    assert [m for m in engine if torch_at_top(module_files()[m])] == []


def test_the_subpackage_graph_has_no_cycle():
    rooms: dict[str, set[str]] = {}
    for module, imported in project_graph().items():
        rooms.setdefault(room(module), set()).update(room(t) for t in imported if room(t) != room(module))
    assert find_cycle(rooms) is None


def test_no_public_name_is_also_a_submodule_name():
    submodules = set(module_files())
    assert not {f"mpsimpact.{name}" for name in mpsimpact.__all__} & submodules


@pytest.mark.ci  # fresh processes: CI runs it after the default selection (pytest -m ci)
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
        "import mpsimpact.modes.guard\n"
        "with mpsimpact.guard('chunk'):\n"
        "    torch.ones(2, 2) @ torch.ones(2, 2)\n"
        "print(type(mpsimpact.guard).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "function"


def test_the_readme_layout_names_every_module_in_its_room():
    section = (ROOT / "docs" / "development.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| `")}
    unnamed = []
    for name in module_files():
        parts = name.split(".")
        if len(parts) != 3 or parts[1] == "scenarios" or parts[2] == "__init__":
            continue
        row = next((line for key, line in rows.items() if f"`{parts[1]}/`" in key), "")
        if f"`{parts[2]}`" not in row:
            unnamed.append(name)
    assert len(rows) >= 8  # the table was found
    assert unnamed == []


def test_the_cli_imports_no_engine_module_and_the_engine_errors_are_mpsimpact_errors():
    from mpsimpact.engine.profile_file import ProfileFileError
    from mpsimpact.errors import MpsImpactError

    assert not {t for t in project_graph()["mpsimpact.cli"] if room(t) == "engine"}
    error = ProfileFileError("Profile 'p.json': bad", "p.json", "release")
    assert isinstance(error, MpsImpactError) and isinstance(error, ValueError)
    assert error.to_json() == {"type": "ProfileFileError", "message": "Profile 'p.json': bad",
                               "path": "p.json", "field": "release"}
    with pytest.raises(MpsImpactError, match="'newest' is not a torch release") as raised:
        with mpsimpact.guard("raise", profile="newest"):
            pass
    assert isinstance(raised.value, ValueError)


def test_the_runner_calls_the_kinds_never_the_other_way():
    graph = project_graph()
    kinds = [m for m in graph if m.startswith("mpsimpact.runs.") and m.endswith("kind")]
    assert len(kinds) >= 4 and "mpsimpact.runs.kinds" not in kinds
    assert {k for k in kinds if "mpsimpact.runs.runner" in graph[k]} == set()
    assert "mpsimpact.runs.device_pass" in graph["mpsimpact.runs.classify_kind"]  # the walker sees them


# A kind's own fields: only its kind module and the module that computes them may name them.
KIND_FIELDS = {
    ("classify_kind", "metrics"): ("collapse", "flips", "chi2_collapse_p", "flips_vs_fp32"),
    ("train_kind", "training"): ("faulted_ops", "corrupted_gradient_tensors", "max_gradient_rel_error",
                                 "update_rel_error", "eval_flips_after_training"),
    ("embed_kind", "ranking"): ("recall_at_10", "self_retrieval", "top1_changed", "hubs"),
}


def named_fields(path: Path) -> set[str]:
    """Every string constant in a module (a field read or written as condition["name"])."""
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_no_kind_specific_field_is_named_outside_its_kind():
    files = {name: path for name, path in module_files().items() if name.startswith("mpsimpact.")
             and not name.startswith("mpsimpact.scenarios")}
    strays = {(module, field) for owners, fields in KIND_FIELDS.items() for module, path in files.items()
              if module.rpartition(".")[2] not in owners for field in set(fields) & named_fields(path)}
    assert named_fields(files["mpsimpact.runs.train_kind"]) >= {"corrupted_gradient_tensors"}  # it sees them
    assert strays == set()


def declared_names(kind) -> set[str]:
    """The condition fields and files a kind (or the RunKind base) declares."""
    columns = [key for key, _ in getattr(kind, "columns", ())]  # the base declares no columns and no files
    return {*columns, *getattr(kind, "files", ()), *kind.console_formats, *kind.counts, *kind.fractions,
            *kind.uncompared, *kind.position_files}


def test_upgrade_names_no_field_or_file_of_one_kind():
    # What one kind declares and not every kind (nor the base) does is that kind's: compare asks the kind.
    from mpsimpact.runs.kind import PASS_COLUMNS, RunKind
    from mpsimpact.runs.kinds import KINDS

    each = [declared_names(kind) for kind in KINDS.values()]
    common = set.intersection(*each) | declared_names(RunKind) | {key for key, _ in PASS_COLUMNS}
    own = set.union(*each) - common
    assert {"accuracy", "reference_accuracy", "logits.npz", "samples.jsonl", "phase", "recall_at_10"} <= own
    upgrade = {name: path for name, path in module_files().items() if room(name) == "upgrade"}
    assert len(upgrade) >= 5
    assert {(module, name) for module, path in upgrade.items() for name in named_fields(path) & own} == set()


def test_the_reports_import_no_module_that_runs_work():
    # Reports print and write what they are handed: they may read the output helpers, the config's
    # constants, the errors and the engine's pure rules and names, nothing that runs, traces or compares.
    graph = project_graph()
    reports = [m for m in graph if room(m) == "reports"]
    assert len(reports) >= 7
    assert {(m, t) for m in reports for t in graph[m]
            if room(t) not in ("reports", "output", "config", "errors", "engine")} == set()
    assert "mpsimpact.output.page" in graph["mpsimpact.reports.run"]  # the walker sees them


def test_the_leaves_are_leaves():
    # output and errors import nothing of the rooms; prediction (below models) neither models nor the
    # attention face (mps_safe_eager: the room's blocked_eager it sizes); the cli no engine module (see above).
    graph = project_graph()
    for leaf, allowed in (("output", {"output", "errors", "bounds"}), ("errors", {"errors"})):
        assert {(m, t) for m in graph if room(m) == leaf for t in graph[m] if room(t) not in allowed} == set()
    prediction = [m for m in graph if room(m) == "prediction"]
    assert "mpsimpact.attention.blocked" in graph["mpsimpact.prediction.memory"]  # the walker sees the room
    assert {(m, t) for m in prediction for t in graph[m]
            if room(t) == "models" or t == "mpsimpact.attention"} == set()
