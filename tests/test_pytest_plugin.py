"""The pytest plugin (issue 50): someone else's small suite, run as a Mac would run it. Its tests call bmm,
matmul, SDPA and a tiny transformers model and compare each batch with per-sample results, as a project's own
tests do (tests/data/their_suite, also the README's example); at a 12-bit index width (LIMIT 4096) their batches cross the scaled limits the way full-size runs cross
MPS's. pytester runs the suite in this process (one run in worker processes: xdist)."""

import json
import textwrap

import pytest

from plugin_runs import CROSSING, NARROW, SUITE, import_what_runs_import, outcomes

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module", autouse=True)
def _imported_once():
    import_what_runs_import()


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(test_theirs=SUITE)
    return pytester


def run(suite, *args):
    return suite.inline_run("-q", *args)


def test_without_options_the_plugin_changes_nothing(suite):
    result = run(suite, "-p", "no:cacheprovider")
    assert set(outcomes(result).values()) == {"passed"} and len(outcomes(result)) == 6


def test_emulated_at_12_bits_the_crossing_tests_fail_and_the_summary_names_each_call_site(suite):
    result = suite.runpytest_inprocess("--mps-emulate", *NARROW, "--mps-json", "calls.json")
    got = outcomes(result.reprec)
    assert {name for name, outcome in got.items() if outcome == "failed"} == CROSSING
    assert got["test_small_matmul_is_untouched"] == got["test_marked_out_is_left_alone"] == "passed"
    text = result.stdout.str()
    assert "calls that would fault on MPS (torch 2.14.0)" in text and "EMULATED MPS" in text
    assert "Mismatched elements" in text  # values that differ, as the suite's own comparison says
    calls = json.loads((suite.path / "calls.json").read_text())["calls"]
    sites = {c["site"].split(":")[0] for c in calls}
    assert "test_theirs.py" in sites  # bmm, matmul, SDPA asked for in the suite itself
    assert any("modeling_bert.py" in s for s in sites)  # the model's own P V line
    assert {t.split("::")[-1] for c in calls for t in c["tests"]} == CROSSING
    bmm = next(c for c in calls if c["tests"] == ["test_theirs.py::test_bmm_matches_per_sample"])
    # a (8, 16, 64) contiguous past 2**12 wraps: batches from ceil(4096 / 1024) = 4 read the start again
    assert (bmm["kind"], bmm["rule"], bmm["first_bad_batch"]) == ("wrong_tail", "input-wrap", 4)


def test_with_the_chunk_guard_they_pass_and_with_raise_they_fail_naming_the_op(suite):
    chunked = suite.runpytest_inprocess("--mps-emulate", "--mps-guard", "chunk", *NARROW)
    assert set(outcomes(chunked.reprec).values()) == {"passed"}
    assert "guard chunk: split into safe pieces, correct" in chunked.stdout.str()
    raised = suite.runpytest_inprocess("--mps-guard", "raise", *NARROW)  # no emulator: the CPU tensors judged
    got = outcomes(raised.reprec)
    assert {name for name, outcome in got.items() if outcome == "failed"} == CROSSING
    assert "OversizedOpError: mpsimpact guard: bmm[8, 16, 64] @ [8, 64, 4]" in raised.stdout.str()
    warned = suite.runpytest_inprocess("--mps-guard", "warn", *NARROW)  # never fails a test
    assert set(outcomes(warned.reprec).values()) == {"passed"}
    assert "guard warn: only warned; ran unchanged here (not emulated)" in warned.stdout.str()


def test_the_junit_xml_carries_each_tests_call_sites(suite):
    suite.runpytest_inprocess("--mps-emulate", *NARROW, "--junitxml", "junit.xml")
    xml = (suite.path / "junit.xml").read_text()
    assert xml.count('<property name="mpsimpact"') >= len(CROSSING) and "input-wrap" in xml


@pytest.mark.ci  # fresh processes: CI runs it after the default selection (pytest -m ci)
def test_xdist_workers_each_get_the_plugin_and_the_summary_collects_them(suite):
    # Without the BERT test (each worker would import transformers): five tests over two workers.
    result = suite.runpytest_subprocess("-n", "2", "-k", "not bert", "--mps-emulate", *NARROW, "--mps-json",
                                        "calls.json")
    result.assert_outcomes(passed=2, failed=3)
    calls = json.loads((suite.path / "calls.json").read_text())["calls"]
    assert {t.split("::")[-1] for c in calls for t in c["tests"]} == CROSSING - {"test_tiny_bert_batch_matches_each_sample"}
    assert "calls that would fault on MPS" in result.stdout.str()


def test_bad_options_are_one_line(suite):
    result = suite.runpytest_inprocess("--mps-index-bits", "40")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and "--mps-index-bits must be a whole number in 4..32" in result.stderr.str()
    result = suite.runpytest_inprocess("--mps-emulate", "--mps-profile", "banana")
    assert result.ret != 0 and "--mps-profile" in result.stderr.str() + result.stdout.str()


def test_the_fixture_does_inside_a_test_what_the_marker_does_for_one(pytester):
    pytester.makepyfile(test_fixture=textwrap.dedent('''
        import pytest
        import torch
        from mpsimpact.errors import OversizedOpError


        def test_inside(mpsimpact_as_a_mac):
            a, b = torch.randn(8, 16, 64), torch.randn(8, 64, 4)
            torch.bmm(a, b)  # outside the block: torch's own
            with mpsimpact_as_a_mac("raise"), pytest.raises(OversizedOpError, match="input-wrap"):
                torch.bmm(a, b)
            with mpsimpact_as_a_mac("chunk"):
                torch.testing.assert_close(torch.bmm(a, b), torch.cat([a[i:i + 1] @ b[i:i + 1] for i in range(8)]))
    '''))
    result = pytester.runpytest_inprocess("--mps-index-bits", "12", "--mps-profile", "2.14.0", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "guard raise: stopped before it ran" in result.stdout.str() and "guard chunk: split" in result.stdout.str()


def test_strict_sees_a_call_the_entry_points_do_not(pytester):
    # A name bound when the suite is imported, before any guard: the wrappers never stand there (without
    # --mps-strict the test passes), the dispatch mode of --mps-strict sees the bmm all the same.
    pytester.makepyfile(test_bound=textwrap.dedent('''
        import torch
        from torch import bmm


        def test_bound_bmm():
            assert bmm(torch.randn(8, 16, 64), torch.randn(8, 64, 4)).shape == (8, 16, 4)
    '''))
    strict = pytester.runpytest_inprocess("--mps-guard", "raise", "--mps-strict", *NARROW)
    strict.assert_outcomes(failed=1)
    assert "guard raise (strict)" in strict.stdout.str() and "OversizedOpError" in strict.stdout.str()
    alone = pytester.runpytest_inprocess("--mps-strict", "-p", "no:cacheprovider")
    assert alone.ret == pytest.ExitCode.USAGE_ERROR and "--mps-strict applies to the guard" in alone.stderr.str()
