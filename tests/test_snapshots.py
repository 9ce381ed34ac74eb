"""What the audience reads, reviewed as text (issue 48): each command's console at 80 columns kept in
tests/snapshots/, so that a change of wording shows as a diff in review. Times, paths and library versions are
masked. After a deliberate change: `MPSIMPACT_UPDATE_SNAPSHOTS=1 pytest tests/test_snapshots.py`, then read the
diff. Every console is also held to 80 columns, and every snapshot scanned: no None, no empty list."""

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mpsimpact.cli import app

SNAPSHOTS = Path(__file__).parent / "snapshots"
DATA = Path(__file__).parent / "data"
# A config is named as a user types it, relative to the folder the command runs in (a copy of tests/data made there):
# the console wraps what it prints at 80 columns, so an absolute path would move the line breaks with the length of
# the folder the checkout is in (a clone at /tmp/ci wrapped otherwise than one at /work/main).
HERE_DATA = Path("data")
UPDATE = os.environ.get("MPSIMPACT_UPDATE_SNAPSHOTS") == "1"
COMMANDS = {
    "list": ["list"],
    "check-bert": ["check", str(HERE_DATA / "bert-base" / "config.json"), "--batch-size", "2048",
                   "--torch-profile", "2.14.0"],
    "plan-memory-16gb": ["plan", "sentiment", "--memory", "16GB", "--torch-profile", "2.14.0"],
    "run-quick": ["run", "sentiment", "--quick", "--out", "out"],  # the Quickstart's command as typed
    "plan-unmeasured": ["plan", "sentiment", "--torch-profile", "2.15.0"],
    "error-too-big": ["run", "sentiment", "--batch-size", "5000000"],
    "error-scenario": ["run", "sentimnet"],
}
# Whole commands of some seconds each: run by CI (`pytest -m ci`), not in the default selection.
SLOW = {
    "plan-versions": ["plan", "sentiment", "--batch-size", "4096", "--versions", "--out", "out"],
    "check-llama": ["check", str(HERE_DATA / "llama-style-32k" / "config.json")],
    "check-t5": ["check", str(HERE_DATA / "t5-base" / "config.json")],
    "run-finetune-quick": ["run", "finetune", "--quick", "--out", "out"],
    "run-retrieval-quick": ["run", "retrieval", "--quick", "--out", "out"],
}
MASKS = [
    (re.compile(r"\b\d+\.\ds\b"), "<s>"),  # wall times
    (re.compile(r"\((\d+) s\)"), "(<s>)"),
    (re.compile(r"transformers \d+\.\d+\.\d+"), "transformers <version>"),
    (re.compile(r"torch \d+\.\d+\.\d+\+\w+"), "torch <build>"),
    (re.compile(r"offers \d+\.\d GiB"), "offers <free> GiB"),  # this machine's free memory
]
# The consoles name the installed release beside the judged one, and say what it would do on a Mac: the snapshots
# are of the torch CI installs (.ci/run).
PINNED_TORCH = "2.13.0"


def masked(text: str) -> str:
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return text


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --out out lands in a fresh folder
    shutil.copytree(DATA, tmp_path / HERE_DATA)  # 68 KB of configs: See HERE_DATA
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))


# A sentence printed (one Console.print of a plain text, a paragraph before wrapping) that starts with a capital
# letter ends as a sentence does, or with a colon before what it introduces (a command to type).
SENTENCE_ENDS = (".", ":", "?", "!")
# A label glued to a sentence of its own ("Mac: A 16 GB Mac: ...", "guard: The fused ...", "Here: Judged as ..."):
# a lower-case label, or one word, then a capitalised word that is not a name (MPS, EMULATED, GB: capitals).
GLUED = re.compile(r"(?:^|[.!?] )(?:[a-z][\w ]*|[A-Z][a-z]+): (?![A-Z]{2})(?!Apple|Metal|Mac\b|Llama)[A-Z][a-z]* ")


def printed_sentences(monkeypatch) -> list[str]:
    """Every plain text the commands print through the console from here on, one paragraph each."""
    from mpsimpact.output import console

    seen, real = [], console.Console.print

    def record(self, *objects, **kwargs):
        if len(objects) == 1 and isinstance(objects[0], str) and not objects[0].startswith("["):
            seen.append(objects[0])
        return real(self, *objects, **kwargs)

    monkeypatch.setattr(console.Console, "print", record)
    return seen


@pytest.mark.parametrize("name", [*sorted(COMMANDS), *(pytest.param(name, marks=pytest.mark.ci) for name in sorted(SLOW))])
def test_the_console_reads_as_reviewed(name, monkeypatch):
    if torch.__version__.split("+")[0] != PINNED_TORCH:
        pytest.skip(f"the snapshots are of torch {PINNED_TORCH} installed (as CI installs it)")
    sentences = printed_sentences(monkeypatch)
    result = CliRunner().invoke(app, (COMMANDS | SLOW)[name], env={"COLUMNS": "80"})
    refused = name.startswith("error-")
    assert result.exit_code == (2 if refused else 0), result.output
    said = result.stderr if refused else result.stdout  # progress goes to stderr: times, not words
    assert not [line for line in said.splitlines() if len(line) > 80]
    text = masked(said)
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no snapshot {path.name}: run with MPSIMPACT_UPDATE_SNAPSHOTS=1 and review it"
    assert text == path.read_text(), f"{name}'s console changed: review, then update the snapshot"
    # issue 58: every sentence ends with its full stop, and no label is glued to a sentence of its own
    assert sentences or refused or name == "list"  # the console's own prints were read
    unended = [s for s in sentences if s[:1].isupper() and not s.rstrip().endswith(SENTENCE_ENDS)]
    assert not unended, unended
    assert not [s for s in sentences if GLUED.search(s)], [s for s in sentences if GLUED.search(s)]


@pytest.mark.parametrize("path", sorted(SNAPSHOTS.glob("*.txt")), ids=lambda p: p.stem)
def test_no_snapshot_prints_none_or_an_empty_list(path):
    text = path.read_text()
    assert not re.search(r"\bNone\b", text) and "[]" not in text and "[none]" not in text.lower()


@pytest.mark.parametrize("path", sorted(SNAPSHOTS.glob("*.txt")), ids=lambda p: p.stem)
def test_no_snapshot_writes_a_number_with_a_bare_g_or_m(path):
    # issue 58: "out 6.44G", "402.7M", "(0.11G parameters)": a count is said in words, a size with its unit (GiB)
    assert not re.findall(r"\d[GM]\b", path.read_text())


@pytest.mark.parametrize("path", sorted(SNAPSHOTS.glob("*.txt")), ids=lambda p: p.stem)
def test_no_snapshot_counts_a_calls_rows_as_batches(path):
    # issue 58: "wrong values from batch 16384 onward ... the largest safe chunk is 8191 batches" counted a bmm's
    # rows (text x head): a plain line counts texts (samples), the rows are for --verbose and the files
    text = " ".join(path.read_text().split())
    rows = re.findall(r"\bbmm batch\b|\b\d+ (?:bmm )?batches\b|from batch \d+ onward|batches a sample|"
                      r"\b\d+ (?:bmm |batch-head )?rows\b|first bad row", text)
    assert not rows


@pytest.mark.parametrize("path", sorted(SNAPSHOTS.glob("*.txt")), ids=lambda p: p.stem)
def test_no_snapshot_wraps_a_number_away_from_its_unit(path):
    # issue 58: "(396 s, about 198" / "s left)", "(a 16" / "GB Mac", "SIGSEGV (signal" / "11)"
    lines = path.read_text().splitlines()
    split = [(line, after) for line, after in zip(lines, lines[1:])
             if (re.search(r"\d$", line) and re.match(r"\s*(?:GiB|GB|MiB|MB|s|min|bits|billion|million)\b", after))
             or (line.endswith("(signal") and re.match(r"\s*\d", after))]
    assert not split


def internal_terms() -> list[str]:
    """The terms docs/glossary.md keeps for --verbose and the files (its "Never in a console line" list)."""
    glossary = (Path(__file__).parents[1] / "docs" / "glossary.md").read_text()
    kept = glossary.split("Never in a console line without `--verbose`:")[1].split("\n\n")[0]
    return re.findall(r"`([^`]+)`", kept)


@pytest.mark.parametrize("path", sorted(SNAPSHOTS.glob("*.txt")), ids=lambda p: p.stem)
def test_no_snapshot_uses_a_term_the_glossary_keeps_for_verbose(path):
    terms = internal_terms()
    assert "stopped_by_guard" in terms and "scale of the attention scores" in terms  # the list was read
    text = " ".join(path.read_text().split())
    assert not [term for term in terms if term in text]


def test_the_readme_quotes_the_quickstarts_console_as_it_reads():
    # The README's block under "Which torch release a result is about" is the run's first lines, word for word
    # (its own line breaks aside): the snapshot holds what the command prints.
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    quoted = readme.split("With the\nQuickstart's torch 2.13.0 on Linux:\n\n```\n")[1].split("```")[0]
    console = (SNAPSHOTS / "run-quick.txt").read_text()
    assert " ".join(quoted.split()) in " ".join(console.split())
    assert len(quoted.split()) > 40  # the whole headline and both release lines
