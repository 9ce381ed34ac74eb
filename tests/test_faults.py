"""The fault rules against every published case of docs/fault-model.md, on meta tensors at the
real sizes (free on `meta`)."""

import pytest
import torch

from mpsimpact.engine.faults import (
    TensorSpec,
    classify_bmm,
    classify_bmm_backward,
    classify_mm,
    rows_per_safe_chunk,
)
from mpsimpact.engine.release import INT_MAX_MESSAGE


def operands(batch, m, k, n, layout, dtype=torch.float32, device="meta"):
    """a (B, M, K) and b (B, K, N) in one of the study's layouts."""
    if layout == "contiguous":
        return torch.empty(batch, m, k, dtype=dtype, device=device), torch.empty(
            batch, k, n, dtype=dtype, device=device
        )
    if layout == "a_transposed":
        a = torch.empty(batch, k, m, dtype=dtype, device=device).transpose(1, 2)
        return a, torch.empty(batch, k, n, dtype=dtype, device=device)
    if layout == "b_transposed":
        b = torch.empty(batch, n, k, dtype=dtype, device=device).transpose(1, 2)
        return torch.empty(batch, m, k, dtype=dtype, device=device), b
    if layout == "both_sliced":
        a = torch.empty(batch + 1, m, k, dtype=dtype, device=device)[1:]
        b = torch.empty(batch + 1, k, n, dtype=dtype, device=device)[1:]
        return a, b
    raise ValueError(layout)


# (M, K, N, B, dtype, layout) -> (kind, operand, first_bad_batch); torch 2.14.0, M2 Ultra.
PUBLISHED = [
    # output 65536 * 256 * 256 = 2**32 exactly: not above 2**32, and a's numel 2**30 < 2**31.
    ((256, 64, 256, 65536, torch.float16, "a_transposed"), ("ok", None, None)),
    # output 2**32 + 65536 > 2**32 with a transposed view: terminal rule 1.
    ((256, 64, 256, 65537, torch.float16, "a_transposed"), ("wrong_all", "a", 0)),
    # b numel = 65536 * 64 * 512 = 2**31 (inclusive) as a view; output exactly 2**32.
    ((128, 64, 512, 65536, torch.float32, "b_transposed"), ("error", "b", None)),
    ((128, 64, 512, 65537, torch.float32, "b_transposed"), ("wrong_all", "b", 0)),
    # b numel 65536 * 64 * 512 = 2**31 as a sliced view (a has only 2**29).
    ((128, 64, 512, 65536, torch.float32, "both_sliced"), ("error", "b", None)),
    # output above 2**32, no transposed operand: correct (slices are not transposed).
    ((128, 64, 512, 65537, torch.float32, "both_sliced"), ("ok", None, None)),
    # a numel = 131072 * 65536 = 2**33 > 2**32; ceil(2**32 / (256 * 256)) = 65536.
    ((256, 256, 64, 131072, torch.float32, "contiguous"), ("wrong_tail", "a", 65536)),
    ((256, 256, 64, 131073, torch.float32, "contiguous"), ("wrong_tail", "a", 65536)),
    # b numel = 131072 * 256 * 64 = 2**31 as a view: rule 2 before rule 3.
    ((256, 256, 64, 131072, torch.float32, "b_transposed"), ("error", "b", None)),
    # output > 2**32 with a transposed: wrong_all through a; the contiguous b is not wrapped.
    ((256, 256, 256, 65537, torch.float32, "a_transposed"), ("wrong_all", "a", 0)),
    # all three above 2**32, but the output rule is terminal and nothing is transposed.
    ((256, 256, 256, 65537, torch.float16, "contiguous"), ("ok", None, None)),
]


@pytest.mark.parametrize(("case", "expected"), PUBLISHED, ids=lambda v: str(v))
def test_published_cases_on_meta_tensors(case, expected):
    m, k, n, batch, dtype, layout = case
    a, b = operands(batch, m, k, n, layout, dtype)
    fault = classify_bmm(a, b)
    assert (fault.kind, fault.operand, fault.first_bad_batch) == expected
    if fault.kind == "error":
        assert fault.message == INT_MAX_MESSAGE


def test_rules_read_metadata_only_and_agree_across_tensor_kinds():
    a, b = operands(131073, 256, 256, 64, "contiguous")
    spec_fault = classify_bmm(TensorSpec.of(a), TensorSpec.of(b))
    assert spec_fault == classify_bmm(a, b)
    assert spec_fault.wrap_elements == 2**32


def test_not_monotonic_in_batch_size():
    # (128x64x512, b transposed): error at 65536, silently wrong at 65537, error-free ok below.
    kinds = [classify_bmm(*operands(bs, 128, 64, 512, "b_transposed")).kind for bs in (32767, 65536, 65537)]
    assert kinds == ["ok", "error", "wrong_all"]


def test_index_bits_scale_every_threshold():
    # At 16 bits: LIMIT 65536, VIEW_LIMIT 32768. a (B, 16, 16): per 256, ceil(65536 / 256) = 256.
    a, b = operands(300, 16, 16, 2, "contiguous")
    assert classify_bmm(a, b, index_bits=16).first_bad_batch == 256
    assert classify_bmm(a, b, index_bits=32).is_ok
    # b transposed with numel 128 * 2 * 128 = 32768 = VIEW_LIMIT: error at 16 bits.
    a, b = operands(128, 2, 2, 128, "b_transposed")
    assert classify_bmm(a, b, index_bits=16).kind == "error"


def test_straddling_batch_is_not_wrong():
    # per = 3 * 4 = 12 at 6 bits (LIMIT 64): ceil(64 / 12) = 6; batch 5 spans 60..72 but starts
    # below the limit, so it reads correctly.
    a, b = operands(7, 3, 4, 1, "contiguous")
    assert classify_bmm(a, b, index_bits=6).first_bad_batch == 6
    # With B = 6 the only candidate (batch 6) does not exist: a numel 72 > 64 but nothing wraps.
    a, b = operands(6, 3, 4, 1, "contiguous")
    assert classify_bmm(a, b, index_bits=6).is_ok


def test_backward_published_example():
    # (256x64x256, contiguous, B = 65537): forward correct (output rule, no transposed operand),
    # but G (B, 256, 256) has 65537 * 65536 > 2**32 elements and wraps in both gradient products.
    a, b = operands(65537, 256, 64, 256, "contiguous")
    assert classify_bmm(a, b).is_ok
    grad_a, grad_b = classify_bmm_backward(a, b)
    assert (grad_a.kind, grad_a.operand, grad_a.first_bad_batch) == ("wrong_tail", "a", 65536)
    assert (grad_b.kind, grad_b.operand, grad_b.first_bad_batch) == ("wrong_tail", "b", 65536)


def test_backward_of_a_transposed_operand_sees_it_untransposed():
    # grad_a = G @ b^T: b^T of a transposed b is contiguous again.
    # G (65537, 128, 512) has 65537 * 65536 > 2**32 elements and wraps from 2**32 / 65536 = 65536.
    a, b = operands(65537, 128, 64, 512, "b_transposed")
    assert TensorSpec.of(b).transpose().layout == "contiguous"
    grad_a, grad_b = classify_bmm_backward(a, b)
    # grad_a = G @ b^T: b^T is contiguous (not a view), the output 2**29 elements.
    assert (grad_a.kind, grad_a.operand, grad_a.first_bad_batch) == ("wrong_tail", "a", 65536)
    # grad_b = a^T @ G: a^T is a transposed view of 2**29 elements (< 2**31): no error.
    assert (grad_b.kind, grad_b.operand, grad_b.first_bad_batch) == ("wrong_tail", "b", 65536)


def test_attention_geometry_of_the_published_demo():
    # P (B*12, 512, 512) @ V (B*12, 512, 64); P crosses 2**32 at B = 1366.
    def pv(batch):
        return classify_bmm(*operands(batch * 12, 512, 512, 64, "contiguous"))

    assert pv(1365).is_ok
    fault = pv(1366)
    # ceil(2**32 / 512**2) = 16384 batch-heads; divmod(16384, 12) = (1365, 4).
    assert fault.first_bad_batch == 16384 and divmod(fault.first_bad_batch, 12) == (1365, 4)


def test_mm_output_at_limit_aborts():
    a = torch.empty(5462 * 256, 768, device="meta")
    b = torch.empty(768, 3072, device="meta")
    # 5462 * 256 * 3072 = 4,295,491,584 >= 2**32.
    fault = classify_mm(a, b)
    assert fault.kind == "abort" and "Encode failed" in fault.message
    assert classify_mm(torch.empty(5461 * 256, 768, device="meta"), b).is_ok


def test_largest_safe_batch_makes_every_chunk_ok():
    a, b = operands(131073, 256, 256, 64, "contiguous")
    chunk = rows_per_safe_chunk(a, b)
    assert chunk == 65536  # 2**32 / (256 * 256)
    assert classify_bmm(a[:chunk], b[:chunk]).is_ok
    a, b = operands(65537, 128, 64, 512, "b_transposed")
    chunk = rows_per_safe_chunk(a, b)
    assert classify_bmm(a[:chunk], b[:chunk]).is_ok
    assert classify_bmm(a[: chunk + 1], b[: chunk + 1]).kind == "error"


def test_index_bits_out_of_range_is_a_clear_error():
    a, b = operands(2, 2, 2, 2, "contiguous")
    with pytest.raises(ValueError, match="index_bits"):
        classify_bmm(a, b, index_bits=1)
