"""The pytest plugin, part two (issue 56): a team's own suite, trusted. Whose frame is whose by the packages'
folders (a clone named `mpsimpact`); fixtures judged like the test; torch.compile and torch.export under the
emulator; what the summary says at each site, matching each test's outcome; the emulator outside the guard for
the fixture's blocks too; a failed test's own section; usage errors before any test runs."""

import json
import os
import textwrap

import pytest
import torch

import mpsimpact
from mpsimpact.modes.call_site import TORCH_AND_OURS, is_in_packages
from plugin_runs import CROSSING, NARROW, SUITE, import_what_runs_import, outcomes, plugin_lines

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module", autouse=True)
def _imported_once():
    import_what_runs_import()
    torch._dynamo.reset()  # torch.compile's modules, imported once (a run's imports are dropped after it)
    torch.compile(lambda x: x + 1, backend="aot_eager", fullgraph=True)(torch.ones(1))
    torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))


def stderr_lines(result) -> list[str]:
    return [line for line in result.stderr.lines if line.strip()]


def failed(recorder, when: str = "call") -> set[str]:
    return {name for name, outcome in outcomes(recorder, when).items() if outcome == "failed"}


# --- whose frame is whose ---------------------------------------------------------------------------------------

def test_a_frame_is_the_packages_by_its_folder_never_by_a_word_in_its_path(tmp_path):
    clone = tmp_path / "mpsimpact" / "torch" / "tests" / "test_theirs.py"  # a clone, a venv, named so
    assert not is_in_packages(str(clone), TORCH_AND_OURS)
    assert is_in_packages(mpsimpact.__file__, TORCH_AND_OURS) and is_in_packages(torch.__file__, TORCH_AND_OURS)
    assert not is_in_packages(__file__, TORCH_AND_OURS)  # this project's tests are not the package either
    assert not is_in_packages("<string>", TORCH_AND_OURS)


def test_in_a_clone_named_mpsimpact_each_call_site_is_named_separately(pytester):
    pytester.mkdir("mpsimpact")
    (pytester.path / "mpsimpact" / "test_theirs.py").write_text(SUITE)
    result = pytester.runpytest_inprocess("mpsimpact", "--mps-emulate", *NARROW, "--mps-json", "calls.json")
    assert failed(result.reprec) == CROSSING
    calls = json.loads((pytester.path / "calls.json").read_text())["calls"]
    sites = {c["site"] for c in calls}
    theirs = {s for s in sites if s.startswith(os.path.join("mpsimpact", "test_theirs.py:"))}
    assert len(theirs) >= 3  # bmm, matmul and SDPA's math path, each at its own line
    assert [s for s in sites if s.startswith("transformers") and "modeling_bert.py:" in s]  # BERT's P V
    assert sites == theirs | {s for s in sites if "modeling_bert.py:" in s}  # no "?", nothing of torch's


# --- fixtures are judged like the test ---------------------------------------------------------------------------

FIXTURES = textwrap.dedent('''
    import pytest
    import torch


    @pytest.fixture(scope="module")
    def big():
        torch.manual_seed(0)
        a, b = torch.randn(8, 16, 64), torch.randn(8, 64, 4)
        return torch.bmm(a, b), torch.cat([a[i:i + 1] @ b[i:i + 1] for i in range(8)])


    @pytest.fixture
    def cleaned_up():
        yield
        torch.bmm(torch.randn(8, 16, 64), torch.randn(8, 64, 4))  # in teardown


    def test_whole_batch(big):
        torch.testing.assert_close(*big)


    def test_again(big):
        torch.testing.assert_close(*big)


    def test_teardown(cleaned_up):
        pass
''')


def test_a_module_scoped_fixtures_work_fails_under_raise_and_under_the_emulator(pytester):
    pytester.makepyfile(test_fixtures=FIXTURES)
    raised = pytester.runpytest_inprocess("--mps-guard", "raise", *NARROW)
    assert failed(raised.reprec, "setup") == {"test_whole_batch", "test_again"}  # the fixture's error, each test
    assert failed(raised.reprec, "teardown") == {"test_teardown"}
    assert "fixture big (module scope)" in raised.stdout.str()
    emulated = pytester.runpytest_inprocess("--mps-emulate", *NARROW)
    assert failed(emulated.reprec) == {"test_whole_batch", "test_again"}  # MPS's wrong values, set up once
    assert "emulated: MPS's wrong values returned" in emulated.stdout.str()
    plain = pytester.runpytest_inprocess(*NARROW)
    plain.assert_outcomes(passed=3)


# --- torch.compile and torch.export under the emulator -----------------------------------------------------------

COMPILED = textwrap.dedent('''
    import pytest
    import torch
    import torch.nn.functional as F


    def f(a, b):
        return (torch.bmm(a, b) * 2).relu() + (a @ b).mean()


    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, q):
            q = q @ self.w
            return F.scaled_dot_product_attention(q, q, q)


    @pytest.mark.parametrize("backend", ["eager", "aot_eager"])
    def test_compiled_gives_plain_values(backend):
        a, b = torch.randn(2, 4, 4), torch.randn(2, 4, 4)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(f, backend=backend, fullgraph=True)(a, b), f(a, b))


    def test_export_records_torchs_own_ops():
        module, q = Attention(), torch.randn(2, 2, 8, 4)
        ops = [str(n.target) for n in torch.export.export(module, (q,)).graph.nodes if n.op == "call_function"]
        assert ops == ["aten.matmul.default", "aten.scaled_dot_product_attention.default"]
        torch.testing.assert_close(torch.export.export(module, (q,)).module()(q), module(q))


    @pytest.mark.parametrize("backend", ["eager", "aot_eager"])
    def test_compiled_crossing_bmm_is_emulated_as_eager(backend):
        a, b = torch.randn(8, 16, 64), torch.randn(8, 64, 4)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(f, backend=backend, fullgraph=True)(a, b), f(a, b))


    def test_compiled_crossing_sdpa_says_why_it_is_not_emulated():
        q = torch.randn(4, 2, 32, 4, requires_grad=True)
        torch._dynamo.reset()
        torch.compile(lambda x: F.scaled_dot_product_attention(x, x, x), backend="eager", fullgraph=True)(q)
''')


def test_torch_compile_and_export_are_good_guests_of_the_emulator(pytester):
    pytester.makepyfile(test_compiled=COMPILED)
    wide = pytester.runpytest_inprocess("--mps-emulate", "-k", "plain or export", "-p", "no:cacheprovider")
    wide.assert_outcomes(passed=3)  # nothing crosses a limit: plain's values, plain's graph
    narrow = pytester.runpytest_inprocess("--mps-emulate", "-k", "crossing", *NARROW)
    # compiled code runs under the emulator: its bmm comes back as MPS's, as it does eagerly (the same values)
    assert outcomes(narrow.reprec)["test_compiled_crossing_bmm_is_emulated_as_eager[eager]"] == "passed"
    assert outcomes(narrow.reprec)["test_compiled_crossing_bmm_is_emulated_as_eager[aot_eager]"] == "passed"
    assert outcomes(narrow.reprec)["test_compiled_crossing_sdpa_says_why_it_is_not_emulated"] == "failed"
    text = narrow.stdout.str()
    assert "past SDPA's Python entry point" in text and "non-infra" not in text  # our line, not torch's


# --- what the summary says, each matching the test's outcome ------------------------------------------------------

WORDS = textwrap.dedent('''
    import pytest
    import torch
    import torch.nn.functional as F


    def test_wraps():
        torch.manual_seed(0)
        a, b = torch.randn(8, 16, 64), torch.randn(8, 64, 4)  # a: 8192 > 4096 elements: wraps from batch 4
        torch.testing.assert_close(torch.bmm(a, b), torch.cat([a[i:i + 1] @ b[i:i + 1] for i in range(8)]))


    def test_view_past_int_max():
        a, b = torch.randn(1, 64, 64), torch.randn(1, 64, 1)  # a transposed view of 4096 >= 2048 elements
        torch.bmm(a.transpose(1, 2), b)


    def test_fused_sdpa():
        q = torch.randn(4, 2, 32, 4)  # scores 8192 > 4096: wrong on 2.12.1, its pattern never characterised
        with torch.no_grad():
            F.scaled_dot_product_attention(q, q, q)
''')
# (options, test, its outcome, the words at its site)
SAID = [
    (["--mps-emulate"], "test_wraps", "failed", "emulated: MPS's wrong values returned"),
    (["--mps-emulate"], "test_view_past_int_max", "failed", "emulated: MPS's error raised"),
    (["--mps-emulate", "--mps-profile", "2.12.1"], "test_fused_sdpa", "failed",
     "emulated: refused, values not characterised (judged conservatively)"),
    (["--mps-guard", "raise"], "test_wraps", "failed", "guard raise: stopped before it ran, the test fails"),
    (["--mps-guard", "chunk"], "test_wraps", "passed", "guard chunk: split into safe pieces, correct"),
    (["--mps-guard", "warn"], "test_wraps", "passed", "guard warn: only warned; ran unchanged here (not emulated)"),
    (["--mps-guard", "warn", "--mps-emulate"], "test_wraps", "failed",
     "guard warn: only warned; emulated: MPS's wrong values returned"),
]


@pytest.mark.parametrize(("options", "test", "outcome", "words"), SAID, ids=[f"{s[1]}-{s[3][:20]}" for s in SAID])
def test_the_summary_says_what_happened_at_the_site(pytester, options, test, outcome, words):
    pytester.makepyfile(test_words=WORDS)
    result = pytester.runpytest_inprocess(*NARROW, *options, "-k", test, "--mps-json", "calls.json")
    assert outcomes(result.reprec) == {test: outcome}
    calls = json.loads((pytester.path / "calls.json").read_text())["calls"]
    assert len(calls) == 1 and "; ".join(calls[0]["actions"]) == words and calls[0]["tests"] == [f"test_words.py::{test}"]
    assert words in " ".join(result.stdout.str().split())  # wrapped or not


def test_an_aborting_call_is_said_to_abort():
    from mpsimpact.modes.emulator import emulate

    said = []
    with pytest.raises(mpsimpact.EmulatedMpsError), emulate(index_bits=12, profile="2.14.0") as emulator:
        emulator.listeners.append(lambda record, outcome: said.append((record.fault.kind, outcome)))
        torch.mm(torch.randn(64, 8), torch.randn(8, 64))  # a 2-D product's output of 4096 elements
    assert said == [("abort", "aborted")]


# --- the emulator outside the guard, for options, marks and the fixture alike -------------------------------------

BLOCKS = textwrap.dedent('''
    import torch


    def test_chunk_inside(mpsimpact_as_a_mac):
        torch.manual_seed(0)
        a, b = torch.randn(8, 16, 64), torch.randn(8, 64, 4)
        with mpsimpact_as_a_mac("chunk"):
            got = torch.bmm(a, b)
        with mpsimpact_as_a_mac("off"):  # the comparison outside the Mac's rules
            torch.testing.assert_close(got, torch.cat([a[i:i + 1] @ b[i:i + 1] for i in range(8)]))


    def test_emulate_inside_a_guard(mpsimpact_as_a_mac):
        torch.manual_seed(0)
        a, b = torch.randn(8, 16, 64), torch.randn(8, 64, 4)
        with mpsimpact_as_a_mac("emulate"):
            got = torch.bmm(a, b)
        with mpsimpact_as_a_mac("off"):
            assert not torch.allclose(got[4:], torch.bmm(a[4:], b[4:]))  # MPS's wrong tail
            torch.testing.assert_close(got[:4], torch.bmm(a[:4], b[:4]))
''')


@pytest.mark.parametrize("options", [["--mps-emulate", "--mps-guard", "chunk"], ["--mps-guard", "raise"],
                                     ["--mps-emulate"]], ids=["emulate-chunk", "raise", "emulate"])
def test_the_fixtures_blocks_run_as_asked_inside_any_options(pytester, options):
    pytester.makepyfile(test_blocks=BLOCKS)
    result = pytester.runpytest_inprocess(*NARROW, *options)
    result.assert_outcomes(passed=2)
    assert "entered inside an active guard" not in result.stdout.str()


# --- a failed test's own report ------------------------------------------------------------------------------------

def test_a_failed_tests_report_says_what_mps_would_do_and_what_to_do_in_its_samples(pytester):
    pytester.makepyfile(test_theirs=SUITE)
    result = pytester.runpytest_inprocess("--mps-emulate", *NARROW, "-k", "matmul_matches")
    text = result.stdout.str()
    section = text.split("mpsimpact: calls that would fault on MPS -", 1)[1].split("\n= ", 1)[0]
    # (2, 4, 16, 64) @ (2, 4, 64, 4) folds into 8 bmm batches, 4 a sample: batch 4 is sample 1's first
    assert "emulated: MPS's wrong values returned" in section and "rule input-wrap" in section
    assert "12-bit index" in section and "torch 2.14.0" in section
    assert "from sample 1 of the first dimension onward (bmm batch 4, 4 batches a sample)" in " ".join(section.split())
    # A batch of 1 sample (4 batches of 1024 elements: P at most 2**12) runs it whole, as the wrong values from
    # sample 1 say; a piece of the guard's split, a slice, is held below 2**11: 1 batch of the 4.
    assert ("It runs correctly on a batch of at most 1 sample of the first dimension (4 bmm batches): lower the batch "
            "size to 1, or use guard mode 'chunk' (its pieces, slices of the batch, hold part of one (1 bmm batch))."
            ) in " ".join(section.split())


# --- what the plugin prints fits the terminal ---------------------------------------------------------------------

def test_the_plugins_lines_fit_80_columns_and_a_log_has_one_line_a_site(pytester, monkeypatch):
    pytester.makepyfile(test_theirs=SUITE)
    monkeypatch.setenv("COLUMNS", "80")
    narrow = pytester.runpytest_inprocess("--mps-emulate", "--mps-guard", "warn", "--mps-strict", *NARROW)
    ours = plugin_lines(narrow.outlines)
    assert len(ours) > 20 and [line for line in ours if len(line) > 80] == []
    monkeypatch.delenv("COLUMNS")
    log = pytester.runpytest_inprocess("--mps-emulate", *NARROW)  # not a terminal: one line a site
    summary = [line for line in plugin_lines(log.outlines) if line.strip() and not line.startswith("mpsimpact:")]
    sites = [line for line in summary if " reached by " in line]
    assert len(sites) == 5 and len(summary) == 5 + 5  # a line a site; and a line a site in each failed test's
    # section (the SDPA test reached two sites: its math path's two products)


# --- bad values: one line, exit 4, nothing created or replaced --------------------------------------------------

BAD_MARKS = ['"bogus"', '"raise", "chunk"', 'mode="raise", index_bits=40', '"raise", index_bits=3',
             '"chunk", index_bits="12"', '"raise", mode="chunk"', '"warn", bits=12']
BAD_BLOCKS = ['"bogus"', '"raise", "chunk"', 'index_bits=99', 'mode="chunk", foo=1']


@pytest.mark.parametrize("arguments", BAD_MARKS)
def test_a_bad_marker_is_a_usage_error_before_any_test_runs(pytester, arguments):
    pytester.makepyfile(test_marked=f"import pytest\n\n\n@pytest.mark.mpsimpact({arguments})\ndef test_x():\n"
                                    "    open('ran', 'w')\n")
    result = pytester.runpytest_inprocess("--mps-json", "calls.json", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert len(stderr_lines(result)) == 1 and "@pytest.mark.mpsimpact" in result.stderr.str()
    assert not (pytester.path / "ran").exists() and not (pytester.path / "calls.json").exists()


@pytest.mark.parametrize("arguments", BAD_BLOCKS)
def test_a_bad_fixture_argument_is_a_usage_error_before_any_test_runs(pytester, arguments):
    pytester.makepyfile(test_block=f"def test_x(mpsimpact_as_a_mac):\n    open('ran', 'w')\n"
                                   f"    with mpsimpact_as_a_mac({arguments}):\n        pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert len(stderr_lines(result)) == 1 and "mpsimpact_as_a_mac" in result.stderr.str()
    assert not (pytester.path / "ran").exists()


def test_a_computed_bad_fixture_argument_ends_the_run_as_a_usage_error(pytester):
    pytester.makepyfile(test_block="def test_x(mpsimpact_as_a_mac):\n    mode = 'bo' + 'gus'\n"
                                   "    with mpsimpact_as_a_mac(mode):\n        pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and "takes one of raise, warn" in result.stdout.str()


@pytest.mark.parametrize("where", ["missing/calls.json", "a folder", "a FIFO", "/dev/null", "a link"])
def test_a_bad_json_path_is_a_usage_error_that_creates_and_replaces_nothing(pytester, where):
    pytester.makepyfile(test_x="def test_x():\n    open('ran', 'w')\n")
    if where == "a folder":
        pytester.mkdir("a folder")
    elif where == "a FIFO":
        os.mkfifo(pytester.path / where)
    elif where == "a link":
        (pytester.path / "target.json").write_text("keep")
        os.symlink("target.json", pytester.path / where)
    before = sorted(p.name for p in pytester.path.iterdir())
    result = pytester.runpytest_inprocess("--mps-json", where, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert len(stderr_lines(result)) == 1 and "--mps-json" in result.stderr.str()
    assert sorted(p.name for p in pytester.path.iterdir()) == before  # nothing made, nothing replaced
    if where == "a FIFO":
        assert (pytester.path / where).is_fifo()
    if where == "a link":
        assert (pytester.path / where).is_symlink() and (pytester.path / "target.json").read_text() == "keep"


@pytest.mark.parametrize("bits", ["١٢", "1_2", "12.0", " 12", "0x0c", "40"])
def test_a_bad_index_width_is_one_line_before_any_test_runs(pytester, bits):
    pytester.makepyfile(test_x="def test_x():\n    open('ran', 'w')\n")
    result = pytester.runpytest_inprocess("--mps-index-bits", bits, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and len(stderr_lines(result)) == 1
    assert "--mps-index-bits" in result.stderr.str() and not (pytester.path / "ran").exists()


@pytest.mark.ci  # worker processes
def test_under_xdist_a_bad_marker_is_one_line_and_exit_4(pytester):
    pytester.makepyfile(test_marked="import pytest\n\n\n@pytest.mark.mpsimpact('bogus')\ndef test_x():\n"
                                    "    open('ran', 'w')\n")
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and "INTERNALERROR" not in result.stdout.str()
    assert stderr_lines(result) == [
        "ERROR: test_marked.py::test_x: @pytest.mark.mpsimpact(...) takes one of raise, warn, chunk, emulate, off; "
        "got 'bogus'."]
    assert not (pytester.path / "ran").exists()


def test_a_sighting_read_back_refuses_a_first_sample_its_rows_could_not_give():
    # What a worker sends is read by the class that wrote it: first_bad_sample is first_bad_batch // rows_per_sample
    # (4096 rows of 12 heads a sample: 4096 // 12 = 341), and anything else is damage, named by the field.
    from mpsimpact.output.record import Damaged
    from mpsimpact.pytest_plugin.sighting import Sighting

    seen = Sighting("suite.py:3", "bmm 49152x512x512 @ 49152x512x64", "wrong_values", "index-32", "2.14.0", 4096,
                    ["suite.py::test_a"], ["guard raise"], 12, 32, "MPS would return wrong values", 341)
    assert Sighting.from_json(seen.to_json()).to_json() == seen.to_json()
    for first in (342, None, 4096):
        with pytest.raises(Damaged, match=rf"^first_bad_sample is {first}, not first_bad_batch // rows_per_sample"):
            Sighting.from_json(seen.to_json() | {"first_bad_sample": first})
    clean = seen.to_json() | {"first_bad_batch": None, "first_bad_sample": None}
    assert Sighting.from_json(clean)["first_bad_sample"] is None
