"""The repository stands on its own: no file points to a path outside it, and the fault-model
document that files point to instead exists and has the sections they name."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = "docs/fault-model.md"
# Built from pieces so that this file does not match itself.
OUTSIDE = ("shared/" + "FAULT-MODEL", "../" + "shared", "FAULT-MODEL" + ".md")
SKIPPED_DIRS = {".git", ".venv", "venv", "outputs", "__pycache__", ".pytest_cache", "build", "dist"}


def list_project_files(root):
    """Tracked files plus untracked ones git does not ignore; a plain walk where git is missing."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=root, capture_output=True, check=True,
        ).stdout.decode().split("\0")
        paths = [root / name for name in listed if name]
    except (OSError, subprocess.CalledProcessError):
        paths = [
            p for p in root.rglob("*")
            if not (set(p.relative_to(root).parts) & SKIPPED_DIRS) and not p.parts[-1].endswith(".egg-info")
        ]
    return sorted(p for p in paths if p.is_file())


def find_outside_references(root, paths):
    """(relative path, needle) for each file outside `.ci/` that mentions a path outside the project."""
    found = []
    for path in paths:
        relative = path.relative_to(root).as_posix()
        if relative.startswith(".ci/"):
            continue
        data = path.read_bytes()
        found += [(relative, needle) for needle in OUTSIDE if needle.encode() in data]
    return found


def test_no_file_points_outside_the_project():
    paths = list_project_files(ROOT)
    assert any(p.name == "faults.py" for p in paths)  # the listing really covers the sources
    assert find_outside_references(ROOT, paths) == []


def test_the_check_catches_a_planted_reference(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "mod.py").write_text("# see " + OUTSIDE[0] + ".md section 3\n")
    (tmp_path / "README.md").write_text("Facts: [here](" + OUTSIDE[1] + "/notes.md).\n")
    (tmp_path / "clean.md").write_text("Facts: " + DOC + ".\n")
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text(OUTSIDE[2] + "\n")
    paths = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert find_outside_references(tmp_path, paths) == [
        ("README.md", OUTSIDE[1]),
        ("src/mod.py", OUTSIDE[0]),
        ("src/mod.py", OUTSIDE[2]),
    ]


def test_references_to_the_fault_model_name_existing_sections():
    headings = {
        re.sub(r"^\d+\.\s*", "", line.lstrip("#").strip())
        for line in (ROOT / DOC).read_text().splitlines() if line.startswith("#")
    }
    cited = []
    for path in list_project_files(ROOT):
        if path.suffix not in {".py", ".md"}:
            continue
        text = re.sub(r"\s+", " ", path.read_text())  # a citation may wrap onto the next line
        cited += [(path.name, name) for name in re.findall(re.escape(DOC) + r', "([^"]+)"', text)]
    assert len(cited) >= 3  # README, faults.py, scenarios/sentiment.py at least
    assert [(file, name) for file, name in cited if name not in headings] == []


def missing_paths_and_notes(root, paths):
    """Paths under src/ that a file names but that do not exist, and Notes cited but written nowhere."""
    texts = {path: path.read_text(errors="replace") for path in paths if path.suffix in {".py", ".md", ".sh"}}
    named = {(p.relative_to(root).as_posix(), m) for p, text in texts.items()
             for m in re.findall(r"src/mpsimpact/[\w/]+\.py", text)}
    flat = [re.sub(r"\s*\n\s*(#\s*)?", " ", text) for text in texts.values()]  # a citation may wrap
    notes = {m for text in flat for m in re.findall(r"Note \[([^\]]+)\]", text)}
    written = {m for path, text in texts.items() if path.suffix == ".py"
               for m in re.findall(r"^ *# Note \[([^\]]+)\] *$", text, re.MULTILINE)}
    return sorted((f, m) for f, m in named if not (root / m).is_file()), sorted(notes - written)


def test_every_named_source_path_and_cited_note_exists():
    paths = list_project_files(ROOT)
    missing, unwritten = missing_paths_and_notes(ROOT, paths)
    assert len(paths) > 50
    assert missing == [] and unwritten == []


def test_the_path_check_catches_a_moved_module_and_an_unwritten_note(tmp_path):
    # Built from pieces, so that this file names no missing path and cites no Note.
    moved, note = "src/mpsimpact/" + "faults.py", "No" + "te ["
    (tmp_path / "src" / "mpsimpact" / "engine").mkdir(parents=True)
    (tmp_path / "src" / "mpsimpact" / "engine" / "faults.py").write_text(f"# {note}Real]\n# rules\n")
    (tmp_path / "README.md").write_text(
        f"See {note}Real] in `src/mpsimpact/engine/faults.py` and {note}Gone]\nin `{moved}`.\n")
    paths = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert missing_paths_and_notes(tmp_path, paths) == ([("README.md", moved)], ["Gone"])
