"""Strict mode gated (Note [Strict, gated] in modes/guard_mode.py): on a device that counts the bytes its tensors
hold, the dispatch mode watches every op only from a sighting of a tensor that could pass a limit. Here the
CPU stands in for such a device: its count is given (HELD_BYTES["cpu"]), everything else is the guard's."""

import pytest
import torch

import mpsimpact
from mpsimpact.errors import OversizedOpError
from mpsimpact.modes import guard_mode
from mpsimpact.modes.guard import guard
from tiny import tiny_bert, token_batch

BITS = 16  # LIMIT 65,536, VIEW_LIMIT 32,768 elements; tiny BERT's P is 4 * L * L a text


@pytest.fixture
def held(monkeypatch):
    """The bytes the CPU "holds", as MPS or CUDA would say (0 unless a test sets it)."""
    count = {"bytes": 0}
    monkeypatch.setitem(guard_mode.HELD_BYTES, "cpu", lambda: count["bytes"])
    return count


def stack_depths(model):
    """The dispatch stack's depth at each layer's start during a forward."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: seen.append(torch._C._len_torch_dispatch_stack()))
             for layer in model.encoder.layer]
    return seen, hooks


def test_a_small_forward_runs_with_no_dispatch_mode_and_plain_values(held):
    model, ids = tiny_bert(), token_batch(2, 8)  # P: 2 * 4 * 64 = 512 elements
    with torch.no_grad():
        plain = model(ids).last_hidden_state
        seen, hooks = stack_depths(model)
        with guard("raise", index_bits=BITS, devices=("cpu",), strict=True) as g:
            got = model(ids).last_hidden_state
        assert not g.watching and g.stopped == []
    assert seen == [0, 0]
    assert torch.equal(got, plain)


def test_without_a_count_strict_watches_from_the_start(monkeypatch):
    monkeypatch.delitem(guard_mode.HELD_BYTES, "cpu", raising=False)
    model, ids = tiny_bert(), token_batch(2, 8)
    seen, hooks = stack_depths(model)
    with torch.no_grad(), guard("raise", index_bits=BITS, devices=("cpu",), strict=True) as g:
        model(ids)
        assert g.watching
    assert seen == [1, 1]


def test_held_bytes_at_entry_watch_from_the_start(held):
    held["bytes"] = 2**15  # VIEW_LIMIT at 16 bits: a tensor that could pass a limit may exist already
    early = torch.ones(2**16 + 8, dtype=torch.float16)  # made before the guard: no sighting of its birth
    with guard("raise", index_bits=BITS, devices=("cpu",), strict=True, profile="2.9.1") as g, \
            pytest.raises(OversizedOpError):
        assert g.watching
        early * 2  # elementwise past DIM_MAX (2.9.1 raises): only the dispatch mode sees it


def test_a_big_product_starts_watching_and_the_ops_after_it_are_judged_as_ungated(held, monkeypatch):
    # 6 texts of 64 tokens: P = 6 * 4 * 64 * 64 = 98,304 > LIMIT. Gated, the first Q K^T is the sighting; from
    # there every op is judged, so the records equal strict's when it watches from the start.
    model, ids = tiny_bert(), token_batch(6, 64)
    with torch.no_grad():
        plain = model(ids).last_hidden_state
        with guard("chunk", index_bits=BITS, devices=("cpu",), strict=True) as gated:
            got = model(ids).last_hidden_state
            assert gated.watching
        monkeypatch.delitem(guard_mode.HELD_BYTES, "cpu")
        with guard("chunk", index_bits=BITS, devices=("cpu",), strict=True) as always:
            model(ids)
    assert [(r.op, r.fault.rule) for r in gated.chunked] == [(r.op, r.fault.rule) for r in always.chunked]
    assert {r.op for r in gated.chunked} > {"bmm"}  # more than the products: softmax, the scale ...
    torch.testing.assert_close(got, plain)


@pytest.mark.parametrize("factory", [
    lambda: torch.ones(2**15 + 1, dtype=torch.uint8).sum(),
    lambda: torch.zeros((2**15 + 1,), dtype=torch.uint8).sum(),
    lambda: torch.full((2**15 + 1,), 3, dtype=torch.uint8).sum(),
    lambda: (torch.arange(2**15 + 1) % 1000)[torch.tensor([0, 2**15])],
    lambda: torch.randint(0, 5, (2**15 + 1,), dtype=torch.uint8).sum(),
    lambda: torch.empty(1).new_ones(2**15 + 1, dtype=torch.uint8).sum(),
], ids=["ones", "zeros", "full", "arange", "randint", "new_ones"])
def test_a_factory_past_the_view_limit_is_a_sighting(held, factory):
    with guard("raise", index_bits=BITS, devices=("cpu",), strict=True) as g:
        try:
            factory()
        except OversizedOpError:
            pass
        assert g.watching


def test_a_birth_no_entry_point_sees_is_judged_from_the_next_sighting(held):
    # The documented gap: a broadcast makes 2**16 + 2**9 elements from two small tensors. Gated, the
    # multiplication itself is not judged; the cat that takes it is a sighting, and from there every op is.
    a, b = torch.ones(2**8 + 2, dtype=torch.float16), torch.ones(2**8, dtype=torch.float16)
    with guard("raise", index_bits=BITS, devices=("cpu",), strict=True, profile="2.9.1") as g:
        outer = a[:, None] * b[None, :]  # elementwise past DIM_MAX: 2.9.1 raises; unseen here
        assert not g.watching
        with pytest.raises(OversizedOpError):
            torch.cat([outer.flatten(), outer.flatten()])
        assert g.watching


def test_another_mode_entered_inside_keeps_the_stack_and_the_calls_are_judged_one_by_one(held):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.ops += 1
            return func(*args, **(kwargs or {}))

    a, b = torch.randn(5, 128, 128), torch.randn(5, 128, 16)  # P V: P 81,920 > LIMIT, wrong from batch 4
    plain = torch.bmm(a, b)
    with guard("chunk", index_bits=BITS, devices=("cpu",), strict=True) as g:
        with Counting():
            got = torch.bmm(a, b)
            assert not g.watching  # it cannot go beneath Counting
        assert torch._C._len_torch_dispatch_stack() == 0
    assert Counting.ops > 0 and len(g.chunked) == 1
    torch.testing.assert_close(got, plain)


def test_the_installed_strict_guard_leaves_no_mode_behind(held):
    mpsimpact.install_thread_guard("raise", index_bits=BITS, devices=("cpu",), strict=True, profile="2.9.1")
    try:
        with pytest.raises(OversizedOpError):
            torch.ones(2**16 + 8, dtype=torch.float16) * 2
    finally:
        mpsimpact.uninstall_thread_guard()
    assert torch._C._len_torch_dispatch_stack() == 0


def test_the_factories_are_wrapped_only_while_a_gated_strict_guard_is_active(held):
    zeros, ones_like = torch.zeros, torch.ones_like
    with guard("raise", index_bits=BITS, devices=("cpu",)):
        assert torch.zeros is zeros  # the fast path has no factory to look at: it leaves them alone
        with guard("raise", index_bits=BITS, devices=("cpu",), strict=True):
            assert torch.zeros is not zeros and torch.ones_like is not ones_like
            assert torch.zeros.__wrapped__ is zeros and torch.zeros(2, 3).shape == (2, 3)
        assert torch.zeros is zeros
    assert torch.zeros is zeros and torch.ones_like is ones_like


def test_a_fast_guard_on_another_thread_lets_the_wrapped_factories_run(held, monkeypatch):
    # The factories are wrapped process-wide while this thread's gated strict guard is active; a raise guard
    # on another thread is that thread's only handler, and a factory is none of its business: it passes at
    # once (never handled, never through a dispatch mode).
    import threading

    made, errors, handled = {}, [], []
    on_entry = guard_mode.GuardMode.on_entry

    def recorded(self, name, proceed, args, kwargs):
        handled.append((threading.current_thread().name, name))
        return on_entry(self, name, proceed, args, kwargs)

    monkeypatch.setattr(guard_mode.GuardMode, "on_entry", recorded)

    def other():
        try:
            x = torch.ones(2, 3)
            with guard("raise", index_bits=BITS, devices=("cpu",)):
                made.update(zeros=torch.zeros(4, 5), like=torch.zeros_like(x), new=x.new_ones(3),
                            full=torch.full((2,), 7.0), arange=torch.arange(6), randint=torch.randint(0, 5, (3,)))
        except Exception as error:  # noqa: BLE001 - reported to the main thread
            errors.append(error)

    with guard("raise", index_bits=BITS, devices=("cpu",), strict=True):
        assert torch.zeros.__wrapped__ is not None
        thread = threading.Thread(target=other, name="other")
        thread.start()
        thread.join()
    assert errors == [] and [name for thread, name in handled if thread == "other"] == []
    assert {k: tuple(v.shape) for k, v in made.items()} == {
        "zeros": (4, 5), "like": (2, 3), "new": (3,), "full": (2,), "arange": (6,), "randint": (3,)}
    assert torch.equal(made["arange"], torch.arange(6)) and float(made["full"].sum()) == 14.0
