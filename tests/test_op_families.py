"""The op-family rules (Note [Op families past INT_MAX] in faults.py) against the study's first-pass suite
(docs/fault-model.md, "Op families past INT_MAX"), cell by cell, from the specs of the ops each
test runs at its real size (meta tensors and TensorSpecs: free); Linear judged on every operand; each
release's texts; and the same rules at index width 20 by hand arithmetic."""

import dataclasses

import pytest
import torch

from mpsimpact.engine.faults import TensorSpec, classify_mm, dim_max, rows_per_safe_chunk, limits, sdpa_path
from mpsimpact.engine.families import classify_cat, classify_op, family_of
from mpsimpact.engine.release import (
    INT_MAX_MESSAGE, INT_MAX_MESSAGE_TYPO, MEASURED_RELEASES, OP_FAMILIES, ONE_DIMENSION_ROWS, profile_for,
)

N = 2**32 + 2**20  # the suite's 1-D size: 4,296,015,872, past INT_MAX (2**31 - 1) and past 2**32
INT_MAX = 2**31 - 1


def spec(*shape, dtype="float32"):
    return TensorSpec.contiguous(shape, dtype)


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


# What each test runs on MPS, as (op, input tensors, output), in order. How a test made its inputs is
# recorded only where the test's name says it (ones, zeros, arange).
def bmm_contiguous(release):
    # output 68544 * 256 * 256 = 4,492,099,584 > 2**32, nothing transposed: rule 1 says ok (any K; K = 64)
    return [("bmm", [meta(68544, 256, 64), meta(68544, 64, 256)], None)]


def bmm_q_kt(release):
    # output 65552 * 256 * 256 = 4,296,015,872 > 2**32 with k^T a transposed view: wrong_all
    q, k = meta(65552, 256, 64), meta(65552, 256, 64)
    return [("bmm", [q, k.transpose(1, 2)], None)]


def bmm_a_transposed(release):
    return [("bmm", [meta(65552, 64, 256).transpose(1, 2), meta(65552, 64, 256)], None)]


def eager_attention(release):
    # softmax(q k^T / 8) v on (5712, 12, 256, 64): matmul folds 5712 * 12 = 68544 batch-heads; the scores
    # have 68544 * 256 * 256 = 4,492,099,584 > 2**32 elements; P V reads P (> 2**32, contiguous): it wraps.
    q, k, v = meta(5712, 12, 256, 64), meta(5712, 12, 256, 64), meta(5712, 12, 256, 64)
    scores = meta(5712, 12, 256, 256)
    return [
        ("bmm", [q.reshape(68544, 256, 64), k.transpose(-1, -2).reshape(68544, 64, 256)], None),
        ("div", [scores], scores),
        ("_softmax", [scores], scores),
        ("bmm", [scores.reshape(68544, 256, 256), v.reshape(68544, 256, 64)], None),
    ]


def fused_sdpa(release):
    # Without gradients: MPS's own op from 2.5.1; 2.4.1 runs the math path (matmul, softmax, matmul).
    q = meta(5712, 12, 256, 64)
    if sdpa_path(False, release) == "fused":
        return [("scaled_dot_product_attention", [q, q, q], q)]
    return [call for call in eager_attention(release) if call[0] != "div"]  # the math path scales q and k


def bmm_input(release):
    # a (65552, 256, 256): 4,296,015,872 > 2**32, contiguous; wraps from ceil(2**32 / 65536) = 65536 < 65552
    return [("bmm", [meta(65552, 256, 256), meta(65552, 256, 64)], None)]


def linear_input(release):
    # nn.Linear(64, 32) on (67125249, 64): input 4,296,015,936 > 2**32, output 2,148,007,968 < 2**32
    x, w, b = meta(67125249, 64), meta(32, 64), meta(32)
    return [("linear", [x, w, b], meta(67125249, 32))]


def elementwise_1d(release):
    x = spec(N, dtype="float16")
    return [("ones", [], x), ("mul", [x], x), ("add", [x], x)]


def sum_1d(release):
    x = spec(N, dtype="uint8")
    return [("ones", [], x), ("sum", [x], spec(dtype="int64"))]


def transpose_copy(release):
    # (65552, 256, 256) fp16: 4,296,015,872 > 2**32 elements in three dimensions, each far below INT_MAX
    x = meta(65552, 256, 256, dtype=torch.float16)
    return [("clone", [x.transpose(1, 2)], meta(65552, 256, 256, dtype=torch.float16))]


def cat_1d(release):
    half = spec(2**31 + 2**19, dtype="float16")  # 2 * (2**31 + 2**19) = 2**32 + 2**20 = N
    return [("cat", [[half, half]], spec(N, dtype="float16"))]


def arange_index(release):
    x, picks = spec(N, dtype="int64"), spec(3, dtype="int64")  # x[[0, 2**32 + 5, N - 1]]
    return [("arange", [], x), ("remainder", [x], x), ("index", [x, picks], picks)]


def masked_fill_1d(release):
    x, mask = spec(2**32 + 16, dtype="uint8"), spec(2**32 + 16, dtype="bool")
    return [("zeros", [], x), ("masked_fill_", [x, mask], x)]


def small_sum(release):
    x = spec(1_500_000_000)  # 1.5e9 < INT_MAX = 2,147,483,647: nothing past any limit
    return [("ones", [], x), ("mul", [x], x), ("add", [x], x), ("sum", [x], spec())]


# docs/fault-model.md, "Op families past INT_MAX": one row per test, one column per
# MEASURED_RELEASES entry (2.4.1, 2.5.1, 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.0).
C, E, W, O = "crash", "error", "WRONG", "ok"
FIRST_PASS = {
    "bmm, contiguous, output (68544, 256, 256) fp32": (bmm_contiguous, (W,) + (O,) * 10),
    "bmm, q @ k.transpose(1, 2)": (bmm_q_kt, (W,) * 11),
    "bmm, transposed first operand": (bmm_a_transposed, (W,) * 11),
    "eager attention": (eager_attention, ("either",) + (W,) * 8 + (C, W)),
    "fused SDPA": (fused_sdpa, (W,) * 9 + (O, O)),
    "bmm, input (65552, 256, 256)": (bmm_input, (W,) * 11),
    "Linear 64 -> 32 on (67125249, 64)": (linear_input, (O,) * 4 + (C,) * 7),
    "1-D fp16 ones(N) * 2 + 1": (elementwise_1d, (C,) * 4 + (W, E, E, E, O, O, O)),
    "1-D uint8 ones(N).sum()": (sum_1d, (C,) * 5 + (E,) * 4 + (W, E)),
    "(65552, 256, 256) fp16 transpose(1, 2).contiguous()": (transpose_copy, (O,) * 11),
    "1-D cat of two fp16 halves": (cat_1d, (C,) * 5 + (E,) * 3 + (O,) * 3),
    "1-D int64 arange(N) % 1000, then x[[...]]": (arange_index, (C,) * 4 + (W,) + (E,) * 5 + (W,)),
    "1-D uint8 zeros(2**32 + 16).masked_fill_": (masked_fill_1d, (C,) * 3 + (E,) * 8),
    "fp32 ones(1.5e9), (x * 2 + 1).sum()": (small_sum, (O,) * 11),
}


def outcome(calls, profile, index_bits=32):
    """As the suite judged a test: the first abort is a crash, the first error an error; else any silent
    kind makes it WRONG; else ok."""
    silent = False
    for op, inputs, out in calls:
        fault = classify_op(op, inputs, out, index_bits=index_bits, profile=profile)
        if fault.is_stop:
            return {"abort": C, "error": E}[fault.kind]
        silent = silent or fault.is_silent
    return W if silent else O


def matches(expected, got):
    return expected == got or (expected == "either" and got in (O, W))  # 2.4.1's eager cell: unexplained


CELLS = [(test, i, release) for test in FIRST_PASS for i, release in enumerate(MEASURED_RELEASES)]


@pytest.mark.parametrize(("test", "column", "release"), CELLS)
def test_every_cell_of_the_first_pass_table(test, column, release):
    build, row = FIRST_PASS[test]
    assert matches(row[column], outcome(build(release), release)), (test, release)


def test_the_whole_table_matches_and_the_check_can_fail():
    assert len(FIRST_PASS) == 14 and len(MEASURED_RELEASES) == 11
    agree = sum(matches(FIRST_PASS[t][1][i], outcome(FIRST_PASS[t][0](r), r)) for t, i, r in CELLS)
    assert agree == 154
    # Change one code of the data (2.12.1's elementwise "ok" -> "wrong") and its cell stops matching.
    profile = profile_for("2.12.1")
    changed = tuple((f, "wrong" if f == "elementwise" else one, multi) for f, one, multi in profile.families)
    assert outcome(elementwise_1d("2.12.1"), profile) == O
    assert outcome(elementwise_1d("2.12.1"), dataclasses.replace(profile, families=changed)) == W


def test_the_rows_are_the_tables_and_every_op_name_is_an_aten_op():
    assert all(len(row) == len(MEASURED_RELEASES) for row in ONE_DIMENSION_ROWS.values())
    assert [name for name in OP_FAMILIES if not hasattr(torch.ops.aten, name)] == ["sdpa"]  # the tracer's name


# Each release's texts.
@pytest.mark.parametrize("release", MEASURED_RELEASES)
def test_each_release_prints_its_own_text(release):
    minor = int(release.split(".")[1])
    x = spec(N, dtype="float16")
    first_stop = next((f for f in (classify_op(op, i, o, profile=release) for op, i, o in arange_index(release))
                       if f.is_stop), None)
    cat = classify_op("cat", [[spec(2**31 + 2**19)] * 2], x, profile=release)
    if minor <= 7:
        assert first_stop.kind == "abort" and "SIGABRT" in first_stop.message
    if minor <= 8:
        assert cat.kind == "abort" and cat.message.startswith("MPSNDArray.mm:831: fail")
    elif minor <= 12:
        assert first_stop.message == INT_MAX_MESSAGE_TYPO  # "MPSGaph" (sic), 2.9.1 .. 2.12.1
        assert minor == 12 or cat.message == INT_MAX_MESSAGE_TYPO  # 2.10.0 / 2.11.0's cat: the INT_MAX text
    elif minor == 13:
        assert first_stop.message == INT_MAX_MESSAGE == "MPSGraph does not support tensor dims larger than INT_MAX"
    masked = classify_op("masked_fill", [spec(2**32 + 16, dtype="uint8")], profile=release)
    if minor >= 7:
        assert masked.message == "masked_fill not supported for tensors of more than 2**32 elements"
    total = classify_op("sum", [spec(N, dtype="uint8")], profile=release)
    if minor == 14:
        assert total.message == f"MPS sum_reduction: tensors requiring 64-bit indexing are not supported (numel={N})"


def test_the_2_13_0_sum_wraps_mod_the_limit():
    fault = classify_op("sum", [spec(N, dtype="uint8")], spec(dtype="int64"), profile="2.13.0")
    assert (fault.kind, fault.rule, fault.inferred) == ("wrong_all", "reduction-wrap", False)
    assert N % fault.wrap_elements == 2**20  # (2**32 + 2**20) mod 2**32: what ones(N).sum() returned
    # mean follows the sum row, inferred; at or below 2**32 elements the wrap is not characterised.
    assert classify_op("mean", [spec(N)], profile="2.13.0").inferred
    assert classify_op("sum", [spec(2**31)], profile="2.13.0").rule == "unmeasured:reduction"


# Linear (mm, addmm) on every operand and the output.
def test_linear_by_its_input_and_by_its_output():
    x, w, b = meta(67125249, 64), meta(32, 64), meta(32)
    # The tracer sees addmm(b, x, w.t()); the entry op linear folds to the same call.
    for release in MEASURED_RELEASES:
        assert classify_op("addmm", [b, x, w.t()], profile=release) == classify_op("linear", [x, w, b], profile=release)
    fault = classify_mm(x, w.t(), bias=b, profile="2.8.0")
    assert (fault.kind, fault.operand, fault.rule, fault.inferred) == ("abort", "a", "mm-operand", False)
    # An output of 2**32 or more: 67125249 * 64 = 4,296,015,936 outputs. Measured on 2.14.0 only; before 2.8.0
    # nobody measured it (the Linear crash there was its input's).
    wide = meta(64, 64)
    assert (classify_mm(x, wide.t(), profile="2.14.0").rule, classify_mm(x, wide.t(), profile="2.14.0").inferred) == (
        "mm-encode", False)
    assert classify_mm(x, wide.t(), profile="2.13.0").inferred
    assert classify_mm(x, wide.t(), profile="2.7.1").rule == "unmeasured:mm"


def test_a_weight_or_a_view_past_the_limits_is_unmeasured_or_inferred():
    x = meta(1, 2**29 + 1)  # one row; the output is (1, 8)
    big_w = meta(8, 2**29 + 1)  # a weight of 8 * (2**29 + 1) = 2**32 + 8 > 2**32 elements
    fault = classify_op("linear", [x, big_w], profile="2.14.0")
    assert (fault.kind, fault.operand, fault.inferred) == ("abort", "b", True)
    assert classify_op("linear", [x, big_w], profile="2.6.0").rule == "unmeasured:mm"
    # The weight gradient x^T @ G of a Linear whose input x (67125249, 64) has more than 2**32 elements:
    # x^T is a transposed view, so its abort from 2.8.0 is inferred, and before 2.8.0 it is unmeasured.
    x_t, grad = meta(67125249, 64).t(), meta(67125249, 32)
    fault = classify_mm(x_t, grad, profile="2.8.0")
    assert (fault.kind, fault.operand, fault.inferred) == ("abort", "a", True)
    assert classify_mm(x_t, grad, profile="2.7.1").is_unmeasured
    # Below 2**32 a view operand is taken as right (the bmm view rule was never seen in mm): BERT-base's
    # FFN weight gradient at 2048 x 512 tokens reads x^T of 1,048,576 * 3072 = 3,221,225,472 elements.
    assert classify_mm(meta(1048576, 3072).t(), meta(1048576, 768), profile="2.14.0").is_ok


def test_largest_safe_mm_chunk_keeps_input_and_output_below_the_limits():
    x, w = meta(67125249, 64), meta(32, 64)
    # min((2**32 - 1) // 32, (2**31 - 1) // 64 as slices) = min(134217727, 33554431): a slice stays below
    # VIEW_LIMIT, on every release (2.5.1 .. 2.9.1 count its offset too); unsplit, the input aborts.
    assert rows_per_safe_chunk(x, w.t(), op="mm", as_slices=True) == 33554431
    assert rows_per_safe_chunk(x, w.t(), op="mm") == 2**32 // 64 == 67108864  # contiguous pieces: at most 2**32
    assert classify_mm(x[:67108864], w.t(), profile="2.14.0").is_ok
    assert classify_mm(x[:67108865], w.t(), profile="2.14.0").kind == "abort"  # 2**32 + 64 elements


# The rules at index width 20: LIMIT 2**20 = 1,048,576, VIEW_LIMIT 2**19, DIM_MAX 2**19 - 1 = 524,287.
def test_linear_at_width_20():
    rows = 2**20 // 64 + 17  # 16401 rows: the input has 16401 * 64 = 1,049,664 > 2**20; the output 131,208
    x, w, b = torch.empty(rows, 64), torch.empty(8, 64), torch.empty(8)  # nn.Linear(64, 8) on CPU tensors
    stop = classify_op("linear", [x, w, b], index_bits=20, profile="2.14.0")
    assert stop.is_stop and (stop.kind, stop.operand) == ("abort", "a")
    assert classify_op("linear", [x, w, b], index_bits=20, profile="2.7.1").is_ok
    # Chunks: min((2**20 - 1) // 8 = 131071, (2**19 - 1) // 64 = 8191) rows, each ok as a slice.
    chunk = rows_per_safe_chunk(x, w.t(), index_bits=20, op="mm", as_slices=True)
    assert chunk == 8191
    assert all(classify_mm(x[i:i + chunk], w.t(), index_bits=20, profile="2.14.0").is_ok for i in range(0, rows, chunk))


def test_uint8_sum_at_width_20_wraps_mod_2_to_the_20():
    n = 2**20 + 2**8  # 1,048,832: a dimension past 524,287 and more than 2**20 elements
    fault = classify_op("sum", [spec(n, dtype="uint8")], spec(dtype="int64"), index_bits=20, profile="2.13.0")
    assert (fault.kind, fault.wrap_elements) == ("wrong_all", 2**20)
    assert n % fault.wrap_elements == 256  # ones(n).sum() returns 256, not 1,048,832
    # Split along its dimension into pieces of at most DIM_MAX elements: each piece is ok.
    assert classify_op("sum", [spec(2**19 - 1, dtype="uint8")], index_bits=20, profile="2.13.0").is_ok


def test_fp16_elementwise_at_width_20():
    n = 2**20 + 2**8
    x = torch.empty(n, dtype=torch.float16)
    stop = classify_op("mul", [x], x, index_bits=20, profile="2.11.0")
    assert stop.is_stop and stop.message == INT_MAX_MESSAGE_TYPO
    assert classify_op("mul", [x], x, index_bits=20, profile="2.12.1").is_ok
    assert classify_op("mul", [x[: 2**19 - 1]], x[: 2**19 - 1], index_bits=20, profile="2.11.0").is_ok


# The per-dimension check, the multi-dimensional rows and 2.13.0's model-level crash.
def test_only_a_dimension_past_int_max_triggers_the_per_dimension_check():
    at, past = spec(INT_MAX, dtype="float16"), spec(INT_MAX + 1, dtype="float16")
    assert classify_op("mul", [at], at, profile="2.11.0").is_ok
    fault = classify_op("mul", [past], past, profile="2.11.0")
    # 2**31 elements <= 2**32: measured at 2**32 + 2**20, the same per-dimension check is inferred here.
    assert (fault.kind, fault.inferred) == ("error", True)
    # Two dimensions of 2**31 + 2**20 elements in all, neither past INT_MAX: no per-dimension check.
    wide = spec(2, 2**30 + 2**19, dtype="float16")
    assert classify_op("mul", [wide], wide, profile="2.11.0").is_ok
    assert classify_op("mul", [spec(2, 2**31)], profile="2.11.0").kind == "error"  # one dimension past


def test_scale_and_softmax_on_big_scores_crash_on_2_13_0_only():
    scores = meta(5712, 12, 256, 256)  # 4,492,099,584 > 2**32 elements, every dimension small
    for op in ("div", "mul", "_softmax"):
        kinds = {r: classify_op(op, [scores], scores, profile=r) for r in MEASURED_RELEASES}
        assert {r for r, f in kinds.items() if not f.is_ok} == {"2.13.0"}
        crash = kinds["2.13.0"]
        assert (crash.kind, crash.rule, crash.inferred) == ("abort", "int32-kernel", True) and "SIGSEGV" in crash.message
    # Between 2**31 and 2**32 elements nobody measured 2.13.0's kernels: conservative.
    assert classify_op("_softmax", [meta(2**16, 2**15)], profile="2.13.0").is_unmeasured


def test_cat_on_2_13_0_by_the_per_dimension_kernel_choice():
    halves = [spec(2**31 + 2**19, dtype="float16")] * 2
    assert classify_cat(halves, profile="2.13.0").is_ok  # a dimension past INT_MAX: 64-bit kernel, right
    # pytorch#189960: (32769, 32768) int8 twice along dim 1 -> 32769 * 65536 = 2**31 + 65536 > 2**31 elements.
    pieces = [meta(32769, 32768, dtype=torch.int8)] * 2
    wrong = classify_cat(pieces, dim=1, profile="2.13.0")
    assert (wrong.kind, wrong.rule, wrong.inferred) == ("wrong_other", "cat-int32-offsets", False)
    assert classify_cat(pieces, dim=1, profile="2.14.0").is_ok  # the fix (inferred)
    assert classify_cat(pieces, dim=1, profile="2.12.1").is_unmeasured
    assert classify_cat([meta(32768, 32768, dtype=torch.int8)] * 2, dim=1, profile="2.13.0").is_ok  # exactly 2**31


def test_unmeasured_families_are_conservative():
    long, wide = spec(INT_MAX + 1), spec(2**16, 2**16)  # a dimension past INT_MAX; 2**32 elements in 2-D
    assert classify_op("native_layer_norm", [wide], wide, profile="2.14.0").rule == "unmeasured:other"
    assert classify_op("native_layer_norm", [spec(2**15, 2**15)], profile="2.14.0").is_ok  # 2**30: no limit
    assert classify_op("randn", [], long, profile="2.14.0").is_unmeasured
    assert classify_op("randn", [], wide, profile="2.14.0").is_ok
    assert classify_op("clone", [long], long, profile="2.14.0").is_unmeasured
    assert classify_op("gather", [wide, wide], wide, profile="2.14.0").is_unmeasured
    assert classify_op("sum", [wide], profile="2.12.1").is_unmeasured
    assert classify_op("sum", [wide], profile="2.14.0").rule == "sum-64-bit"  # its text names 64-bit indexing
    assert classify_op("zeros", [], long, profile="2.11.0").is_unmeasured  # never seen right before 2.12.1
    assert classify_op("transpose", [long], profile="2.5.1").is_ok  # a view: no kernel runs
    fault = classify_op("sum", [wide], profile="2.12.1")
    assert fault.kind == "wrong_other" and fault.inferred and fault.message.startswith("unmeasured")


def test_masked_fill_checks_its_element_count_from_2_7_1():
    scores = meta(5712, 12, 256, 256)
    assert classify_op("masked_fill", [scores, scores], scores, profile="2.7.1").rule == "masked-fill-numel"
    assert classify_op("masked_fill", [scores, scores], scores, profile="2.6.0").is_unmeasured
    band = meta(2**16, 2**15 + 1)  # 2**31 + 2**16 elements: below the text's 2**32, nobody measured
    assert classify_op("masked_fill", [band], band, profile="2.14.0").is_unmeasured


def test_unmeasured_releases_take_the_newest_measured_fault():
    x = spec(N, dtype="float16")
    fault = classify_op("add", [x], x, profile="2.15.0")
    assert (fault.kind, fault.rule, fault.inferred) == ("error", "conservative:dim-int-max:elementwise", True)
    assert fault.message == INT_MAX_MESSAGE_TYPO  # 2.11.0, the newest release that faults
    assert classify_op("add", [spec(10)], profile="2.15.0").is_ok


def test_specs_and_tensors_agree():
    x = meta(N, dtype=torch.float16)
    for release in MEASURED_RELEASES:
        assert classify_op("mul", [x, 2.0], x, profile=release) == classify_op("mul", [TensorSpec.of(x)], TensorSpec.of(x),
                                                                              profile=release)


def test_family_of_maps_aten_names_overloads_and_in_place_forms():
    aten = torch.ops.aten
    assert [family_of(op) for op in ("add", "add_", "aten::add.Tensor", aten.add_.Tensor, aten._softmax.default)] == [
        "elementwise"] * 4 + ["softmax"]
    assert [family_of(op) for op in ("masked_fill_", "index_put_", "zero_", "copy_", "arange", "linear", "stack")] == [
        "masked_fill", "indexing", "creation", "copy", "indexing", "mm", "cat"]
    assert family_of("native_layer_norm") == "other" and family_of("__and__") == "other"
    assert family_of("reduction") == "reduction"


def test_index_width_scales_the_per_dimension_limit():
    assert limits(20) == (2**20, 2**19) and dim_max(20) == 2**19 - 1 and dim_max(32) == INT_MAX
    # at 16 bits DIM_MAX = 32767: a 1-D tensor of 32768 elements is past it, 32767 is not
    assert classify_op("mul", [spec(32768)], index_bits=16, profile="2.10.0").kind == "error"
    assert classify_op("mul", [spec(32767)], index_bits=16, profile="2.10.0").is_ok
