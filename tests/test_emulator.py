"""Emulated values against an independent computation: explicit index arithmetic written here,
on small tensors at a reduced index width (LIMIT = 2**12 = 4096, VIEW_LIMIT = 2048)."""

import pytest
import torch

from mpsimpact.modes.emulator import emulate
from mpsimpact.errors import EmulatedMpsError

BITS = 12
LIMIT = 2**BITS

DTYPES = [torch.float32, torch.float16]


def tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def wrapped_reference(a, b):
    """Batch i reads a's flat elements [(i * per) mod LIMIT, ... + per), by hand."""
    flat, per = a.reshape(-1), a[0].numel()
    rows = []
    for i in range(a.shape[0]):
        start = (i * per) % LIMIT if i * per >= LIMIT else i * per
        rows.append(flat[start : start + per].reshape(a.shape[1:]).double() @ b[i].double())
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), [(8, 8), (6, 7)])  # per 64 divides 4096; per 42 straddles
def test_wrong_tail_forward_matches_index_arithmetic(dtype, m, k):
    a = torch.randn(200, m, k).to(dtype)  # numel > 4096: wraps, several times
    b = torch.randn(200, k, 2).to(dtype)
    with emulate(index_bits=BITS) as mode:
        got = torch.bmm(a, b)
    expected = wrapped_reference(a, b)
    first = -(-LIMIT // (m * k))  # ceil(4096 / per): 64 for per 64, 98 for per 42
    assert mode.records[0].fault.first_bad_batch == first
    torch.testing.assert_close(got.double(), expected, **tol(dtype))
    plain = torch.bmm(a, b)
    assert torch.equal(got[:first], plain[:first])
    assert not torch.allclose(got[first:].float(), plain[first:].float(), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_wrong_all_reads_transposed_storage_row_major(dtype):
    base = torch.randn(18, 4, 16).to(dtype)  # storage of a, (B+1, K, M)
    a = base[1:].transpose(1, 2)  # (17, 16, 4) view, storage offset 64
    b = torch.randn(17, 4, 16).to(dtype)  # output 17 * 16 * 16 = 4352 > 4096
    with emulate(index_bits=BITS) as mode:
        got = torch.bmm(a, b)
    flat = base.reshape(-1)
    read = flat[64 : 64 + 17 * 16 * 4].reshape(17, 16, 4)  # strides ignored, offset kept
    torch.testing.assert_close(got.double(), read.double() @ b.double(), **tol(dtype))
    assert mode.records[0].fault.kind == "wrong_all"


@pytest.mark.parametrize("dtype", DTYPES)
def test_view_over_int_max_raises_the_mps_error(dtype):
    a = torch.randn(2, 2, 16).to(dtype)
    b = torch.randn(2, 64, 16).to(dtype).transpose(1, 2)  # view of 2048 = VIEW_LIMIT elements
    with emulate(index_bits=BITS), pytest.raises(RuntimeError, match="does not support tensor dims larger than INT_MAX"):
        torch.bmm(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ok_calls_are_bitwise_plain(dtype):
    a, b = torch.randn(17, 16, 4).to(dtype), torch.randn(17, 4, 16).to(dtype)  # contiguous, out 4352
    with emulate(index_bits=BITS) as mode:
        got = torch.bmm(a, b)
    assert torch.equal(got, torch.bmm(a, b)) and mode.records == []


def test_mm_over_limit_raises_abort_error():
    with emulate(index_bits=BITS), pytest.raises(EmulatedMpsError, match="Encode failed"):
        torch.nn.functional.linear(torch.randn(64, 8), torch.randn(64, 8))  # output 4096


def test_baddbmm_and_matmul_under_inference_mode_are_seen():
    a, b, c = torch.randn(200, 8, 8), torch.randn(200, 8, 2), torch.randn(200, 8, 2)
    with torch.inference_mode(), emulate(index_bits=BITS) as mode:
        via_matmul = a.unsqueeze(0) @ b.unsqueeze(0)  # 4-D matmul folds to bmm
        via_baddbmm = torch.baddbmm(c, a, b, beta=0.5, alpha=2.0)
    expected = wrapped_reference(a, b)
    torch.testing.assert_close(via_matmul[0].double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(via_baddbmm.double(), 0.5 * c.double() + 2 * expected, atol=1e-5, rtol=1e-5)
    assert len(mode.records) == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_wraps_the_incoming_gradient(dtype):
    # a (80, 8, 2) @ b (80, 2, 8): forward output 5120 > 4096 with no transposed operand -> correct;
    # G (80, 8, 8) is contiguous with 5120 > 4096 elements -> both gradient products wrap from
    # batch 4096 / 64 = 64; grad_a[i] = G[(i*64 mod 4096)/64] @ b[i]^T. The views a^T, b^T hold
    # 1280 < 2048 elements, so rule 2 does not fire first.
    a = torch.randn(80, 8, 2).to(dtype).requires_grad_()
    b = torch.randn(80, 2, 8).to(dtype).requires_grad_()
    grad = torch.randn(80, 8, 8).to(dtype)
    with emulate(index_bits=BITS) as mode:
        out = torch.bmm(a, b)
        out.backward(grad)
    torch.testing.assert_close(out, torch.bmm(a, b), **tol(dtype))
    source = torch.tensor([i % 64 for i in range(80)])
    g = grad.double()[source]
    torch.testing.assert_close(a.grad.double(), g @ b.detach().double().transpose(1, 2), **tol(dtype))
    torch.testing.assert_close(b.grad.double(), a.detach().double().transpose(1, 2) @ g, **tol(dtype))
    assert [r.phase for r in mode.records] == ["backward", "backward"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_wrong_all_reads_b_transposed_storage(dtype):
    # grad_a = G @ b^T: output (17, 16, 16) = 4352 > 4096 elements with b^T a transposed view:
    # rule 1, so b^T is read as if its storage (b, row-major (17, 16, 2)) were packed (17, 2, 16).
    # Only a needs a gradient, so grad_b = a^T @ G (which would hit rule 2) is never computed.
    a = torch.randn(17, 16, 16).to(dtype).requires_grad_()
    b = torch.randn(17, 16, 2).to(dtype)
    grad = torch.randn(17, 16, 2).to(dtype)
    with emulate(index_bits=BITS) as mode:
        torch.bmm(a, b).backward(grad)  # forward: a itself (4352 > 4096) wraps, rule 3
    read = b.double().reshape(-1).reshape(17, 2, 16)  # strides ignored
    torch.testing.assert_close(a.grad.double(), grad.double() @ read, **tol(dtype))
    assert [(r.phase, r.fault.kind, r.fault.operand) for r in mode.records] == [
        ("forward", "wrong_tail", "a"),
        ("backward", "wrong_all", "b"),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_view_over_int_max_raises(dtype):
    # grad_b = a^T @ G: a^T is a transposed view of 2 * 64 * 16 = 2048 = VIEW_LIMIT elements, the
    # output (2, 16, 2) small: rule 2 raises in backward although the forward was correct.
    a = torch.randn(2, 64, 16).to(dtype)
    b = torch.randn(2, 16, 2).to(dtype).requires_grad_()
    with emulate(index_bits=BITS):
        out = torch.bmm(a, b)
        with pytest.raises(RuntimeError, match="does not support tensor dims larger than INT_MAX"):
            out.sum().backward()


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_ok_is_plain(dtype):
    a = torch.randn(4, 8, 4).to(dtype).requires_grad_()
    b = torch.randn(4, 4, 8).to(dtype).requires_grad_()
    with emulate(index_bits=BITS) as mode:
        torch.bmm(a, b).sum().backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    torch.bmm(a, b).sum().backward()
    assert torch.equal(ga, a.grad) and torch.equal(gb, b.grad) and mode.records == []
