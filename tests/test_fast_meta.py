"""The tracer's shortcut for pointwise and same-shape ops on meta tensors (modes/tracer.py, _fast_meta) traces
exactly what torch's own meta kernels trace: every call's op, operands (shape, stride, offset, dtype), fault,
module and phase, on architectures nobody tuned it to, forward and one training step."""

import pytest
import torch

from mpsimpact.config import CheckConfig
from mpsimpact.modes import tracer
from mpsimpact.prediction.check import prepare
from pathlib import Path

DATA = Path(__file__).parent / "data"


def signature(plan):
    return [(c.op, c.a, c.b, c.fault, c.module, c.phase) for c in plan.calls]


@pytest.mark.parametrize(("config", "workload"), [
    ("bert-base", "inference"), ("bert-base", "training"), ("llama-style-32k", "inference"),
    ("t5-base", "inference"), ("deberta-v3-base", "inference"),
])
def test_the_shortcut_traces_what_the_meta_kernels_trace(config, workload, monkeypatch):
    traces = []
    for shortcut in (True, False):
        if not shortcut:
            monkeypatch.setattr(tracer, "_fast_meta", lambda func, args, kwargs: func(*args, **kwargs))
        tracer._META_DTYPES.clear()
        tracer._STRIDED.clear()
        model, _ = prepare(CheckConfig(str(DATA / config / "config.json"), workload=workload))
        traces.append(signature(model.trace(2, 64)))
    assert len(traces[0]) > 100 and traces[0] == traces[1]


def test_a_signature_the_kernel_answers_otherwise_is_never_shortcut():
    # A transposed (non-contiguous) input: the kernel decides the output's strides itself.
    x = torch.empty(4, 8, device="meta").t()
    out = tracer._fast_meta(torch.ops.aten.mul.Tensor, (x, x), {})
    assert out.stride() == torch.mul(x, x).stride() and not out.is_contiguous()
    # int / int is a float: the dtype comes from the kernel's first answer, then from the cache.
    a = torch.empty(3, 5, dtype=torch.int64, device="meta")
    for _ in range(2):
        assert tracer._fast_meta(torch.ops.aten.div.Tensor, (a, a), {}).dtype == torch.float32
    assert tracer._fast_meta(torch.ops.aten.div.Tensor_mode, (a, a), {"rounding_mode": "floor"}).dtype == torch.int64


@pytest.mark.parametrize(("op", "args", "kwargs"), [
    (torch.ops.aten.cat.default, ("float32 float32", 1), {}), (torch.ops.aten.cat.default, ("float32 float16", 1), {}),
    (torch.ops.aten.mean.dim, ("float16", [-1], True), {}), (torch.ops.aten.mean.dim, ("float16", [0, 2]), {"dtype": torch.float32}),
    (torch.ops.aten.sum.dim_IntList, ("bfloat16", [1]), {}), (torch.ops.aten.native_layer_norm.default, ("bfloat16", [4], None, None, 1e-5), {}),
    (torch.ops.aten.add.Tensor, ("int64 float16",), {"alpha": 2}), (torch.ops.aten.where.self, ("bool float32 float16",), {}),
])
def test_each_shortcut_answers_what_the_kernel_answers(op, args, kwargs):
    def tensors(spec):
        return [torch.empty(2, 3, 4, dtype=getattr(torch, d), device="meta") for d in spec.split()]

    built = []
    for arg in args:
        if isinstance(arg, str):
            made = tensors(arg)
            built += [made] if op is torch.ops.aten.cat.default else made
        else:
            built.append(arg)
    tracer._META_DTYPES.clear()
    ref = op(*built, **kwargs)
    for _ in range(2):  # the kernel's answer the first time, the shortcut's after
        got = tracer._fast_meta(op, tuple(built), kwargs)
        for x, y in zip(tracer.outputs_of(got), tracer.outputs_of(ref), strict=True):
            assert (x.shape, x.stride(), x.dtype) == (y.shape, y.stride(), y.dtype)
    assert list(tracer._META_DTYPES.values()) == [tuple(t.dtype for t in tracer.outputs_of(ref))]  # shortcut taken


def test_a_non_contiguous_call_is_answered_as_the_kernel_answered_it_the_first_time():
    tracer._STRIDED.clear()
    x = torch.empty(2, 16, 4, 8, device="meta").transpose(1, 2)  # (2, 4, 16, 8), strides of (2, 16, 4, 8)
    half = x[..., :4]  # RoPE's rotate_half reads halves of the last dim: offsets and strides of the whole
    for _ in range(2):  # the kernel's answer, then the kept one
        for func, args in ((torch.ops.aten.mul.Tensor, (x, x)), (torch.ops.aten.neg.default, (half,)),
                           (torch.ops.aten.add.Tensor, (x, x[:1]))):
            out, expected = tracer._fast_meta(func, args, {}), func(*args)
            assert (out.shape, out.stride(), out.dtype) == (expected.shape, expected.stride(), expected.dtype)
    assert len(tracer._STRIDED) == 3
    # An argument it cannot key (a Python object) or an output that is a view is never kept.
    assert tracer._strided_meta(torch.ops.aten.neg.default, (half,), {}).shape == half.shape
