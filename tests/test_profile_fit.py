"""profile.json: derived from a sweep's rows (here the rows the rules predict, so no tensor runs), read back
and validated, used wherever a release name is, and compared in plain words. The derived profile of every
measured release must reproduce the study's op-level table cell by cell (tests/test_release.py)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.engine.faults import TensorSpec, classify_bmm, classify_mm, classify_sdpa, sdpa_path
from mpsimpact.engine.profile_file import ProfileFileError
from mpsimpact.engine.release import (
    MEASURED_RELEASES, installed_profile, load_profile, parse_version, profile_for, profile_from_json, resolve_profile,
)
from mpsimpact.runs.family_cells import family_grid
from mpsimpact.runs.profile_fit import derive_profile
from mpsimpact.runs.cell import NOT_RUN, predicted_rows
from mpsimpact.runs.sweep import LAYOUTS, grid
from mpsimpact.upgrade.profile_change import describe_change
from test_release import BATCHES, CELLS, expected_kind, operands, transitions
from said import flat, one_message

runner = CliRunner()
GIB = 1 << 30


def derived(release, bits=32, quick=True, not_run=lambda cell: False, device="cpu", emulated=True,
            families=False):
    """profile.json's content for the sweep whose cells all come out as `release`'s rules say; cells for
    which `not_run` holds were not run (over --max-memory); with `families`, its family cells too."""
    cells = grid(bits, ("fp32", "fp16", "bf16"), LAYOUTS, quick)
    rows = predicted_rows(cells, bits, release)
    family_cells = family_grid(bits) if families else []
    family_rows = predicted_rows(family_cells, bits, release)
    for row, cell in zip(rows + family_rows, cells + family_cells):
        if not_run(cell):
            row.update(observed=NOT_RUN, first_bad_batch=None, message="not run", agree=None)
    return derive_profile(rows, device=device, emulated=emulated, emulated_release=release,
                          torch_version="2.13.0+cpu", machine="Linux x86_64", index_bits=bits,
                          family_rows=family_rows)


def written(tmp_path, content, name="profile.json"):
    path = tmp_path / name
    path.write_text(json.dumps(content))
    return path


@pytest.mark.parametrize("release", MEASURED_RELEASES)
def test_a_derived_profile_reproduces_its_release_on_the_op_level_table(tmp_path, release):
    # Derived from the quick grid at the real index width; every cell of the study's table, as
    # test_release.py writes it by hand, and the error text each release prints.
    content = derived(release)
    assert content["cells"]["settings_agreeing"] == 1 and content["unmeasured"] == ["mm", "sdpa", "families"]
    profile = load_profile(written(tmp_path, content))
    assert (profile.release, profile.alternatives, profile.measured) == (release, (), False)
    for group, member, series, dtype, layout in (c for c in CELLS if c[1] == release):
        rows = transitions(series, dtype, layout, group)
        for batch in BATCHES:
            ops = operands(series, dtype, layout, batch)
            fault = classify_bmm(*ops, profile=profile)
            assert fault.kind == expected_kind(rows, batch), (series, dtype, layout, batch, fault)
            study = classify_bmm(*ops, profile=release)
            assert (fault.first_bad_batch, fault.message, fault.operand) == (
                study.first_bad_batch, study.message, study.operand)


# The study's first-pass table (docs/fault-model.md, "Op families past INT_MAX"), one column per measured
# release, as the tests it ran observed them, written here by hand: what the families' 1-D cells and the
# Linear show (A abort, E the INT_MAX error, W wrong, O ok, S 2.14.0's 64-bit sum error, M masked_fill's
# element-count error, R 2.13.0's sum of N mod 2**32).
FIRST_PASS = {  # 2.4.1 2.5.1 2.6.0 2.7.1 2.8.0 2.9.1 2.10.0 2.11.0 2.12.1 2.13.0 2.14.0
    "linear": "O O O O A A A A A A A",
    "elementwise-1d": "A A A A W E E E O O O",
    "reduction-1d": "A A A A A E E E E R S",
    "cat-1d": "A A A A A E E E O O O",
    "indexing-1d": "A A A A W E E E E E W",
    "masked_fill-1d": "A A A M M M M M M M M",
    "copy": "O O O O O O O O O O O",
}
CODE_WORDS = {"A": "abort", "E": "error", "W": "wrong", "O": "ok", "S": "sum-64-bit", "M": "masked-fill-numel",
              "R": "wrap"}
SLOTS = {"elementwise-1d": ("elementwise", 0), "reduction-1d": ("reduction", 0), "cat-1d": ("cat", 0),
         "indexing-1d": ("indexing", 0), "masked_fill-1d": ("masked_fill", 0), "copy": ("copy", 1)}


@pytest.mark.parametrize("release", MEASURED_RELEASES)
def test_a_derived_profile_reproduces_its_release_on_the_first_pass_table(release):
    # The family cells at 20 bits (N = 2**20 + 2**8, above LIMIT as the study's 2**32 + 2**20): the codes
    # they give are the study's column, the Linear decides mm, fused SDPA is wrong up to 2.12.1 (no MPS
    # SDPA op on 2.4.1: the math path), and every family the release holds comes back exactly.
    content = derived(release, bits=20, families=True)
    column = MEASURED_RELEASES.index(release)
    assert content["unmeasured"] == []
    families = content["rules"]["families"]
    for test, (family, dims) in SLOTS.items():
        assert families[family][dims] == CODE_WORDS[FIRST_PASS[test].split()[column]], (test, release)
    assert content["rules"]["mm"] == {"mm_aborts": FIRST_PASS["linear"].split()[column] == "A"}
    wrong = parse_version(release) <= (2, 12, 1)
    fused = release != "2.4.1"
    assert content["rules"]["sdpa"] == {"sdpa_fused": fused, "sdpa_fused_wrong": wrong and fused}
    # 2.13.0's scale and softmax on multi-dimensional scores past LIMIT: the inferred SIGSEGV of eager attention
    multi = "int32-kernel" if release == "2.13.0" else "ok"
    assert (families["elementwise"][1], families["softmax"][1]) == (multi, multi)
    profile, study = profile_from_json(content, "derived"), resolve_profile(release)
    assert profile.families == study.families
    assert (profile.mm_aborts, profile.sdpa_fused, profile.sdpa_fused_wrong) == (
        study.mm_aborts, study.sdpa_fused, study.sdpa_fused_wrong)


def test_family_cells_not_run_leave_their_rules_unmeasured():
    # The 2.14.0 sweep on a budget that runs no multi-dimensional cell and no Linear (a few MiB at 16 bits).
    content = derived("2.14.0", bits=16, families=True,
                      not_run=lambda cell: getattr(cell, "test", "") in ("linear", "scale", "softmax", "sdpa"))
    families = content["rules"]["families"]
    assert content["rules"]["mm"] is None and content["rules"]["sdpa"] is None
    assert (families["elementwise"], families["softmax"]) == (["ok", "unmeasured"], ["unmeasured", "unmeasured"])
    assert content["unmeasured"] == ["mm", "sdpa"] and content["cells"]["family_cells_not_run"] == 4
    assert any(note.startswith("Family cells not run (over --max-memory): linear (mm), scale (elementwise, "
                               "multi-dim)") for note in content["notes"])
    profile = profile_from_json(content, "derived")
    # The unmeasured multi-dimensional scale: judged "unmeasured" (the guard stops it), where 2.14.0 says ok.
    x = TensorSpec.contiguous((17, 16, 256))  # 69632 > 2**16 elements, no dimension past DIM_MAX
    from mpsimpact.engine.families import classify_op
    assert classify_op("mul", [x], x, index_bits=16, profile="2.14.0").is_ok
    fault = classify_op("mul", [x], x, index_bits=16, profile=profile)
    assert (fault.kind, fault.rule) == ("wrong_other", "unmeasured:elementwise")


@pytest.mark.parametrize("release", ["2.4.1", "2.5.1", "2.9.1", "2.13.0"])
def test_the_fit_does_not_depend_on_the_index_width_or_the_grid(release):
    # A 20-bit emulated sweep decides the same rules as a full-scale one, and so does the full grid.
    rules = derived(release)["rules"]["bmm"]
    assert derived(release, bits=20)["rules"]["bmm"] == rules == derived(release, quick=False)["rules"]["bmm"]


def test_a_derived_profile_keeps_the_table_texts_and_what_it_was_measured_on(tmp_path):
    content = derived("2.5.1", bits=20)
    row = next(r for r in content["table"] if (r["series"], r["layout"], r["dtype"]) ==
               ("256x256x64", "a_transposed", "fp32"))
    # 2**19 / 65536 = 8: abort from 8; 2**20 / 65536 = 16: error at 16, then a wrap (first bad 16);
    # 65 * 256 * 64 > 2**20 output elements: the transposed a is read as packed (rule 1)
    assert row["transitions"] == [{"batch": 8, "kind": "abort"}, {"batch": 16, "kind": "error"},
                                  {"batch": 17, "kind": "wrong_tail", "first_bad_batch": 16},
                                  {"batch": 65, "kind": "wrong_all"}]
    texts = {(t["kind"], t["text"]) for t in content["failure_texts"]}
    assert ("error", 'srcNDArray INTERNAL ASSERT FAILED at ".../OperationUtils.mm":480, please report a bug '
            "to PyTorch.") in texts
    assert any(kind == "abort" and "NDArray dimension length > INT_MAX" in text for kind, text in texts)
    profile = load_profile(written(tmp_path, content))
    assert profile.measured_on.startswith("torch 2.13.0+cpu, Linux x86_64, emulating 2.5.1 on cpu (no Mac)")
    assert profile.label == f"2.5.1 (from {tmp_path / 'profile.json'})" and profile.ref == profile.source


def test_what_the_sweep_did_not_measure_is_judged_as_the_conservative_profile_judges_it(tmp_path):
    profile = load_profile(written(tmp_path, derived("2.5.1")))
    # Linear with a (67125249, 64) input: right on 2.5.1 (measured), unmeasured here: as on 2.14.0.
    x, w = torch.empty(67125249, 64, device="meta"), torch.empty(64, 64, device="meta")
    assert classify_mm(x, w, profile="2.5.1").kind == "wrong_other"
    fault = classify_mm(x, w, profile=profile)
    assert (fault.kind, fault.rule, fault.inferred) == ("abort", "conservative:mm-encode", True)
    assert fault.release == "2.5.1, unmeasured: as on 2.14.0"
    unmeasured_release = classify_mm(x, w, profile="2.15.0")
    assert (fault.kind, fault.rule, fault.message) == (unmeasured_release.kind, unmeasured_release.rule,
                                                       unmeasured_release.message)
    q = torch.empty(5712, 12, 256, 64, device="meta")  # 4.49e9 score elements
    assert sdpa_path(False, profile) == "math" and not classify_sdpa(q, q, profile=profile).is_ok


def test_cells_not_run_decide_nothing_and_what_they_leave_open_is_judged_by_the_worst(tmp_path):
    # A 32 GB Mac lends about 21 GiB: the quick grid's P V cells (a contiguous input above 2**32) need more.
    content = derived("2.13.0", not_run=lambda cell: cell.bytes_needed() > 21 * GIB)
    assert content["cells"]["not_run"] > 0 and content["cells"]["settings_agreeing"] == 2
    assert {s["input_wrap"] for s in content["rules"]["bmm"]} == {True, False}
    profile = load_profile(written(tmp_path, content))
    # P V of the demo: (B*H, L, L) @ (B*H, L, d), contiguous, input above 2**32: the cells left it open.
    p, v = TensorSpec.contiguous((24576, 512, 512)), TensorSpec.contiguous((24576, 512, 64))
    fault = classify_bmm(p, v, profile=profile)
    assert (fault.kind, fault.rule, fault.first_bad_batch) == ("wrong_tail", "conservative:input-wrap", 16384)
    assert fault.inferred and "left this call open" in fault.release
    # A transposed operand with an output above 2**32: every setting agrees, so it is decided exactly.
    a, b = TensorSpec.contiguous((65537, 64, 256)).transpose(), TensorSpec.contiguous((65537, 64, 256))
    assert classify_bmm(a, b, profile=profile) == classify_bmm(a, b, profile="2.13.0")
    # The rows not run are listed apart, and leaving them out changes nothing in what was derived.
    table = {(r["series"], r["layout"], r["dtype"]): r for r in content["table"]}
    assert 65537 in table[("256x256x64", "contiguous", "fp32")]["unmeasured_batches"]


def test_no_setting_agreeing_leaves_bmm_conservative_and_names_the_cells():
    # One small contiguous cell observed wrong from batch 0: no setting of the rules predicts that.
    cells = grid(17, ("fp32",), LAYOUTS, True)
    rows = predicted_rows(cells, 17, "2.13.0")
    odd = next(row for row in rows if row["observed"] == "ok" and row["cell"]["layout"] == "contiguous")
    odd.update(observed="wrong_tail", first_bad_batch=0)
    content = derive_profile(rows, device="cpu", emulated=True, emulated_release="2.13.0",
                             torch_version="2.13.0", machine="m", index_bits=17)
    assert content["rules"]["bmm"] is None and content["unmeasured"] == ["bmm", "mm", "sdpa", "families"]
    assert any(line.endswith("observed wrong_tail") for line in content["cells"]["unexplained"])
    p, v = TensorSpec.contiguous((24576, 512, 512)), TensorSpec.contiguous((24576, 512, 64))  # P V
    fault = classify_bmm(p, v, profile=profile_from_json(content, "derived"))
    assert (fault.kind, fault.rule, fault.release) == ("wrong_tail", "conservative:input-wrap",
                                                       "2.13.0, unmeasured: as on 2.14.0")


def test_a_control_sweep_measures_nothing_of_mps():
    # The CPU without emulation computes every cell right; that is not a release that fixed everything.
    cells = grid(17, ("fp32",), LAYOUTS, True)
    rows = [row | {"observed": "ok", "first_bad_batch": None} for row in predicted_rows(cells, 17, "2.13.0")]
    content = derive_profile(rows, device="cpu", emulated=False, emulated_release="2.13.0",
                             torch_version="2.13.0", machine="m", index_bits=17)
    assert content["rules"]["bmm"] is None and "A control run on cpu" in content["notes"][1]


def test_a_profile_for_the_installed_torch_in_the_cache_is_used_and_said(tmp_path, monkeypatch):
    release = ".".join(map(str, parse_version(torch.__version__)))
    cache = tmp_path / "cache"
    (cache / "profiles").mkdir(parents=True)
    content = derived("2.5.1") | {"release": release}
    path = written(cache / "profiles", content, f"{release}.json")
    monkeypatch.setenv("MPSIMPACT_CACHE", str(cache))
    assert installed_profile().source == str(path) and resolve_profile(None).view_rule == "abort"
    result = runner.invoke(app, ["doctor"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"torch {release} (from {path})" in said and "used automatically" in said
    assert "emulating 2.5.1 on cpu (no Mac)" in said and "judged conservatively: mm, sdpa, families" in said
    path.write_text("{not json")
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 2 and flat(result.stderr).startswith(f"error: Cannot read the profile '{path}'")
    assert "Traceback" not in result.output


def test_without_a_cached_profile_doctor_says_where_one_would_go(tmp_path, monkeypatch):
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path))
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0 and "from the study's table" in " ".join(result.output.split())
    assert installed_profile().source == "study"


BAD_FILES = [  # (what is wrong, the content, the field the message names)
    ("a field's value", lambda c: c["rules"]["bmm"][0].update(view_rule="explode"),
     "'rules.bmm[0].view_rule'"),
    ("a field's type", lambda c: c["rules"]["bmm"][0].update(input_wrap="yes"), "'rules.bmm[0].input_wrap'"),
    ("the release", lambda c: c.update(release="latest"), "'release'"),
    ("the unmeasured list", lambda c: c.update(unmeasured=["mm"]), "'unmeasured'"),
    ("a family", lambda c: c["rules"].update(families={"teleport": ["ok", "ok"]}),
     "'rules.families.teleport'"),
    ("mm", lambda c: c["rules"].update(mm={"mm_aborts": "sometimes"}), "'rules.mm'"),
]


@pytest.mark.parametrize(("what", "spoil", "field"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_malformed_profile_is_one_error_naming_the_file_and_the_field(tmp_path, what, spoil, field):
    content = derived("2.13.0", bits=20)
    spoil(content)
    path = written(tmp_path, content)
    with pytest.raises(ProfileFileError) as error:
        load_profile(path)
    assert str(error.value).startswith(f"Profile '{path}': {field} must be ")
    assert (error.value.path, error.value.field) == (str(path), field.strip("'"))
    out = tmp_path / "plan"
    result = runner.invoke(app, ["plan", "sentiment", "--torch-profile", str(path), "--out", str(out)])
    assert result.exit_code == 2 and field in one_message(result.stderr)
    assert not out.exists()


def test_not_a_profile_a_newer_schema_and_a_missing_file_are_refused(tmp_path):
    cases = {
        "x.json": ({"kind": "something else"}, "is not an mpsimpact profile"),
        "new.json": (derived("2.13.0", bits=20) | {"schema_version": 9}, "newer than this mpsimpact reads"),
    }
    for name, (content, message) in cases.items():
        with pytest.raises(ProfileFileError, match=message):
            load_profile(written(tmp_path, content, name))
    with pytest.raises(ValueError, match="No such file"):
        resolve_profile(str(tmp_path / "gone" / "profile.json"))
    with pytest.raises(ValueError, match="not a torch release"):
        resolve_profile("2.x")


def test_guard_emulate_and_trace_faults_take_a_profile_file(tmp_path):
    from mpsimpact import emulate, guard, trace_faults
    from mpsimpact.errors import OversizedOpError

    path = str(written(tmp_path, derived("2.5.1", bits=20)))
    # 256x256x64 at 16 bits: a holds 2 * 65536 > 2**16 elements: batch 1 wraps onto batch 0.
    a, b = torch.randn(2, 256, 256), torch.randn(2, 256, 64)
    outs = {}
    for profile in ("2.5.1", path):
        with emulate(index_bits=16, profile=profile):
            outs[profile] = torch.bmm(a, b)
    assert torch.equal(outs["2.5.1"], outs[path]) and torch.allclose(outs[path][1], a[0] @ b[1])
    with pytest.raises(OversizedOpError), emulate(index_bits=16, profile=path), guard("raise", profile=path):
        torch.bmm(a, b)
    plan = trace_faults(lambda: torch.bmm(a, b), index_bits=16, profile=path)
    assert plan.profile.ref == path and plan.profile.source == path
    assert [c.fault.kind for c in plan.calls] == ["wrong_tail"]


def test_matrix_adds_a_column_for_the_profile_asked_for(tmp_path):
    from mpsimpact.upgrade.matrix import profile_columns

    path = written(tmp_path, derived("2.5.1", bits=20))
    columns = profile_columns(load_profile(path))  # a command's resolved profiles, not strings
    assert columns[-1] == {"profile": str(path), "group": "2.5.1 (file)"}
    assert profile_columns(profile_for("2.13.0")) == profile_columns() and len(columns) == len(profile_columns()) + 1


def test_compare_says_how_the_profile_changed_in_plain_words(tmp_path):
    old, new = (load_profile(written(tmp_path, derived(r, bits=20), f"{r}.json"))
                for r in ("2.8.0", "2.13.0"))
    text, changed = describe_change(old, new)
    assert changed and text.startswith("profile 2.8.0 -> 2.13.0: 2.13.0 no longer aborts the process on a "
                                       "transposed or sliced operand of 2^31 to 2^32 elements; now raises")
    assert "still wraps P V" in text and "still reads a transposed operand as packed" in text
    same, changed = describe_change(new, new)
    assert not changed and "no longer" not in same
    partial = load_profile(written(tmp_path, derived("2.13.0", not_run=lambda c: c.bytes_needed() > 21 * GIB),
                                   "partial.json"))
    text, changed = describe_change(new, partial)
    assert not changed
    assert "cannot tell (P V (a contiguous input above 2^32 elements): the new sweep left it" in text


def test_compare_says_how_the_families_linear_and_sdpa_changed_in_plain_words(tmp_path):
    old, new = (load_profile(written(tmp_path, derived(r, bits=20, families=True), f"{r}.json"))
                for r in ("2.12.1", "2.13.0"))
    text, changed = describe_change(old, new)
    said = " ".join(text.split())
    assert changed
    # 2.13.0's new attention kernel, its SIGSEGV on the scale and softmax, and its wrapping sum
    assert ("no longer computes fused SDPA above 2^32 score elements wrong; now computes fused SDPA above 2^32 "
            "score elements right") in said
    assert ("now dies (SIGSEGV) above 2^32 elements on elementwise ops of more than INT_MAX elements (no "
            "dimension past it)") in said
    assert ("no longer raises on reduction ops with a dimension past INT_MAX; now reduces only the first numel "
            "mod 2^32 elements of reduction ops with a dimension past INT_MAX") in said
    assert "still aborts the process on a Linear whose input passes 2^32 elements" in said
    # 18 rows (9 families x 2): 5 unmeasured on both (1-D copy, random, softmax; multi-dimensional indexing,
    # reduction) are left out, 3 changed (above), multi-dimensional cat is unmeasured on 2.12.1 only: 9 as before
    assert "9 op-family rows as before" in said
    assert said.endswith("cannot tell (cat ops of more than INT_MAX elements (no dimension past it): the old "
                         "sweep left it open)")
    bmm_only = load_profile(written(tmp_path, derived("2.13.0", bits=20), "bmm.json"))
    text, changed = describe_change(bmm_only, new)
    assert not changed and text.endswith("cannot tell (a Linear whose input passes 2^32 elements: the old sweep "
                                         "left it open; fused SDPA above 2^32 score elements: the old sweep left "
                                         "it open; the op families: the old sweep left it open)")
