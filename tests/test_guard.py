"""The guard under the emulator (LIMIT 2**20 = 1,048,576, VIEW_LIMIT 524,288): every outcome class
is stopped by raise, fixed by chunk, flagged once per site by warn."""

import warnings

import pytest
import torch

from mpsimpact.modes.emulator import emulate
from mpsimpact.errors import MpsImpactError, OversizedOpError
from mpsimpact.modes.guard import guard, install_thread_guard, uninstall_thread_guard
from mpsimpact.modes.guard_mode import MpsImpactWarning
from mpsimpact.modes.tracer import trace_module
from tiny import tiny_bert, token_batch

BITS = 20


def bmm(a, b):
    return torch.bmm(a, b)  # looked up when called: the guard's wrappers are in place only while it is active


def case_wrong_tail():
    # a (200, 64, 128): 1,638,400 > 2**20 elements, contiguous: wraps from 2**20 / 8192 = 128.
    return bmm, (torch.randn(200, 64, 128), torch.randn(200, 128, 2))


def case_wrong_all():
    # output 17 * 256 * 256 = 1,114,112 > 2**20 with a transposed: every batch wrong.
    return bmm, (torch.randn(17, 4, 256).transpose(1, 2), torch.randn(17, 4, 256))


def case_error():
    # b a transposed view of 2 * 256 * 1024 = 524,288 = 2**19 elements, output 4096: raises.
    return bmm, (torch.randn(2, 2, 256), torch.randn(2, 1024, 256).transpose(1, 2))


def case_abort():
    # a linear whose output has 1024 * 1024 = 2**20 elements: the process aborts on MPS.
    return torch.nn.functional.linear, (torch.randn(1024, 8), torch.randn(1024, 8), torch.randn(1024))


def case_baddbmm():
    return (lambda a, b, c: torch.baddbmm(c, a, b, alpha=0.5)), (torch.randn(200, 64, 128), torch.randn(200, 128, 2), torch.randn(200, 64, 2))


CASES = {"wrong_tail": case_wrong_tail, "wrong_all": case_wrong_all, "error": case_error, "abort": case_abort, "baddbmm": case_baddbmm}
# rows_per_safe_chunk(..., as_slices=True): a chunk s[i:j] is a view, so each operand must stay
# below VIEW_LIMIT (<= 2**19 - 1 = 524,287 elements) and the bmm output at or below 2**20; mm rows
# keep the output below 2**20.
SAFE_CHUNK = {
    "wrong_tail": 63,  # min(2**20 // (64*2) = 8192, 524287 // (64*128) = 63, 524287 // (128*2) = 2047)
    "wrong_all": 16,  # min(2**20 // (256*256) = 16, 524287 // (256*4) = 511 for a and for b)
    "error": 1,  # min(2**20 // (2*1024) = 512, 524287 // (2*256) = 1023, 524287 // (256*1024) = 1)
    "abort": 1023,  # addmm (1024, 8) @ (8, 1024): (2**20 - 1) // 1024 = 1023 rows
    "baddbmm": 63,  # the bmm of wrong_tail
}
# rows_safe_whole: a smaller batch of the same code runs the call whole, where a contiguous operand may hold up to
# LIMIT (2**20): wrong_tail's a, 2**20 // (64*128) = 128 batches (from 128 it wraps); elsewhere the chunk's own bound
# (a view's, the output's, the mm's) is the whole call's too, and the error says the chunk alone.
SAFE_BATCH = {"wrong_tail": 128, "wrong_all": 16, "error": 1, "abort": 1023, "baddbmm": 128}


@pytest.mark.parametrize("name", CASES)
def test_raise_stops_every_outcome_before_it_runs(name):
    op, args = CASES[name]()
    with emulate(index_bits=BITS) as emu, guard("raise") as g, pytest.raises(OversizedOpError) as info:
        op(*args)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, MpsImpactError)
    assert info.value.fields["safe_chunk"] == SAFE_CHUNK[name] and info.value.fields["safe_batch"] == SAFE_BATCH[name]
    if SAFE_BATCH[name] > SAFE_CHUNK[name]:
        assert (f"It runs correctly on at most {SAFE_BATCH[name]} batches at once: lower the batch size so that it "
                f"gets no more, or use guard mode 'chunk' (its pieces, slices of the batch, hold at most "
                f"{SAFE_CHUNK[name]}).") in str(info.value)
    else:
        assert f"The largest safe chunk for this op is {SAFE_CHUNK[name]} " in str(info.value)
    assert emu.records == [] and len(g.stopped) == 1  # the emulator never computed a wrong value


@pytest.mark.parametrize("name", CASES)
def test_chunk_fixes_every_outcome(name):
    op, args = CASES[name]()
    expected = op(*args)  # plain CPU
    with emulate(index_bits=BITS) as emu, guard("chunk") as g:
        got = op(*args)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert emu.records == [] and len(g.chunked) == 1


def test_warn_warns_once_per_site_with_the_error_text():
    op, args = case_wrong_tail()
    with emulate(index_bits=BITS), guard("raise"), pytest.raises(OversizedOpError) as info:
        op(*args)
    with emulate(index_bits=BITS) as emu, guard("warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            got = op(*args)
    ours = [w for w in caught if issubclass(w.category, MpsImpactWarning)]
    assert len(ours) == 1 and str(ours[0].message) == str(info.value)
    assert len(emu.records) == 3  # warn lets the fault through, as MPS would compute it
    assert not torch.allclose(got, op(*args))


def test_guard_ignores_cpu_tensors_outside_emulation_unless_asked():
    op, args = case_wrong_tail()
    with guard("raise"):
        op(*args)  # CPU tensors, no emulator: nothing to guard
    with guard("raise", index_bits=BITS, devices=("cpu",)), pytest.raises(OversizedOpError):
        op(*args)


def test_a_name_bound_before_the_guard_is_seen_by_strict_only():
    # The wrappers stand in for torch.bmm only while a guard is active (so the import alone leaves torch as it
    # is): a name bound to torch's own callable earlier reaches the kernel past the fast path.
    early, (a, b) = torch.bmm, case_wrong_tail()[1]
    with guard("raise", index_bits=BITS, devices=("cpu",)) as g:
        assert torch.bmm is not early
        early(a, b)
    assert not g.stopped
    with guard("raise", index_bits=BITS, devices=("cpu",), strict=True), pytest.raises(OversizedOpError):
        early(a, b)
    assert torch.bmm is early  # the last guard has left: torch's own again


def test_emulate_inside_a_guard_is_refused():
    with guard("raise"), pytest.raises(MpsImpactError, match="enter emulate"):
        with emulate(index_bits=BITS):
            pass


def test_install_thread_guard_reads_the_environment(monkeypatch):
    op, args = case_wrong_tail()
    monkeypatch.setenv("MPSIMPACT_GUARD", "off")
    assert install_thread_guard() is None
    expected = torch.bmm(*args)
    monkeypatch.setenv("MPSIMPACT_GUARD", "chunk")
    installed = install_thread_guard(index_bits=BITS, devices=("cpu",))
    try:
        torch.testing.assert_close(op(*args), expected)
        assert installed.mode == "chunk" and len(installed.chunked) == 1
    finally:
        uninstall_thread_guard()
    op(*args)  # uninstalled: no guard left behind


def test_bad_guard_mode_is_a_clear_error():
    with pytest.raises(MpsImpactError, match="Guard mode must be one of raise, warn, chunk, got 'chunks'"):
        with guard("chunks"):
            pass


def bert_outputs(model, ids, **emulation):
    with torch.inference_mode():
        with emulate(**emulation) as emu, guard("chunk") as g:
            out = model(input_ids=ids).last_hidden_state
    return out, emu, g


# The tiny BERT tests run under 2.14.0, where the P V wrap alone decides: on 2.13.0 the scale and softmax
# on the scores (more than 2**16 elements here) abort first (tests/test_op_integration.py chunks those too).
def test_tiny_bert_chunk_matches_plain_and_raise_stops_first():
    model, ids = tiny_bert(), token_batch(10, 64)
    with torch.inference_mode():
        plain = model(input_ids=ids).last_hidden_state
        with emulate(index_bits=16, profile="2.14.0") as emu, guard("raise"), pytest.raises(
                OversizedOpError, match=r"wrong values from sample 4 of the first dimension onward \(bmm batch 16"):
            model(input_ids=ids)
        assert emu.records == []
    out, emu, g = bert_outputs(model, ids, index_bits=16, profile="2.14.0")
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)
    assert emu.records == [] and len(g.chunked) == 2  # the two P V products


def test_chunk_under_plan_replay_consumes_the_plan_and_is_correct():
    ids = token_batch(10, 64)
    ids_meta = torch.zeros(10, 64, dtype=torch.long, device="meta")
    plan = trace_module(tiny_bert("meta"), {"input_ids": ids_meta}, index_bits=16, profile="2.14.0")
    model, short = tiny_bert(), ids[:, :16]
    with torch.inference_mode():
        plain = model(input_ids=short).last_hidden_state
    out, emu, g = bert_outputs(model, short, plan=plan)
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)
    assert emu.calls == len(plan.products) and len(g.chunked) == 2


def test_registered_attention_implementation_is_correct_under_emulation():
    from mpsimpact.attention import register

    name = register()
    plain_model = tiny_bert()
    safe_model = tiny_bert()
    safe_model.load_state_dict(plain_model.state_dict())
    safe_model.set_attn_implementation(name)
    ids = token_batch(10, 64)
    mask = torch.ones_like(ids)
    mask[:, 50:] = 0
    with torch.inference_mode():
        plain = plain_model(input_ids=ids, attention_mask=mask).last_hidden_state
        with emulate(index_bits=16, profile="2.14.0") as safe_emu:
            got = safe_model(input_ids=ids, attention_mask=mask).last_hidden_state
        with emulate(index_bits=16, profile="2.14.0") as eager_emu:
            broken = plain_model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    assert safe_emu.records == []
    # The same weights with plain eager attention fault in both P V products.
    assert len(eager_emu.records) == 2 and not torch.allclose(broken, plain, atol=1e-3)


def test_safe_eager_splits_one_text_over_its_heads_when_a_text_is_too_big():
    from mpsimpact.attention import mps_safe_eager_attention, safe_rows

    # One text, 4 heads of 160 x 160 scores at 16 bits: P (4, 160, 160) = 102,400 > 65,536 elements
    # would wrap in P V; as slices every operand must stay below 32,768: 32767 // 25600 = 1 head a piece.
    q, k, v = (torch.randn(1, 4, 160, 8) for _ in range(3))
    module = torch.nn.Module().eval()
    with emulate(index_bits=16):
        assert safe_rows(q, k, v) == 1
    plain = torch.softmax(q @ k.transpose(2, 3) * 8**-0.5, dim=-1) @ v  # (1, 4, 160, 8)
    with emulate(index_bits=16) as emu:
        got, _ = mps_safe_eager_attention(module, q, k, v, None)
    torch.testing.assert_close(got, plain.transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert emu.records == []


@pytest.mark.parametrize("devices, judged", [(("cpu",), {"cpu"}), (("cpu", "meta"), {"cpu", "meta"}),
                                             (("cuda", "mps"), set()), (("meta", "xpu"), {"meta"})])
def test_the_guard_judges_the_devices_it_is_given_one_or_several(devices, judged):
    # At 12 bits (LIMIT 4096) a (8, 16, 64) operand (8192 elements) crosses; device flags read on the hot path,
    # or the device's type where a device has no flag (xpu).
    for device in ("cpu", "meta"):
        a, b, w = torch.randn(8, 16, 64, device=device), torch.randn(8, 64, 4, device=device), torch.randn(4, 64)
        with guard("raise", devices=devices, index_bits=12, profile="2.14.0"):
            for call in (lambda: torch.bmm(a, b), lambda: torch.nn.functional.linear(a, w.to(device))):
                if device in judged:
                    with pytest.raises(OversizedOpError):
                        call()
                else:
                    call()
