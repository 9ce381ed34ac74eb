"""The guard's coverage, whatever the route a call takes: every entry path to bmm/mm/SDPA/cat, forward
and backward, under emulation (the dispatch mode sees every op) and on the fast path (entry points,
`devices=("cpu",)`, no emulator). At index width 16: LIMIT 65,536, VIEW_LIMIT 32,768."""

import pytest
import torch
import torch.nn.functional as F

from mpsimpact.modes.emulator import emulate
from mpsimpact.errors import OversizedOpError
from mpsimpact.modes.guard import guard

BITS = 16
PROFILE = "2.13.0"  # rule set B; mm aborts; cat above 2**31 (here 2**15) silently wrong


def batch1_qk():
    # 4-D matmul at batch 1: bmm gets strided views (8, 100, 16) @ (8, 16, 100); the output has
    # 8 * 100 * 100 = 80,000 > 65,536 elements: unmeasured layout, faulting as a transposed view would.
    q = torch.randn(1, 100, 8, 16).transpose(1, 2)
    k = torch.randn(1, 100, 8, 16).transpose(1, 2)
    return lambda: torch.matmul(q, k.transpose(2, 3))


def wrap_operands():
    # a (20, 64, 64) = 81,920 > 65,536 contiguous: wraps from batch ceil(65536 / 4096) = 16 (the
    # output, 20 * 64 * 2 = 2,560, stays small: above LIMIT rule 1 would decide instead).
    return torch.randn(20, 64, 64), torch.randn(20, 64, 2)


def at_operator():
    a, b = wrap_operands()
    return lambda: a @ b


def tensor_matmul_method():
    a, b = wrap_operands()
    return lambda: a.matmul(b)


def einsum_to_bmm():
    a, b = wrap_operands()
    return lambda: torch.einsum("bij,bjk->bik", a, b)  # lowers to bmm


def linear(bias):
    # (2 * 600, 8) @ (8, 128)^T: an output of 153,600 >= 65,536 elements aborts the process.
    x, w, b = torch.randn(2, 600, 8), torch.randn(128, 8), torch.randn(128) if bias else None
    return lambda: F.linear(x, w, b)


def sdpa():
    # Scores 2 * 4 * 128 * 128 = 131,072 > 65,536: the fused op is wrong on 2.5.1 .. 2.12.1.
    q, k, v = (torch.randn(2, 4, 128, 8) for _ in range(3))
    mask = torch.zeros(2, 1, 128, 128).masked_fill(torch.rand(2, 1, 128, 128) > 0.8, float("-inf"))
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def cat():
    # (200, 200) output = 40,000 > 32,768 elements: a multi-dimensional torch.cat above 2**31 (scaled) is
    # silently wrong on 2.13.0 (pytorch#189960); a 1-D one picks the 64-bit kernel and is right.
    x, y = torch.randn(100, 200), torch.randn(100, 200)
    return lambda: torch.cat([x, y])


PATHS = {
    "matmul_4d_batch1": (batch1_qk, PROFILE), "at_operator": (at_operator, PROFILE), "tensor_matmul": (tensor_matmul_method, PROFILE),
    "einsum": (einsum_to_bmm, PROFILE), "linear_bias": (lambda: linear(True), PROFILE), "linear_no_bias": (lambda: linear(False), PROFILE),
    "sdpa_2.12.1": (sdpa, "2.12.1"), "cat_2.13.0": (cat, PROFILE),
}


def route(name, mode, profile):
    """The guard entered two ways: under the emulator, or on the fast path for CPU tensors."""
    if name == "emulated":
        return _emulated(mode, profile)
    return guard(mode, index_bits=BITS, devices=("cpu",), profile=profile)


class _emulated:
    def __init__(self, mode, profile):
        self.emu, self.guard = emulate(index_bits=BITS, profile=profile), guard(mode, profile=profile)

    def __enter__(self):
        self.emu.__enter__()
        return self.guard.__enter__()

    def __exit__(self, *exc):
        self.guard.__exit__(*exc)
        return self.emu.__exit__(*exc)


@pytest.mark.parametrize("how", ["emulated", "fast"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_raise_stops_and_chunk_is_correct_on_every_path(how, path, inference):
    make, profile = PATHS[path]
    call = make()
    expected = call()
    ctx = torch.inference_mode() if inference else torch.no_grad()
    with ctx:
        with route(how, "raise", profile) as g, pytest.raises(OversizedOpError):
            call()
        assert len(g.stopped) == 1
        with route(how, "chunk", profile) as g:
            got = call()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert len(g.chunked) >= 1


@pytest.mark.parametrize("how", ["emulated", "fast"])
def test_backward_products_are_guarded(how):
    # Forward (2, 256, 64) @ (2, 64, 2) is fine; grad_b = a^T @ G reads a^T, a transposed view of
    # 2 * 256 * 64 = 32,768 = VIEW_LIMIT elements: MPS raises in backward.
    a = torch.randn(2, 256, 64)
    b = torch.randn(2, 64, 2, requires_grad=True)
    torch.bmm(a, b).sum().backward()
    expected, b.grad = b.grad.clone(), None
    with route(how, "raise", PROFILE) as g, pytest.raises(OversizedOpError, match="in backward"):
        torch.bmm(a, b).sum().backward()
    assert [r.phase for r in g.stopped] == ["backward"]
    b.grad = None
    with route(how, "chunk", PROFILE) as g:
        torch.bmm(a, b).sum().backward()
    torch.testing.assert_close(b.grad, expected)
    assert [r.phase for r in g.chunked] == ["backward"]


@pytest.mark.parametrize("how", ["emulated", "fast"])
def test_sdpa_passes_untouched_where_the_release_is_correct(how):
    call = sdpa()
    expected = call()
    with torch.no_grad(), route(how, "raise", "2.14.0") as g:
        got = call()
    torch.testing.assert_close(got, expected)
    assert g.stopped == [] and g.chunked == []


def test_sdpa_with_gradients_is_guarded_by_its_math_path():
    # With gradients MPS runs SDPA's math path: P (2*4, 128, 128) = 131,072 > 65,536 contiguous
    # wraps in P @ V, on every release, 2.14.0 included.
    q, k, v = (torch.randn(2, 4, 128, 8, requires_grad=True) for _ in range(3))
    with guard("raise", index_bits=BITS, devices=("cpu",), profile="2.14.0"), pytest.raises(OversizedOpError, match="bmm"):
        F.scaled_dot_product_attention(q, k, v)
    expected = F.scaled_dot_product_attention(q, k, v)
    with guard("chunk", index_bits=BITS, devices=("cpu",), profile="2.14.0") as g:
        got = F.scaled_dot_product_attention(q, k, v)
        got.sum().backward()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert g.chunked and q.grad is not None


def test_conservative_profile_stops_what_any_release_faults_on():
    # fp32 output above LIMIT with no transposed operand: only 2.4.1 is wrong (pattern unknown).
    a, b = torch.randn(5, 128, 8), torch.randn(5, 8, 128)  # output 5 * 128 * 128 = 81,920
    for profile, stops in (("2.14.0", False), ("2.4.1", True), ("2.15.0", True)):
        with guard("raise", index_bits=BITS, devices=("cpu",), profile=profile) as g:
            try:
                torch.bmm(a, b)
            except OversizedOpError:
                pass
        assert bool(g.stopped) is stops, profile


def test_small_calls_take_the_fast_path_and_are_not_recorded():
    a, b = torch.randn(4, 8, 8), torch.randn(4, 8, 8)
    with guard("raise", index_bits=BITS, devices=("cpu",)) as g:
        for _ in range(10):
            torch.bmm(a, b) @ b
            F.linear(a, b[0])
    assert g.stopped == [] and g.chunked == []
