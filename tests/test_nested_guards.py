"""Nested guards: the inner one decides alone, with or without an emulator underneath, as if it were the only
guard (an outer guard passes every call on while an inner one is active, and decides again once it leaves)."""

import contextlib
import itertools
import warnings

import pytest
import torch

import mpsimpact
from mpsimpact.errors import OversizedOpError
from mpsimpact.modes.emulator import emulate

# At 13 bits: a (40, 16, 16) holds 10240 > 2**13 elements, the output (40, 16, 2) 1280: input a wraps from batch
# ceil(8192 / 256) = 32 (wrong_tail); emulated, batches 32..39 come back wrong.
A, B = torch.randn(40, 16, 16, generator=torch.Generator().manual_seed(0)), torch.randn(40, 16, 2)
WANT = torch.bmm(A, B)
MODES = ("raise", "warn", "chunk")


def outcome(modes, emulated, call):
    """What the guards `modes` (outermost first) make of one call: 'raised', or (right?, warnings, per guard the
    calls it stopped or split)."""
    options = dict(index_bits=13, profile="2.14.0", devices=None if emulated else ("cpu",))
    with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if emulated:
            stack.enter_context(emulate(index_bits=13, profile="2.14.0"))
        guards = [stack.enter_context(mpsimpact.guard(mode, **options)) for mode in modes]
        try:
            out = call()
        except OversizedOpError:
            return "raised"
        right = torch.allclose(out, WANT, atol=1e-5)
    return right, len(said), [len(g.stopped) + len(g.chunked) for g in guards]


CALLS = {"@": lambda: A @ B, "matmul": lambda: torch.matmul(A, B), "bmm": lambda: torch.bmm(A, B)}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("emulated", [False, True], ids=["plain", "emulated"])
@pytest.mark.parametrize(("outer", "inner"), list(itertools.permutations(MODES, 2)))
def test_the_inner_guard_decides_as_if_it_were_alone(outer, inner, emulated, call):
    nested = outcome((outer, inner), emulated, CALLS[call])
    alone = outcome((inner,), emulated, CALLS[call])
    if alone == "raised":
        assert nested == "raised"
    else:
        assert nested[:2] == alone[:2] and nested[2] == [0, *alone[2]], (nested, alone)
    if inner == "chunk":
        assert nested[0] is True and nested[2] == [0, 1]  # split, right values, the outer never saw it


def test_chunk_around_raise_raises_with_and_without_emulation():
    # The case: before, without emulation the outer chunk split the call and the inner raise never saw it.
    assert outcome(("chunk", "raise"), False, CALLS["@"]) == outcome(("chunk", "raise"), True, CALLS["@"]) == "raised"


def test_raise_around_chunk_splits_and_the_outer_decides_again_after():
    options = dict(index_bits=13, profile="2.14.0", devices=("cpu",))
    with mpsimpact.guard("raise", **options) as outer:
        with mpsimpact.guard("chunk", **options) as inner:
            assert torch.allclose(A @ B, WANT, atol=1e-5)
        with pytest.raises(OversizedOpError):
            A @ B  # the inner guard left: the outer one decides again
    assert (len(inner.chunked), len(outer.stopped)) == (1, 1)


def test_a_thread_guard_inside_a_guard_block_decides():
    options = dict(index_bits=13, profile="2.14.0", devices=("cpu",))
    with mpsimpact.guard("raise", **options):
        installed = mpsimpact.install_thread_guard("chunk", **options)
        try:
            assert torch.allclose(A @ B, WANT, atol=1e-5) and len(installed.chunked) == 1
        finally:
            mpsimpact.uninstall_thread_guard()
        with pytest.raises(OversizedOpError):
            A @ B
