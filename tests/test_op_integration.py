"""The op families through the modes (docs/fault-model.md, "Op families past INT_MAX"): the first-pass table
rebuilt on meta tensors by the tracer and by the strict guard; the index-width-20 cases under the emulator
and guard chunk on CPU tensors; a BERT FFN whose Linear passes the limit, split at the model level; and
fused SDPA, which the strict guard must not judge by its CPU or meta decomposition."""

import pytest
import torch
import torch.nn.functional as F

import mpsimpact
from mpsimpact.engine.release import INT_MAX_MESSAGE_TYPO, MEASURED_RELEASES
from mpsimpact.errors import EmulatedMpsError, NotEmulatedError, OversizedOpError
from test_op_families import CELLS, FIRST_PASS, C, E, O, W, matches
from tiny import tiny_bert, token_batch

N = 2**32 + 2**20  # the suite's 1-D size


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def ones(n, dtype):
    return torch.ones(n, dtype=dtype, device="meta")


def eager_attention():
    q, k, v = meta(5712, 12, 256, 64), meta(5712, 12, 256, 64), meta(5712, 12, 256, 64)
    return torch.softmax(q @ k.transpose(-1, -2) / 8, dim=-1) @ v  # scores (5712, 12, 256, 256): 4.49e9


def fused_sdpa():
    q = meta(5712, 12, 256, 64)
    with torch.no_grad():  # MPS's own op from 2.5.1; 2.4.1 (and with gradients) its math path
        return F.scaled_dot_product_attention(q, q, q)


def linear_input():
    return torch.nn.functional.linear(meta(67125249, 64), meta(32, 64), meta(32))  # input 4,296,015,936


def cat_1d():
    half = ones(2**31 + 2**19, torch.float16)  # two halves of 2**31 + 2**19: N in all
    return torch.cat([half, half])


def arange_index():
    x = torch.arange(N, device="meta") % 1000
    return x[torch.tensor([0, 2**32 + 5, N - 1], device="meta")]


def masked_fill_1d():
    return torch.zeros(2**32 + 16, dtype=torch.uint8, device="meta").masked_fill_(
        torch.zeros(2**32 + 16, dtype=torch.bool, device="meta"), 7)


# What each first-pass test runs, as a function on meta tensors at its real size (the same tests as
# tests/test_op_families.py's cell builders, which hand the rules specs; here the modes see the ops).
RUNS = {
    "bmm, contiguous, output (68544, 256, 256) fp32": lambda: torch.bmm(meta(68544, 256, 64),
                                                                        meta(68544, 64, 256)),
    "bmm, q @ k.transpose(1, 2)": lambda: torch.bmm(meta(65552, 256, 64),
                                                    meta(65552, 256, 64).transpose(1, 2)),
    "bmm, transposed first operand": lambda: torch.bmm(meta(65552, 64, 256).transpose(1, 2),
                                                       meta(65552, 64, 256)),
    "eager attention": eager_attention,
    "fused SDPA": fused_sdpa,
    "bmm, input (65552, 256, 256)": lambda: torch.bmm(meta(65552, 256, 256), meta(65552, 256, 64)),
    "Linear 64 -> 32 on (67125249, 64)": linear_input,
    "1-D fp16 ones(N) * 2 + 1": lambda: ones(N, torch.float16) * 2 + 1,
    "1-D uint8 ones(N).sum()": lambda: ones(N, torch.uint8).sum(),
    "(65552, 256, 256) fp16 transpose(1, 2).contiguous()": lambda: meta(65552, 256, 256, dtype=torch.float16)
    .transpose(1, 2).contiguous(),
    "1-D cat of two fp16 halves": cat_1d,
    "1-D int64 arange(N) % 1000, then x[[...]]": arange_index,
    "1-D uint8 zeros(2**32 + 16).masked_fill_": masked_fill_1d,
    "fp32 ones(1.5e9), (x * 2 + 1).sum()": lambda: (torch.ones(1_500_000_000, device="meta") * 2 + 1).sum(),
}


def traced_outcome(run, release):
    """As the suite judged a test, from the plan: the first abort is a crash, the first error an error;
    else any silent kind (unmeasured ones too) makes it WRONG; else ok."""
    plan = mpsimpact.trace_faults(run, profile=release)
    stop = plan.first_stop
    if stop is not None:
        return {"abort": C, "error": E}[stop.fault.kind]
    return W if plan.faults else O


def guard_stops(run, release):
    try:
        with mpsimpact.guard("raise", devices=("meta",), strict=True, profile=release):
            run()
    except OversizedOpError:
        return True
    return False


def test_every_first_pass_test_has_a_run():
    assert set(RUNS) == set(FIRST_PASS)


@pytest.mark.parametrize(("test", "column", "release"), CELLS)
def test_the_tracer_gives_every_cell_of_the_first_pass_table(test, column, release):
    assert matches(FIRST_PASS[test][1][column], traced_outcome(RUNS[test], release)), (test, release)


@pytest.mark.parametrize(("test", "column", "release"), CELLS)
def test_the_strict_guard_stops_exactly_the_cells_that_were_not_ok(test, column, release):
    expected = FIRST_PASS[test][1][column]
    stopped = guard_stops(RUNS[test], release)
    assert expected == "either" or stopped == (expected != O), (test, release, expected)


@pytest.mark.parametrize(("test", "column", "release"), CELLS)
def test_gated_the_strict_guard_stops_the_same_cells(test, column, release, monkeypatch):
    # meta made to count its bytes as MPS does (0 here): strict watches only from a sighting of a tensor that
    # could pass a limit (Note [Strict, gated]); every test of the table makes its tensors by a factory or a
    # product, so the stops are the same.
    from mpsimpact.modes import guard_mode

    monkeypatch.setitem(guard_mode.HELD_BYTES, "meta", lambda: 0)
    expected = FIRST_PASS[test][1][column]
    stopped = guard_stops(RUNS[test], release)
    assert expected == "either" or stopped == (expected != O), (test, release, expected)


def test_the_table_counts_and_the_check_can_fail():
    traced = sum(matches(FIRST_PASS[t][1][i], traced_outcome(RUNS[t], r)) for t, i, r in CELLS)
    assert (len(CELLS), traced) == (154, 154)
    # A run that makes no call past a limit is ok on every release, so a wrong run would not match.
    assert traced_outcome(lambda: ones(10, torch.float16) * 2 + 1, "2.8.0") == O != FIRST_PASS[
        "1-D fp16 ones(N) * 2 + 1"][1][MEASURED_RELEASES.index("2.8.0")]


def test_the_2_13_0_eager_attention_crash_is_the_scale_on_the_scores_inferred():
    plan = mpsimpact.trace_faults(eager_attention, profile="2.13.0")
    stop = plan.first_stop
    assert (stop.op, stop.fault.kind, stop.fault.rule, stop.fault.inferred) == (
        "div", "abort", "int32-kernel", True)
    assert "SIGSEGV" in stop.fault.message
    assert mpsimpact.trace_faults(eager_attention, profile="2.14.0").first_stop is None  # wrong, not a crash


# Index width 20 under emulate() on CPU tensors: LIMIT 2**20, DIM_MAX 2**19 - 1 = 524,287.
BITS = 20


def test_linear_whose_input_passes_the_limit_at_width_20():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 8)
    x = torch.randn(2**20 // 64 + 17, 64)  # 16401 rows: 1,049,664 > 2**20 input elements; output 131,208
    with torch.no_grad():
        plain = linear(x)
        with pytest.raises(EmulatedMpsError, match="aborts"):
            with mpsimpact.emulate(index_bits=BITS, profile="2.14.0"):
                linear(x)
        with mpsimpact.emulate(index_bits=BITS, profile="2.7.1") as emu:
            old = linear(x)
        with mpsimpact.emulate(index_bits=BITS, profile="2.14.0"), mpsimpact.guard("chunk") as guard:
            chunked = linear(x)
    assert torch.equal(old, plain) and emu.records == []
    torch.testing.assert_close(chunked, plain)
    assert [(r.op, r.fault.rule) for r in guard.chunked] == [("addmm", "mm-operand")]
    assert guard.chunk_sizes == [2**20 // 64]  # 16384 rows: 2**20 input elements a piece, at the limit


def test_uint8_sum_past_the_per_dimension_limit_at_width_20():
    n = 2**20 + 2**8  # 1,048,832: one dimension past 524,287, and past 2**20 elements
    with mpsimpact.emulate(index_bits=BITS, profile="2.13.0") as emu:
        wrapped = torch.ones(n, dtype=torch.uint8).sum()
    assert wrapped.item() == n % 2**20 == 256  # the sum of the first numel mod 2**20 elements
    assert [r.fault.rule for r in emu.records] == ["reduction-wrap"]
    with mpsimpact.emulate(index_bits=BITS, profile="2.13.0"), mpsimpact.guard("chunk") as guard:
        whole = torch.ones(n, dtype=torch.uint8).sum()
    assert whole.item() == n and [r.op for r in guard.chunked] == ["sum"]
    with mpsimpact.emulate(index_bits=BITS, profile="2.14.0"), pytest.raises(
            EmulatedMpsError, match=f"tensors requiring 64-bit indexing are not supported \\(numel={n}\\)"):
        torch.ones(n, dtype=torch.uint8).sum()


def test_fp16_elementwise_past_the_per_dimension_limit_at_width_20():
    x = torch.ones(2**20 + 2**8, dtype=torch.float16)  # made outside: its creation is a case of its own
    plain = x * 2 + 1
    with mpsimpact.emulate(index_bits=BITS, profile="2.11.0"), pytest.raises(EmulatedMpsError) as stop:
        x * 2 + 1
    assert INT_MAX_MESSAGE_TYPO in str(stop.value)  # "MPSGaph" (sic) on 2.9.1 .. 2.12.1
    with mpsimpact.emulate(index_bits=BITS, profile="2.12.1") as emu:
        new = x * 2 + 1
    assert torch.equal(new, plain) and emu.records == []
    with mpsimpact.emulate(index_bits=BITS, profile="2.11.0"), mpsimpact.guard("chunk") as guard:
        got = x * 2 + 1
    assert torch.equal(got, plain) and [r.op for r in guard.chunked] == ["mul", "add"]
    # Before 2.12.1 nobody saw the values of ones(N) on MPS: the emulator does not invent them.
    with pytest.raises(NotEmulatedError, match="unmeasured"), mpsimpact.emulate(index_bits=BITS,
                                                                               profile="2.11.0"):
        torch.ones(2**20 + 2**8, dtype=torch.float16)


@pytest.mark.parametrize("op", ["amax", "amin", "mean", "argmax", "argmin"])
def test_full_reductions_are_split_and_combined(op):
    torch.manual_seed(0)
    x = torch.randn(2**20 + 2**8)  # a dimension past DIM_MAX: 2.14.0's sum-64-bit check, inferred for these
    plain = getattr(x, op)()
    with mpsimpact.emulate(index_bits=BITS, profile="2.14.0"), mpsimpact.guard("chunk") as guard:
        got = getattr(x, op)()
    torch.testing.assert_close(got, plain)
    assert len(guard.chunked) == 1


def test_softmax_over_scores_past_the_limit_keeps_its_dimension_whole():
    scores = torch.randn(20, 4, 128, 128)  # 1,310,720 > 2**20 elements, every dimension small
    plain = torch.softmax(scores, dim=-1)
    with pytest.raises(EmulatedMpsError, match="SIGSEGV"):
        with mpsimpact.emulate(index_bits=BITS, profile="2.13.0"):
            torch.softmax(scores, dim=-1)
    with mpsimpact.emulate(index_bits=BITS, profile="2.13.0"), mpsimpact.guard("chunk") as guard:
        got = torch.softmax(scores, dim=-1)
    torch.testing.assert_close(got, plain)
    assert [r.op for r in guard.chunked] == ["_softmax"]


# The model level: the emulated 22000 x 128 sentiment run's structure, scaled to width 20. A BERT FFN whose
# first Linear's output passes the limit: 4 x 64 tokens x 4200 = 1,075,200 > 2**20 (its output aborts);
# GELU then runs on that activation (on 2.13.0 an abort above LIMIT, inferred) and the second Linear takes
# it whole as its input (> 2**20: an abort from 2.8.0). Splitting the first Linear alone is not enough.
def ffn_bert():
    return tiny_bert(intermediate_size=4200)


@pytest.mark.parametrize("release", ["2.13.0", "2.14.0"])
def test_chunk_splits_every_faulting_call_of_the_ffn_or_stops(release):
    model, ids = ffn_bert(), token_batch(4, 64)
    plan = mpsimpact.trace_module(ffn_bert().to("meta"), {"input_ids": ids.to("meta")}, index_bits=BITS,
                                  profile=release)
    faulting = [(c.op, c.fault.rule) for c in plan.faults]
    per_layer = [("addmm", "mm-encode")] + [("gelu", "int32-kernel")] * (release == "2.13.0") + [
        ("addmm", "mm-operand")]
    assert faulting == per_layer * 2
    with torch.inference_mode():
        plain = model(input_ids=ids).last_hidden_state
        with mpsimpact.emulate(index_bits=BITS, profile=release), pytest.raises(EmulatedMpsError):
            model(input_ids=ids)
        with mpsimpact.emulate(index_bits=BITS, profile=release) as emu, mpsimpact.guard("chunk") as guard:
            got = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    assert [(r.op, r.fault.rule) for r in guard.chunked] == faulting  # every faulting call split
    assert emu.records == []  # the emulator saw no call past a limit


def test_the_fast_path_splits_the_second_linear_by_its_input():
    # No emulator, no strict: the entry points cover products and Linear, Linear's input size included.
    model, ids = ffn_bert(), token_batch(4, 64)
    with torch.inference_mode():
        plain = model(input_ids=ids).last_hidden_state
        with mpsimpact.guard("chunk", index_bits=BITS, devices=("cpu",), profile="2.14.0") as guard:
            got = model(input_ids=ids).last_hidden_state
        with mpsimpact.guard("raise", index_bits=BITS, devices=("cpu",), profile="2.14.0"):
            with pytest.raises(OversizedOpError, match="mm-encode"):
                model(input_ids=ids)
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    assert [r.fault.rule for r in guard.chunked] == ["mm-encode", "mm-operand"] * 2


def test_a_call_with_no_split_stops_with_advice():
    x = torch.randn(2**20 + 2**8)
    with mpsimpact.emulate(index_bits=BITS, profile="2.14.0"), mpsimpact.guard("chunk"):
        with pytest.raises(OversizedOpError, match="No split is known for cumsum .* lower the batch size"):
            torch.cumsum(x, 0)  # 'other' family: nobody measured it past a limit; no split written


def test_a_replayed_plan_stops_or_chunks_the_other_families_at_full_scale_decisions():
    # Traced at 64 tokens on 2.13.0 (scores (10*4, 64, 64) = 163,840 > 2**16): the scale and softmax
    # abort; replayed at 16 tokens, where nothing is past a limit, the plan's decisions still hold.
    plan = mpsimpact.trace_module(tiny_bert("meta"), {"input_ids": torch.zeros(10, 64, dtype=torch.long,
                                                                                device="meta")},
                                  index_bits=16, profile="2.13.0")
    model, short = tiny_bert(), token_batch(10, 16)
    with torch.inference_mode():
        plain = model(input_ids=short).last_hidden_state
        with pytest.raises(EmulatedMpsError, match="mul.*SIGSEGV"), mpsimpact.emulate(plan=plan):
            model(input_ids=short)
        with mpsimpact.emulate(plan=plan) as emu, mpsimpact.guard("chunk") as guard:
            got = model(input_ids=short).last_hidden_state
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    assert [r.op for r in guard.chunked] == ["mul", "_softmax", "bmm"] * 2
    assert emu.calls == len(plan.products)


# Fused SDPA is correct on 2.13.0 and 2.14.0; on CPU and meta tensors torch runs it as other kernels
# (a flash kernel, or matmul/softmax/matmul), which the strict guard must not judge as MPS would.
@pytest.mark.parametrize("release", ["2.13.0", "2.14.0"])
def test_the_strict_guard_lets_fused_sdpa_through_where_it_is_correct(release):
    q, k, v = (torch.randn(2, 4, 128, 8) for _ in range(3))  # scores 131,072 > 2**16
    with torch.no_grad():
        plain = F.scaled_dot_product_attention(q, k, v)
        with mpsimpact.guard("raise", index_bits=16, devices=("cpu",), strict=True, profile=release) as guard:
            got = F.scaled_dot_product_attention(q, k, v)
        assert not guard_stops(fused_sdpa, release)
    torch.testing.assert_close(got, plain)
    assert guard.stopped == []
    with torch.no_grad(), pytest.raises(OversizedOpError, match="sdpa-fused"):
        with mpsimpact.guard("raise", index_bits=16, devices=("cpu",), strict=True, profile="2.12.1"):
            F.scaled_dot_product_attention(q, k, v)
