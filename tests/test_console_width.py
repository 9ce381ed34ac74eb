"""Every console table of run, plan and check read at 80 columns piped into a log (a default Mac terminal):
no line longer than 80, no cell cut to "…", no identifier broken across lines, the talk's sentence
(silent or not) first, internals only with --verbose. Small geometries (--quick, meta tracing)."""

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app

runner = CliRunner()
NARROW = {"COLUMNS": "80"}
QUICK_214 = ["run", "sentiment", "--quick", "--torch-profile", "2.14.0"]
QUICK_213 = ["run", "sentiment", "--quick", "--torch-profile", "2.13.0"]  # the scale on the scores aborts
PLAN = ["plan", "sentiment", "--batch-size", "4096"]
CHECK = ["check", str(Path(__file__).parent / "data" / "bert-base" / "config.json"), "--batch-size", "2048", "--torch-profile", "2.13.0"]
# Names a table used to fold mid-word ("encoder.e|ncoder.la|yer"), and internals kept for --verbose.
IDENTIFIERS = ("stopped_by_guard", "encoder.encoder.layer.*.attention.self",
               "encoder.encoder.layer.*.intermediate.intermediate_act_fn",
               "bert.encoder.layer.*.intermediate.intermediate_act_fn", "4096x12x512x512", "49152x512x512")
BOX = re.compile(r"[│┃┏┓┗┛┡┩└┘┌┐├┤┬┴┼╇╈╋━─┳┻]")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short --out paths: a temp folder's path alone passes 80 columns


def invoke(args, tmp_path=None, env=NARROW):
    out = [] if tmp_path is None else ["--out", str((tmp_path / "out").relative_to(Path.cwd()))]
    result = runner.invoke(app, [*args, *out], env=env)
    assert result.exit_code == 0, result.output
    return result.stdout  # the progress lines go to stderr


def tokens(text: str) -> set[str]:
    return {word.strip("()[],;:'`.") for word in BOX.sub(" ", text).split()}


def flat(text: str) -> str:
    """The text with its line breaks and table borders as single spaces (a wrapped sentence whole)."""
    return " ".join(BOX.sub(" ", text).split())


def assert_fits(text: str, width: int = 80) -> None:
    # a word of 50 characters or more (a temporary folder's path) is never broken: its line may be longer
    long = [line for line in text.splitlines() if len(line) > width and max(map(len, line.split())) < 50]
    assert not long, "\n".join(long)
    assert "…" not in text
    words = tokens(text)
    for name in IDENTIFIERS:
        # A piece of a name that ends mid-identifier ("encoder.e", "stopped_by") is a name broken in two.
        broken = {name[:k] for k in range(4, len(name)) if re.search(r"[._*x]", name[:k])} & words
        assert not broken, (name, broken)


@pytest.mark.parametrize("args", [QUICK_214, QUICK_213, pytest.param(["run", "retrieval", "--quick"], marks=pytest.mark.ci)],
                         ids=["silent", "abort", "retrieval"])
def test_a_quick_run_fits_80_columns_and_says_whether_it_was_silent(args, tmp_path):
    text = invoke(args, tmp_path)
    assert_fits(text)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    first = text.splitlines()[0]
    assert first.startswith("EMULATED MPS. Not silent:" if args is QUICK_213 else "EMULATED MPS. Silent:"), first
    if args is QUICK_214:
        assert ("Silent: 6 of 16 outputs came back wrong, no error, no warning, no NaN; 3 predictions changed "
                "class") in flat(text)
    if args is QUICK_213:  # which op, and that the process would die
        assert ("Not silent: the process would die at the scaling of the attention scores: torch 2.13.0 aborts "
                "there") in flat(text)
        # and that no size is silent there: the scale on the scores aborts wherever P V would wrap
        assert ("no batch of up to 16,777,216 texts at 256 tokens or any power-of-two length from 16 to 512 at the "
                "23-bit index shows the silent effect on torch 2.13.0") in " ".join(text.split())
        assert "16x12x256x256" not in text  # shapes are for --verbose and the files
    assert "stopped_by_guard" not in text and "rule int32-kernel" not in text and "rule input-wrap" not in text
    assert re.search(r"^\[\d\] guard raise: stopped ", text, re.M)  # a footnote, not a cell, in words
    assert "- (None)" not in text
    assert any(c["status"] == "stopped_by_guard" for c in report["conditions"])  # the JSON keeps its words
    # The reports' headline is the console's plain sentence; the condition's own line keeps the rule's name.
    md = (tmp_path / "out" / "report.md").read_text()
    html = (tmp_path / "out" / "report.html").read_text()
    headline_line = md.splitlines()[2]
    assert headline_line.startswith(f"**{first.rstrip()}") and "rule " not in headline_line
    assert 'class="headline"' in html and "rule int32-kernel" not in html.split('class="headline"')[1].split("</p>")[0]
    if args is QUICK_213:
        assert "rule int32-kernel" in md  # in the guard-off line under the table


def test_verbose_shows_every_message_in_full(tmp_path):
    text = invoke([*QUICK_213, "--verbose"], tmp_path)
    assert_fits(text)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    for condition in report["conditions"]:
        if condition.get("message"):
            assert f"{condition['status']}: {' '.join(condition['message'].split())}" in flat(text)


def test_plan_with_versions_fits_80_columns_in_words(tmp_path):
    text = invoke([*PLAN, "--versions"], tmp_path)
    assert_fits(text)
    lines = flat(text)
    assert "128 operations, 50 of them matrix products" in lines and "bmm/mm/SDPA" not in lines
    assert "kills the process at the scaling of the attention scores instead" in lines and "mul: 4096" not in lines
    assert "bmm: 49152x512x512 @ 49152x512x32" in lines
    assert "encoder.encoder.layer.*.attention.self" in tokens(text)
    assert "wrong from text 1365" in lines and "abort" in lines and "unmeasured [" not in lines
    newer = text.split("unmeasured newer")[1].split("└")[0]  # the row of the releases nobody measured
    assert "cannot" in newer and "abort" not in newer and "inferred" not in newer  # no outcome stands there
    assert "wrong_other" not in text and "int32-kernel" not in text and "(unmeasured:" not in text
    # every release's long sentence is a footnote, said once: the abort at the scale (2.13.0), and for the newer
    # releases nobody measured, "cannot tell" before what the worst measured release would do
    assert lines.count("[4] process abort: SIGSEGV (signal 11): the process dies with no error message (at mul(") == 1
    assert "cannot tell: nobody measured these releases on MPS (`mpsimpact sweep` on a Mac measures one)" in lines
    assert re.search(r"^\[\d+\] 2731 texts wrong from text 1365 \(logits\); 30 gradient", text, re.M)
    verbose = invoke([*PLAN, "--versions", "--verbose"], tmp_path / "verbose")
    assert_fits(verbose)
    assert "rule int32-kernel, inferred)" in flat(verbose) and "kind (rule)" in flat(verbose)


def test_plan_sweep_and_backward_fit_80_columns():
    assert_fits(invoke([*PLAN, "--sweep"]))
    assert_fits(invoke([*PLAN, "--backward"]))


def test_check_fits_80_columns_and_counts_every_op():
    text = invoke(CHECK)
    assert_fits(text)
    lines = flat(text)
    assert "166 operations, 86 of them matrix products" in lines
    assert "gelu on 2048x512x3072" in lines and "cannot tell (judged wrong)" in lines
    assert "rule unmeasured" not in lines and "wrong_other" not in lines


def test_wide_terminals_get_columns_not_blocks():
    text = invoke(CHECK, env={"COLUMNS": "200"})
    assert re.search(r"│ 16 \.\. 159 \(12 calls\) +│ bert\.encoder\.layer\.\*\.intermediate\.intermediate_act_fn", text)
    assert_fits(text, 200)


def test_the_talks_command_as_typed_shows_the_silent_bug_and_names_both_releases(tmp_path, monkeypatch):
    # No --torch-profile, no Apple GPU: the published demo's release (2.14.0) is judged whatever torch is
    # installed, and the report's first lines say so, and what the installed release would do on a Mac.
    import torch

    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    text = invoke(["run", "sentiment", "--quick"], tmp_path)
    assert_fits(text)
    lines = flat(text)
    assert lines.startswith("EMULATED MPS. Silent: 6 of 16 outputs came back wrong, no error, no warning, no NaN")
    assert ("Judged as torch 2.14.0, a release measured on Macs where the bug is silent: there is no Apple GPU "
            "here to run the installed torch 2.13.0 on.") in lines
    # --quick's 23-bit index stands for a batch 2^9 times larger: said wherever a Mac's outcome is told
    assert ("On a Mac, at the size this 23-bit run stands for, the installed torch 2.13.0 kills the process at the "
            "scaling of the attention scores instead (--torch-profile 2.13.0 shows it).") in lines
    assert "with texts of 64 tokens standing for 256, at a 23-bit index" in lines and "full-scale" not in lines
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["release"]["judged"] == "2.14.0" and report["release"]["installed"] == "2.13.0"
    assert report["geometry"]["profile"] == "2.14.0" and report["config"]["torch_profile"] is None
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Judged as torch 2.14.0" in md and "--torch-profile 2.13.0 shows it" in md
    assert ("## On every torch release (predicted from shapes at batch 16 x 256, at an emulated 23-bit index (MPS's "
            "is 32): what a batch 2^9 times larger meets on a Mac)") in md and "full-scale" not in md


@pytest.mark.parametrize("installed", ["2.14.0", "2.15.0"])
def test_plan_names_the_release_and_what_the_installed_one_would_do(installed, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", installed)
    text = invoke(PLAN)
    assert_fits(text)
    lines = flat(text)
    assert "decided for MPS" not in lines and "Judged as torch 2.14.0" in lines  # one phrase for the release
    if installed == "2.14.0":
        assert "On a Mac" not in lines  # the installed release is the one judged
    else:  # nobody measured 2.15.0: never a crash or a count said of it
        assert ("On a Mac with the installed torch: nobody measured torch 2.15.0 on MPS at the attention scores "
                "(queries times keys)") in lines and "`mpsimpact sweep` on a Mac measures it" in lines


def test_doctor_list_compare_and_matrix_fit_80_columns(tmp_path):
    assert_fits(invoke(["doctor"]))
    assert_fits(invoke(["list"]))
    for release in ("2.13.0", "2.14.0", "2.15.0"):
        invoke(["run", "sentiment", "--quick", "--torch-profile", release], tmp_path / release)
    for old, new in (("2.13.0", "2.14.0"), ("2.14.0", "2.15.0")):
        result = runner.invoke(app, ["compare", str(tmp_path / old / "out"), str(tmp_path / new / "out")], env=NARROW)
        assert result.exit_code in (1, 3), result.output
        assert_fits(result.stdout)
        assert "not_emulated" not in result.stdout and "cannot tell: cannot tell" not in flat(result.stdout)
        if old == "2.13.0":
            assert "abort -> completed" in flat(result.stdout) and "dies (the process aborts)" in flat(result.stdout)


# Two of the six in the default selection (the published release on the smallest Mac, the unmeasured one asked by
# name); the other four, 1.7 CPU-s each, run in CI's `pytest -m ci`.
@pytest.mark.parametrize(("release", "memory", "named"), [
    pytest.param(release, memory, named, id=f"{release}-{memory}-{'named' if named else 'installed'}",
                 marks=() if (release, memory) in (("2.14.0", "16GB"), ("2.15.0", "32GB")) else pytest.mark.ci)
    for release in ("2.13.0", "2.14.0", "2.15.0") for memory, named in (("16GB", False), ("32GB", True))])
def test_plan_memory_answers_in_words_for_every_release(release, memory, named, monkeypatch):
    # The release a newcomer is likely to have installed, or the same asked by name (each memory one way).
    import torch

    monkeypatch.setattr(torch, "__version__", release)
    text = invoke(["plan", "sentiment", "--memory", memory, *(["--torch-profile", release] if named else [])])
    assert_fits(text)
    lines = flat(text)
    # eager's clear demo from 1438 texts; blocked_eager's (a Mac whose memory binds) from 1398; the command
    # alone on its lines, broken only before an option with a shell continuation
    demo = (r"mpsimpact run sentiment --batch-size (1438 --max-length 512 --dtype float16|"
            r"1398 --max-length 512( --dtype float16)? \\ --attention blocked_eager)")
    if memory == "16GB":  # no tensor past 2**32 numbers fits its 8 GiB buffer: said, and what instead
        assert "No run can show the silent fault on a 16 GB Mac" in lines and "Run:" not in lines
        assert re.search(f"The smallest Mac that can show it has 18 GB .*; there, run: {demo}", lines), lines[-600:]
        assert "On any machine, emulated on its CPU" in lines
    else:
        assert re.search(f"Run: {demo}", lines), lines[-600:]
    if named and release == "2.15.0":  # nobody measured it: said, never a count of it
        assert "Cannot tell on torch 2.15.0: nobody measured it on MPS" in lines
        assert "On torch 2.14.0, a release measured on Macs where the bug is silent:" in lines
