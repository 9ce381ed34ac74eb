"""The command blocks of README.md and of every page of the documentation (docs/*.md) run as typed, or say why
not. Every fenced `bash`/`sh`/`shell`/`console` block, and every unlabelled block whose lines are commands, carries
a marker comment on the line above it:

    <!-- readme-test: run -->                       runs by default (CI)
    <!-- readme-test: ci -->                        runs in CI after the default selection (`pytest -m ci`): a whole
                                                    command of more than a few CPU-seconds
    <!-- readme-test: slow -->                      runs with `pytest -m slow` (over a minute on 2 CPU cores)
    <!-- readme-test: network, slow -->             needs the package index too (skipped when unreachable)
    <!-- readme-test: skip: needs a Mac -->         never runs here; the reason is shown by `pytest -ra`

followed by options separated by `;`: `exit N` (the block's documented exit code, default 0), `expect TEXT`
(a line the README claims the block prints; repeatable; compared with whitespace collapsed), `lines A-B`
(run only those lines of the block, 1-based, e.g. the emulated line of a block whose others need a Mac).
A runnable block runs with `bash -e` in a temporary copy of the clone's tests/, src/, docs/, ... (so the default
outputs/ lands there), with its own MPSIMPACT_CACHE and Hugging Face offline. It must leave that copy as it found it
but for outputs/ (git-ignored), so that typed in a clone it leaves `git status` clean.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Every Markdown file whose blocks are run: the README, then the documentation's pages.
DOCUMENTS = (README, *sorted((ROOT / "docs").rglob("*.md")))
SHELL_INFO = {"bash", "sh", "shell", "console"}
# A command, not a line of output such as "mpsimpact guard: bmm[...] ..." (a word and a colon after the program).
COMMAND_LINE = re.compile(r"^\s*(\$ )?(mpsimpact|pip|pytest|python|uv|hf)(\s+(?!\S*:\s)|$)")
FENCE = re.compile(r"^(\s*)```\s*(\S*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
KINDS = {"run", "ci", "slow", "network"}
COPIED = ("tests", "src", "scenarios", "docs", "benchmarks", "README.md", "pyproject.toml", "mkdocs.yml")
NOT_COPIED = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache")  # what git ignores in them
OUTPUTS = "outputs"  # what a block may write in the clone (ignored by .gitignore's /outputs/*)
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
SHELL_SYNTAX = re.compile(r"[|&;<>$`]")
NETWORK_ERROR = re.compile(r"Request failed|Failed to fetch|connect|dns|timed out|unreachable", re.IGNORECASE)


@dataclass(frozen=True)
class Spec:
    """What a marker asks for."""

    kinds: frozenset[str]
    reason: str = ""
    exit_code: int = 0
    expect: tuple[str, ...] = ()
    lines: tuple[int, int] | None = None


@dataclass(frozen=True)
class Block:
    """One fenced block of commands: where it starts (1-based line of the fence), its info string, its
    lines, the marker comment above it (None when there is none) and the file it is in (relative to the clone)."""

    line: int
    info: str
    text: tuple[str, ...]
    marker: str | None
    file: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def name(self) -> str:
        first = next((t for t in self.text if t.strip() and not t.lstrip().startswith("#")), "")
        words = re.sub(r"[^\w.-]+", "-", first.lstrip("$ ").strip())[:48].strip("-")
        return f"{self.file}:L{self.line}-{words}"

    def commands(self, spec: Spec) -> str:
        lines = list(self.text)
        if spec.lines:
            lines = lines[spec.lines[0] - 1:spec.lines[1]]
        if self.info == "console":  # a transcript: only the prompted lines are commands
            lines = [t.lstrip()[2:] for t in lines if t.lstrip().startswith("$ ")]
        return "\n".join(lines) + "\n"


def parse_blocks(markdown: str, file: str = "README.md") -> list[Block]:
    """The command blocks of a Markdown text (fences may be indented, as in a list); `file` names it."""
    lines = markdown.splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, info, start = opening[1], opening[2].lower(), index
        end = next((j for j in range(start + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        text = tuple(t[len(indent):] if t.startswith(indent) else t for t in lines[start + 1:end])
        index = end + 1
        if info not in SHELL_INFO and not (info == "" and any(COMMAND_LINE.match(t) for t in text)):
            continue
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(above)
        blocks.append(Block(start + 1, info, text, marker[1] if marker else None, file))
    return blocks


def parse_marker(marker: str) -> Spec:
    """A marker's kinds and options; ValueError naming what is wrong."""
    head, *options = [part.strip() for part in marker.split(";")]
    if head.startswith("skip"):  # the rest is the reason, semicolons and all
        reason = marker.strip()[4:].lstrip(" :").strip()
        if not marker.strip()[4:].lstrip().startswith(":") or not reason:
            raise ValueError(f"'{marker}': a skip says why, e.g. 'skip: needs a Mac'")
        return Spec(frozenset({"skip"}), reason=reason)
    kinds = frozenset(re.split(r"[,\s]+", head))
    if not kinds <= KINDS:
        raise ValueError(f"'{marker}': unknown kind {sorted(kinds - KINDS)}; expected run, ci, slow, network or skip")
    exit_code, expect, span = 0, [], None
    for option in options:
        word, _, value = option.partition(" ")
        if word == "exit" and value.strip().isdigit():
            exit_code = int(value)
        elif word == "expect" and value.strip():
            expect.append(value.strip())
        elif word == "lines" and re.fullmatch(r"\d+-\d+", value.strip()):
            first, last = map(int, value.split("-"))
            span = (first, last)
        else:
            raise ValueError(f"'{marker}': unknown option '{option}' (exit N, expect TEXT, lines A-B)")
    return Spec(kinds, exit_code=exit_code, expect=tuple(expect), lines=span)


BLOCKS = [block for path in DOCUMENTS
          for block in parse_blocks(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())]


def test_the_blocks_of_the_readme_and_of_every_docs_page_are_collected():
    files = {block.file for block in BLOCKS}
    assert "README.md" in files and "docs/giving-the-talk.md" in files  # the pages with blocks were read
    assert {path.relative_to(ROOT).as_posix() for path in DOCUMENTS} >= files
    runs = [block for block in BLOCKS if block.file != "README.md" and "run" in parse_marker(block.marker).kinds]
    assert runs  # a docs page's block runs by default, not only the README's


def test_every_command_block_carries_a_marker():
    unmarked = [f"{b.where} ({b.name})" for b in BLOCKS if b.marker is None]
    assert not unmarked, f"command blocks without a '<!-- readme-test: ... -->' line above them: {unmarked}"
    for block in BLOCKS:
        parse_marker(block.marker)  # raises, naming the marker, when it is malformed


def test_the_parser_finds_unmarked_and_unlabelled_command_blocks():
    text = ("x\n```bash\nmpsimpact list\n```\n<!-- readme-test: skip: needs a Mac -->\n\n```sh\nls\n```\n"
            "```\nmpsimpact plan sentiment\n```\n```\nEMULATED MPS, guard off: 6 texts\n```\n"
            "```\nmpsimpact guard: bmm\n```\n"
            "- item\n  <!-- readme-test: run; exit 3; expect cannot tell; lines 2-2 -->\n  ```console\n"
            "  $ mpsimpact doctor\n  output line\n  ```\n```python\nimport mpsimpact\n```\n")
    blocks = parse_blocks(text)
    assert [(b.line, b.info, b.marker) for b in blocks] == [
        (2, "bash", None), (7, "sh", "skip: needs a Mac"), (10, "", None),
        (21, "console", "run; exit 3; expect cannot tell; lines 2-2")]
    spec = parse_marker(blocks[3].marker)
    assert spec == Spec(frozenset({"run"}), exit_code=3, expect=("cannot tell",), lines=(2, 2))
    assert blocks[3].commands(Spec(frozenset({"run"}))) == "mpsimpact doctor\n"
    for bad in ("skip", "skip:", "quick", "run; exit three", "run; lines 2"):
        with pytest.raises(ValueError):
            parse_marker(bad)


def _param(block: Block):
    try:
        spec = parse_marker(block.marker or "")
    except ValueError:
        spec = Spec(frozenset({"skip"}), reason="unmarked or malformed (see the marker test)")
    marks = [getattr(pytest.mark, kind) for kind in sorted(spec.kinds & {"ci", "slow", "network"})]
    if "skip" in spec.kinds:
        marks.append(pytest.mark.skip(reason=f"{block.where}: {spec.reason}"))
    return pytest.param(block, spec, marks=marks, id=block.name)


def _workspace(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A folder that looks like the clone (a copy of its files: a block cannot touch the clone itself) and the
    block's environment (no bytecode written, as git would ignore it)."""
    work = tmp_path / "work"
    work.mkdir()
    for name in COPIED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, work / name, symlinks=True, ignore=NOT_COPIED)
        else:
            shutil.copy2(ROOT / name, work / name)
    bin_dir = str(Path(sys.executable).parent)  # `mpsimpact` and `python` of this interpreter
    env = {**os.environ, **OFFLINE, "MPSIMPACT_CACHE": str(tmp_path / "cache"), "COLUMNS": "160",
           "PYTHONDONTWRITEBYTECODE": "1", "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    return work, env


def files_in(work: Path) -> dict[str, tuple[int, int]]:
    """Every file and link in a workspace but under outputs/, with its size and modification time."""
    found = {}
    for folder, folders, names in os.walk(work):  # links to folders are not followed: a link is a file here
        if Path(folder) == work and OUTPUTS in folders:
            folders.remove(OUTPUTS)
        for name in names + [name for name in folders if os.path.islink(os.path.join(folder, name))]:
            path = Path(folder, name)
            state = path.lstat()
            found[path.relative_to(work).as_posix()] = (state.st_size, state.st_mtime_ns)
    return found


def changed_files(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """The files made, changed or removed between two `files_in`: what `git status` would show in a clone."""
    return sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))


def mpsimpact_lines(commands: str) -> list[list[str]] | None:
    """The block's commands as argument lists when every one is a plain `mpsimpact ...` line (no pipe,
    redirection, variable or other program); else None (the block runs in bash)."""
    lines = []
    for line in commands.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] != "mpsimpact" or SHELL_SYNTAX.search(line.split("#", 1)[0]):
            return None
        lines.append(words[1:])
    return lines or None


def run_in_process(lines: list[list[str]], work: Path, env: dict[str, str],
                   monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """Runs `mpsimpact` lines as `bash -e` would (stop at the first that fails) through the CLI's own entry
    in this process (typer's runner): the same parsing and code, without a torch import per line."""
    from typer.testing import CliRunner

    from mpsimpact.cli import app

    monkeypatch.chdir(work)
    for name in (*OFFLINE, "MPSIMPACT_CACHE", "COLUMNS"):
        monkeypatch.setenv(name, env[name])
    output, code = [], 0
    for args in lines:
        result = CliRunner().invoke(app, args, prog_name="mpsimpact")
        output.append(result.stdout + result.stderr)
        code = result.exit_code
        if code:
            break
    return code, "".join(output)


@pytest.mark.parametrize(("block", "spec"), [_param(b) for b in BLOCKS])
def test_readme_block_runs_as_typed(block: Block, spec: Spec, tmp_path: Path, monkeypatch):
    # A block of plain mpsimpact lines runs in this process (the process boundary is not what it tests:
    # tests/test_light_install.py and test_imports.py run the installed command itself); others in bash.
    work, env = _workspace(tmp_path)
    files = files_in(work)
    started = time.monotonic()
    lines = mpsimpact_lines(block.commands(spec))
    if lines is not None:
        returncode, output = run_in_process(lines, work, env, monkeypatch)
    else:
        script = tmp_path / "block.sh"
        script.write_text(block.commands(spec))
        done = subprocess.run(["bash", "-e", str(script)], cwd=work, env=env, capture_output=True, text=True,
                              timeout=3600)
        returncode, output = done.returncode, done.stdout + done.stderr
    print(f"{block.where}: exit {returncode} in {time.monotonic() - started:.1f} s")
    if "network" in spec.kinds and returncode != spec.exit_code and NETWORK_ERROR.search(output):
        pytest.skip(f"the package index cannot be reached: {output.strip().splitlines()[-1]}")
    assert returncode == spec.exit_code, f"{block.where} exited {returncode}:\n{output[-4000:]}"
    flat = " ".join(output.split())
    missing = [text for text in spec.expect if " ".join(text.split()) not in flat]
    assert not missing, f"{block.where} did not print {missing}:\n{output[-4000:]}"
    changed = changed_files(files, files_in(work))
    assert not changed, (f"{block.where} made, changed or removed {changed[:8]} in the clone: `git status` would "
                         f"show them; write under {OUTPUTS}/ (git-ignored) or a temporary folder")


def test_what_a_block_may_leave_is_what_git_ignores(tmp_path):
    # outputs/ is ignored, its .gitkeep aside (git's own reading of .gitignore); anything else a block makes is
    # not, and is found.
    if shutil.which("git") is not None and (ROOT / ".git").exists():
        paths = f"{OUTPUTS}/a-run/report.json\n{OUTPUTS}/.gitkeep\nmy-roberta/config.json\n"
        done = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input=paths,
                              capture_output=True, text=True)
        assert done.stdout.split() == [f"{OUTPUTS}/a-run/report.json"]
    work, _ = _workspace(tmp_path)
    before = files_in(work)
    assert "tests/test_readme_commands.py" in before and "mkdocs.yml" in before  # the copy holds the clone's files
    (work / OUTPUTS / "a-run").mkdir(parents=True)
    (work / OUTPUTS / "a-run" / "report.json").write_text("{}")
    (work / "my-roberta").mkdir()
    (work / "my-roberta" / "config.json").write_text("{}")
    (work / "docs" / "index.md").write_text("changed")
    (work / "docs" / "glossary.md").unlink()
    (work / "tests" / "there").symlink_to(work / "src")
    assert changed_files(before, files_in(work)) == ["docs/glossary.md", "docs/index.md", "my-roberta/config.json",
                                                     "tests/there"]


def test_the_readme_test_command_is_the_one_ci_runs():
    # The README's set-up commands are CI's: the same torch pin, then its test command word for word (CI's pip
    # quiet: its -q aside).
    ci_lines = [line.strip().replace("pip install -q ", "pip install ") for line in
                (ROOT / ".ci" / "run").read_text().splitlines()]
    readme = [block for block in BLOCKS if block.file == "README.md"]
    install, tests = readme[0], next(block for block in readme if "pytest" in "".join(block.text))
    pins = {re.search(r"torch==\S+", line)[0] for line in install.text if re.search(r"torch==\S+", line)}
    assert len(pins) == 1 and f"pip install {min(pins)}" in ci_lines
    assert install.line < tests.line and "\n".join(tests.text).strip() in ci_lines
