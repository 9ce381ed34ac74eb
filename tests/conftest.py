"""Shared test setup: offline, seeded, and the device markers' skip reasons."""

import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


if os.environ.get("PYTEST_XDIST_WORKER"):  # one of the workers `-n 2` starts: one torch thread each
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    # Hermetic: a profile.json or reference in the user's cache (~/.cache/mpsimpact) changes no result.
    os.environ["MPSIMPACT_CACHE"] = str(tmp_path_factory.mktemp("mpsimpact-cache"))


def pytest_collection_modifyitems(config, items):
    has_mps = torch.backends.mps.is_available()
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "mps" in item.keywords and not has_mps:
            item.add_marker(pytest.mark.skip(reason="needs a real Apple GPU (MPS is not available)"))
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA is not available)"))


# What the audience reads (issue 48): every command any test runs through typer's CliRunner is read back as
# text. Its stdout and stderr never print None or an empty list; at COLUMNS=80 (a default Mac terminal, as the
# console tests set it) no line passes 80 columns; a command to type is never cut inside its backquotes (but in
# a table's cell, which wraps as the table narrows); a
# command printed alone that goes on to a second line ends its first with " \" and continues with an option.
# A JSON answer (--json) is exempt from the width (a machine reads it), and so is a line with a word of 50
# characters or more (a temporary folder's path: a word is never wrapped inside).
_BACKQUOTED = re.compile(r"`[^`\n]*`")
_WORD = re.compile(r"(?<!\S)'[^'\n]*'(?=[\s`]|$)|\S+")  # a word; a quoted path with spaces (a shell's word) is one


def console_problems(args: list[str], env: dict, stdout: str, stderr: str) -> list[str]:
    problems = []
    for name, text in (("stdout", stdout), ("stderr", stderr)):
        if "Traceback (most recent call last)" in text:  # a test's deliberate crash: Python's own text
            continue
        shown = re.sub(r"'[^'\n]*'", "''", text)  # a value the user gave, echoed in quotes, is theirs
        if re.search(r"\bNone\b|\[\]", shown) and not _is_json(text):  # JSON's null and [] are data
            problems.append(f"{name} prints None or []: {text!r}")
        lines = text.splitlines()
        narrow = (env.get("COLUMNS") or os.environ.get("COLUMNS")) == "80" and "--json" not in args
        problems += [f"{name} line over 80 columns: {line!r}" for line in lines
                     if narrow and len(line) > 80 and max(map(len, _WORD.findall(line))) < 50]  # a path is one word
        for line, after in zip(lines, [*lines[1:], ""]):
            if not line.startswith(("│", "┃")) and _BACKQUOTED.sub("", line).count("`") % 2:  # a table cell wraps
                problems.append(f"{name}: a backquoted command cut at the line's end: {line!r}")
            if line.startswith("mpsimpact ") and line.endswith(" \\") and not after.startswith("  --"):
                problems.append(f"{name}: a command to type continues into other text: {line!r} / {after!r}")
    return problems


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.fixture(autouse=True)
def _every_console_reads_right(monkeypatch):
    from typer.testing import CliRunner

    seen, real = [], CliRunner.invoke

    def invoke(self, cli, args=None, *rest, **kwargs):
        result = real(self, cli, args, *rest, **kwargs)
        stderr = result.stderr if result.stderr_bytes else ""
        seen.append((list(args or []), kwargs.get("env") or {}, result.stdout, stderr))
        return result

    monkeypatch.setattr(CliRunner, "invoke", invoke)
    yield
    problems = [problem for call in seen for problem in console_problems(*call)]
    assert not problems, "\n".join(problems[:5])


@pytest.fixture(autouse=True)
def _every_plugin_run_reads_right(request, monkeypatch):
    # The same scan for the pytest plugin's own lines (its header, its summary, a failed test's section) in every
    # pytester run: at COLUMNS=80 no line past 80 columns, and never None or [] (pytest's own lines are pytest's).
    if "pytester" not in request.fixturenames:
        yield
        return
    from plugin_runs import plugin_lines

    seen, real = [], pytest.Pytester.runpytest_inprocess

    def run(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        seen.append((os.environ.get("COLUMNS"), plugin_lines(result.outlines)))
        return result

    monkeypatch.setattr(pytest.Pytester, "runpytest_inprocess", run)
    yield
    problems = [f"a plugin line over 80 columns: {line!r}" for columns, lines in seen if columns == "80"
                for line in lines if len(line) > 80 and max(map(len, line.split())) < 50]
    problems += [f"a plugin line prints None or []: {line!r}" for _, lines in seen for line in lines
                 if re.search(r"\bNone\b|\[\]", re.sub(r"'[^'\n]*'", "''", line))]
    assert not problems, "\n".join(problems[:5])
