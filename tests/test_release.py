"""Every release's profile against the study's op-level scan (docs/fault-model.md, "Per-release
differences", from results/summary/studio/versions.md), cell by cell, on meta tensors at the real
sizes, and each release's failure texts."""

import pytest
import torch

from mpsimpact.engine.faults import classify_bmm, classify_mm, classify_sdpa, sdpa_path
from mpsimpact.engine.families import classify_cat
from mpsimpact.engine.release import MEASURED_RELEASES, profile_for

GROUPS = {
    "2.4.1": ("2.4.1",),
    "2.5-2.8": ("2.5.1", "2.6.0", "2.7.1", "2.8.0"),
    "2.9.1": ("2.9.1",),
    "2.10+": ("2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.0"),
}
# "out" = 256x64x256 (the output reaches 2**32 at B = 65536); "in" = 256x256x64 (input a reaches
# 2**32 at B = 65536, a view of it 2**31 at B = 32768). "slice" = x[1:] of a tensor with B + 1 batches.
SERIES = {"out": (256, 64, 256), "in": (256, 256, 64)}
BATCHES = (4096, 32766, 32767, 32768, 32769, 65534, 65535, 65536, 65537, 65538)


def transitions(series, dtype, layout, group):
    """The table by hand: (first batch, kind) in order; the kind holds until the next transition."""
    if series == "out":
        if group == "2.4.1":
            return [] if dtype == "fp16" else [(65537, "wrong_other")]  # any layout, pattern unknown
        return [(65537, "wrong_all")] if layout in ("a_transposed", "b_transposed") else []
    if layout in ("contiguous", "b_transposed"):
        return [(65537, "wrong_tail")]  # every release wraps
    if group == "2.4.1":
        return [(65536, "truncated")]
    if group == "2.5-2.8":
        if layout == "a_transposed":
            return [(32768, "abort"), (65536, "error"), (65537, "wrong_tail")]
        return [(32767, "abort"), (65535, "error"), (65536, "ok"), (65537, "wrong_tail")]
    if group == "2.9.1" and layout == "slice":
        return [(32767, "error")]  # bold in the table: the slice's offset counts
    return [(32768, "error")]


def expected_kind(rows, batch):
    kind = "ok"
    for first, then in rows:
        if batch >= first:
            kind = then
    return kind


def operands(series, dtype, layout, batch):
    m, k, n = SERIES[series]
    dt = {"fp16": torch.float16, "fp32": torch.float32}[dtype]

    def empty(*shape):
        return torch.empty(*shape, dtype=dt, device="meta")

    if layout == "a_transposed":
        return empty(batch, k, m).transpose(1, 2), empty(batch, k, n)
    if layout == "b_transposed":
        return empty(batch, m, k), empty(batch, n, k).transpose(1, 2)
    if layout == "slice":
        return empty(batch + 1, m, k)[1:], empty(batch + 1, k, n)[1:]
    return empty(batch, m, k), empty(batch, k, n)


CELLS = [
    (group, release, series, dtype, layout)
    for group, releases in GROUPS.items() for release in releases
    for series in SERIES for dtype in ("fp16", "fp32") for layout in ("contiguous", "a_transposed", "b_transposed", "slice")
]


@pytest.mark.parametrize(("group", "release", "series", "dtype", "layout"), CELLS)
def test_every_cell_of_the_op_level_table(group, release, series, dtype, layout):
    rows = transitions(series, dtype, layout, group)
    for batch in BATCHES:
        fault = classify_bmm(*operands(series, dtype, layout, batch), profile=release)
        assert fault.kind == expected_kind(rows, batch), (release, series, dtype, layout, batch, fault)
        if fault.kind == "wrong_tail":
            assert fault.first_bad_batch == 65536  # ceil(2**32 / (256 * 256))


def test_every_measured_release_is_in_the_table_and_measured():
    assert sorted(r for releases in GROUPS.values() for r in releases) == sorted(MEASURED_RELEASES)
    assert all(profile_for(r).measured and not profile_for(r).conservative for r in MEASURED_RELEASES)


@pytest.mark.parametrize("release", MEASURED_RELEASES)
def test_each_release_prints_its_own_error_text(release):
    minor = int(release.split(".")[1])
    view = classify_bmm(*operands("in", "fp32", "a_transposed", 65536), profile=release)
    if minor >= 13:
        assert view.message == "MPSGraph does not support tensor dims larger than INT_MAX"
    elif minor >= 9:
        assert view.message == "MPSGaph does not support tensor dims larger than INT_MAX"  # sic
    elif minor >= 5:
        line = {"2.5.1": 480, "2.6.0": 486, "2.7.1": 516, "2.8.0": 517}[release]
        assert view.message == f'srcNDArray INTERNAL ASSERT FAILED at ".../OperationUtils.mm":{line}, please report a bug to PyTorch.'
        abort = classify_bmm(*operands("in", "fp32", "a_transposed", 40000), profile=release)
        assert abort.kind == "abort" and "NDArray dimension length > INT_MAX" in abort.message
    else:
        assert view.kind == "truncated" and view.message == ""


def test_linear_and_cat_by_release():
    # Linear with input (67125249, 64) and 64 outputs: 4,296,015,936 > 2**32 output elements.
    x, w = torch.empty(67125249, 64, device="meta"), torch.empty(64, 64, device="meta")
    kinds = {r: classify_mm(x, w, profile=r).kind for r in MEASURED_RELEASES}
    assert [r for r, k in kinds.items() if k == "abort"] == ["2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.0"]
    # By design (issue 21): before 2.8.0 an output of 2**32 or more was never measured (the first-pass
    # Linear 64 -> 32, output 2.15e9, was ok there: its input, not its output, crashed 2.8.0 on): unmeasured.
    assert {kinds[r] for r in ("2.4.1", "2.5.1", "2.6.0", "2.7.1")} == {"wrong_other"}
    # 1-D cat to 2**32 + 2**20: crash to 2.8.0, error 2.9.1 .. 2.11.0, ok from 2.12.1. Given bare element
    # counts the shapes are unknown, and by design (issue 21) the multi-dimensional reading counts too:
    # unmeasured on 2.12.1, wrong on 2.13.0 (pytorch#189960), ok on 2.14.0. Shapes decide in test_op_families.
    big = [2**31, 2**31 + 2**20]
    cat = {r: classify_cat(big, profile=r).kind for r in MEASURED_RELEASES}
    assert cat == {"2.4.1": "abort", "2.5.1": "abort", "2.6.0": "abort", "2.7.1": "abort", "2.8.0": "abort",
                   "2.9.1": "error", "2.10.0": "error", "2.11.0": "error", "2.12.1": "wrong_other", "2.13.0": "wrong_other",
                   "2.14.0": "ok"}
    assert classify_cat(big, profile="2.12.1").is_unmeasured and not classify_cat(big, profile="2.13.0").is_unmeasured
    # Above 2**31 and at most 2**32: a 1-D reading has a dimension past INT_MAX (the per-dimension check,
    # inferred at this size), a multi-dimensional one is wrong on 2.13.0 and unmeasured before.
    small = {r: classify_cat([2**31, 1], profile=r) for r in MEASURED_RELEASES}
    assert {r for r, f in small.items() if f.is_ok} == {"2.14.0"}
    assert small["2.13.0"].rule == "cat-int32-offsets" and small["2.12.1"].is_unmeasured
    assert small["2.10.0"].kind == "error" and small["2.10.0"].inferred


def test_fused_sdpa_by_release():
    # (5712, 12, 256, 256): 5712 * 12 * 256 * 256 = 4,492,099,584 > 2**32 score elements.
    q = torch.empty(5712, 12, 256, 64, device="meta")
    wrong = {r for r in MEASURED_RELEASES if sdpa_path(False, r) == "fused" and not classify_sdpa(q, q, profile=r).is_ok}
    assert wrong == {"2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1"}
    assert sdpa_path(False, "2.4.1") == "math" and sdpa_path(True, "2.14.0") == "math"
    small = torch.empty(5461, 12, 256, 64, device="meta")  # 5461 * 12 * 65536 = 4,294,705,152 <= 2**32
    assert classify_sdpa(small, small, profile="2.12.1").is_ok


def test_unmeasured_releases_are_conservative_and_unmeasured_patches_take_their_group():
    newer, older, patch = profile_for("2.15.0"), profile_for("2.3.1"), profile_for("2.12.0")
    assert newer.conservative and older.conservative and "unmeasured" in newer.label
    assert (patch.group, patch.measured, patch.conservative) == ("2.10.0-2.12.1", False, False)
    # A call that any measured release faults on is unsafe: 2.4.1's fp32 output rule...
    fault = classify_bmm(*operands("out", "fp32", "slice", 65537), profile="2.15.0")
    assert (fault.kind, fault.rule, fault.inferred) == ("wrong_other", "conservative:output-fp32", True)
    # ...and a call every measured release computes correctly stays ok.
    assert classify_bmm(*operands("out", "fp16", "slice", 65537), profile="2.15.0").is_ok
    assert not classify_sdpa(torch.empty(5712, 12, 256, 64, device="meta"), torch.empty(5712, 12, 256, 64, device="meta"), profile="2.15.0").is_ok
    with pytest.raises(ValueError, match="not a torch release"):
        profile_for("latest")


def test_strided_operands_fault_wherever_a_transposed_view_would():
    # Q K^T of one 20,000-token sequence of a 12-head model at batch 1: matmul hands bmm strided
    # views (12, 20000, 64) and (12, 64, 20000); the output has 12 * 20000**2 = 4.8e9 > 2**32 elements.
    q = torch.empty(1, 20000, 12, 64, device="meta").transpose(1, 2)[0]  # (12, 20000, 64), strides (64, 768, 1)
    k = torch.empty(1, 20000, 12, 64, device="meta").permute(0, 2, 3, 1)[0]  # (12, 64, 20000)
    fault = classify_bmm(q, k, profile="2.14.0")
    assert (fault.kind, fault.rule, fault.inferred, fault.operand) == ("wrong_other", "unmeasured-layout", True, "ab")
    small = classify_bmm(q[:, :100], k[:, :, :100], profile="2.14.0")
    assert small.is_ok


@pytest.mark.parametrize("asked", ["2.12.1.1", "2.12.1x", "2.12.1 2.13.0", "2.12.1+", "2.12.1-rc1"])
def test_a_release_asked_for_is_read_whole_never_judged_as_its_first_numbers(asked):
    from mpsimpact.engine.release import UnknownReleaseError, parse_release

    with pytest.raises(UnknownReleaseError, match="is not a torch release"):
        parse_release(asked)


@pytest.mark.parametrize(("asked", "release", "name"), [
    ("2.12", (2, 12, 0), "2.12.0"), ("2.15.0rc1", (2, 15, 0), "2.15.0rc1"),
    ("2.15.0.dev20261101", (2, 15, 0), "2.15.0.dev20261101"), ("2.13.0+cpu", (2, 13, 0), "2.13.0"),
    ("2.9.0a0+git1234abc", (2, 9, 0), "2.9.0a0"), ("2.14.0.post1", (2, 14, 0), "2.14.0.post1")])
def test_torchs_own_version_spellings_are_releases_named_whole(asked, release, name):
    from mpsimpact.engine.release import parse_release

    assert (parse_release(asked).number, str(parse_release(asked))) == (release, name)
