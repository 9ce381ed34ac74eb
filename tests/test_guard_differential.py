"""The guard never makes a value wrong, judged on cases nobody here wrote: PyTorch's own OpInfo sample
inputs (torch.testing._internal.common_methods_invocations.op_db) for every op the guard can see, forward
and backward.

- At MPS's width (32 bits) nothing in a sample comes near a limit: under raise and chunk every value and
  gradient is bitwise the plain call's; under strict raise and strict chunk too, within float rounding:
  while any dispatch mode is active, torch's composite kernels take their tensor-subclass branches
  (`isTensorSubclassLike`: matmul folds a broadcast batch into one mm, linear on 3-D input becomes
  matmul + add instead of addmm), so a no-op TorchDispatchMode changes the last bits as strict does.
- At 4 bits (LIMIT 16, VIEW_LIMIT 8, DIM_MAX 7) under `emulate` every operand crosses a limit, and
  guard "chunk" splits whatever it can: each sample gives the plain values (within the dtype's
  tolerance: a split sums in another order), or a stop; never other values.
- Our own SDPA cases for the arguments OpInfo's samples leave out: boolean masks (2-D, broadcast over
  heads, per head, fully masked rows), `scale`, `enable_gqa`, under strict chunk with gradients and
  under chunk at a narrow width.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mpsimpact.errors import EmulatedMpsError, NotEmulatedError, OversizedOpError
from mpsimpact.modes.emulator import emulate
from mpsimpact.modes.guard import guard

from torch.testing._internal.common_methods_invocations import op_db  # needs expecttest (the test extra)

# Every op family the guard sees: products, cat/stack, SDPA, softmax, lookups, masked_fill, reductions,
# elementwise.
NAMES = (
    "matmul", "__rmatmul__", "bmm", "baddbmm", "mm", "addmm", "addbmm", "einsum", "tensordot",
    "nn.functional.linear", "cat", "stack", "hstack", "vstack", "nn.functional.scaled_dot_product_attention",
    "softmax", "log_softmax", "nn.functional.embedding", "index_select", "masked_fill", "sum", "mean", "amax",
    "amin", "prod", "add", "mul", "nn.functional.layer_norm",
)
INFOS = {op.name: op for op in op_db if op.name in NAMES and op.variant_test_name == ""}
STOPS = (OversizedOpError, EmulatedMpsError, NotEmulatedError)
NARROW = 4


def _public(op):
    """The op as users reach it, looked up at call time (the guard's wrappers are in place only while a
    guard is active; OpInfo took torch's callables when it was imported)."""
    for owner in (torch, F, torch.Tensor):
        name = op.name.rsplit(".", 1)[-1]
        if getattr(owner, name, None) is op.op:
            return lambda *args, **kwargs: getattr(owner, name)(*args, **kwargs)
    return op.op  # OpInfo's own lambdas (SDPA, einsum, embedding) look torch's names up when called


def samples(name, requires_grad):
    torch.manual_seed(0)
    return list(INFOS[name].sample_inputs("cpu", torch.float32, requires_grad=requires_grad))


def leaves(sample):
    return [x for x in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
            if isinstance(x, torch.Tensor) and x.requires_grad]


def evaluate(fn, sample, backward):
    """(outputs, gradients of a fixed weighted sum of the float outputs) of one sample."""
    torch.manual_seed(1)
    out = fn(sample.input, *sample.args, **sample.kwargs)
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if not backward:
        return [o.detach() for o in outs], []
    floats = [o for o in outs if o.is_floating_point() and o.requires_grad]
    inputs = leaves(sample)
    if not floats or not inputs:
        return [o.detach() for o in outs], []
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(2)) for o in floats]
    total = sum((o * w).sum() for o, w in zip(floats, weights))
    grads = torch.autograd.grad(total, inputs, allow_unused=True)
    return [o.detach() for o in outs], [g for g in grads if g is not None]


def same(got, want, exact):
    for x, y in zip(got, want, strict=True):
        if exact:
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(x, y, equal_nan=True)


MPS_WIDTH = {  # condition -> (guard, bitwise)
    "raise": (lambda: guard("raise", devices=("cpu",)), True),
    "chunk": (lambda: guard("chunk", devices=("cpu",)), True),
    "strict raise": (lambda: guard("raise", devices=("cpu",), strict=True), False),
    "strict chunk": (lambda: guard("chunk", devices=("cpu",), strict=True), False),
}


class _NoOpMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("name", NAMES)
def test_at_mps_width_every_guard_gives_the_plain_values_bitwise(name, backward):
    fn = _public(INFOS[name])
    for sample in samples(name, backward):
        want = evaluate(fn, sample, backward)
        for condition, (enter, bitwise) in MPS_WIDTH.items():
            with enter() as g:
                got = evaluate(fn, sample, backward)
            assert not g.stopped and not g.chunked, (condition, sample)
            if not bitwise:  # torch's own values under a dispatch mode that changes nothing
                with _NoOpMode():
                    got_plain = evaluate(fn, sample, backward)
                same(got[0], got_plain[0], exact=True)
                same(got[1], got_plain[1], exact=True)
            same(got[0], want[0], exact=bitwise)
            same(got[1], want[1], exact=bitwise)


TOO_SMALL = {"tensordot"}  # its samples hold at most 8 elements: at 4 bits (VIEW_LIMIT 8) none crosses
PROFILES = ("2.12.1", "2.13.0", "2.14.0")  # fused SDPA wrong; cat and 2.13.0's families; the published demo's
WIDTHS = (4, 6, 8)  # at 4 every operand crosses; wider, outputs stay below LIMIT where inputs pass it (rule 3)


@pytest.mark.parametrize("name", NAMES)
def test_at_a_narrow_width_chunk_gives_the_plain_values_or_a_stop(name):
    # The plain values under emulation are emulated MPS's at its own width (32 bits), where nothing faults:
    # with gradients MPS runs SDPA's math path, whose sums run in another order than this CPU's kernel.
    fn = _public(INFOS[name])
    acted = 0
    for backward, sample in [(b, s) for b in (False, True) for s in samples(name, b)]:
        for profile in PROFILES:
            with emulate(profile=profile):
                want = evaluate(fn, sample, backward)
            for bits in WIDTHS:
                try:
                    with emulate(index_bits=bits, profile=profile), guard("chunk") as g:
                        got = evaluate(fn, sample, backward)
                except STOPS:
                    acted += 1
                    continue
                acted += bool(g.chunked)
                same(got[0], want[0], exact=False)
                same(got[1], want[1], exact=False)
    assert acted or name in TOO_SMALL, f"{name}: no sample met a limit; the test saw nothing"


# SDPA's arguments that OpInfo's samples leave out. Shapes: (batch, heads, queries, dim), keys 7.
def sdpa_cases():
    def qkv(heads=4, kv_heads=4, queries=5, keys=7, batch=2, dim=8, value_dim=6):
        return (torch.randn(batch, heads, queries, dim), torch.randn(batch, kv_heads, keys, dim),
                torch.randn(batch, kv_heads, keys, value_dim))

    def bool_mask(*shape, hole=True):
        mask = torch.rand(*shape) > 0.4
        if hole and len(shape) >= 2:
            mask[..., 1, :] = False  # a fully masked query row
        return mask

    return {
        "bool 2-D": (qkv(), dict(attn_mask=bool_mask(5, 7))),
        "bool broadcast over heads": (qkv(), dict(attn_mask=bool_mask(2, 1, 5, 7))),
        "bool per head": (qkv(), dict(attn_mask=bool_mask(2, 4, 5, 7))),
        # 3 * 12 * 3 * 3 = 324 scores > 256; a piece of min(256 // 9, 127 // 6) = 21 rows of batch*heads:
        # one whole text (its 12 heads) a piece
        "pieces of whole texts": (qkv(batch=3, heads=12, kv_heads=12, queries=3, keys=3, dim=2, value_dim=2),
                                  dict(attn_mask=bool_mask(3, 12, 3, 3))),
        "3-D, no heads": ((torch.randn(4, 9, 4), torch.randn(4, 9, 4), torch.randn(4, 9, 4)),
                          dict(attn_mask=bool_mask(4, 9, 9))),
        "bool one row broadcast over queries": (qkv(), dict(attn_mask=bool_mask(2, 1, 1, 7, hole=False))),
        "bool, scale": (qkv(), dict(attn_mask=bool_mask(2, 1, 5, 7), scale=0.3)),
        "float mask, scale": (qkv(), dict(attn_mask=torch.randn(2, 4, 5, 7), scale=1.7)),
        "causal": (qkv(queries=7), dict(is_causal=True)),
        "causal, fewer queries than keys": (qkv(), dict(is_causal=True)),
        "gqa, bool mask": (qkv(kv_heads=2), dict(attn_mask=bool_mask(2, 1, 5, 7), enable_gqa=True)),
        "gqa, causal, scale": (qkv(heads=6, kv_heads=2, queries=7), dict(is_causal=True, enable_gqa=True, scale=0.5)),
        "gqa, positional mask": (qkv(kv_heads=1), dict(positional=(bool_mask(5, 7), 0.0, False), scale=0.25,
                                                       enable_gqa=True)),
    }


SDPA_CASES = sdpa_cases()


def sdpa_call(case, grad):
    (q, k, v), kwargs = SDPA_CASES[case]
    q, k, v = (x.clone().requires_grad_(grad) for x in (q, k, v))
    positional = kwargs.get("positional", ())
    rest = {key: value for key, value in kwargs.items() if key != "positional"}
    return (q, k, v), lambda: F.scaled_dot_product_attention(q, k, v, *positional, **rest)


def sdpa_values(case, grad, enter=contextlib.nullcontext):
    inputs, call = sdpa_call(case, grad)
    weights = torch.linspace(-1, 1, call().numel())  # made before any guard: not the guard's to judge
    with enter() as g:
        out = call()
        grads = torch.autograd.grad((out * weights.view(out.shape)).sum(), inputs) if grad else ()
    return out.detach(), grads, g


@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_under_strict_chunk_with_gradients_equals_the_plain_call(case):
    # At 8 bits (LIMIT 256) every call crosses: with gradients MPS runs SDPA's math path, which the strict
    # guard runs for it (so its dispatch mode sees the bmm calls) and splits.
    want = sdpa_values(case, True)
    got = sdpa_values(case, True, lambda: guard("chunk", index_bits=8, devices=("cpu",), strict=True))
    assert got[2].chunked, "nothing was split: the case does not test the guard"
    torch.testing.assert_close(got[0], want[0])
    for x, y in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(x, y)


@contextlib.contextmanager
def narrow_chunk(profile):
    with emulate(index_bits=8, profile=profile), guard("chunk") as g:
        yield g


@pytest.mark.parametrize(("profile", "grad"), [("2.12.1", False), ("2.12.1", True), ("2.14.0", True)],
                         ids=["2.12.1 fused", "2.12.1 math", "2.14.0 math"])
@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_under_chunk_at_a_narrow_width_equals_the_plain_call(case, profile, grad):
    # 2.12.1 without gradients: the fused kernel is wrong past LIMIT, so the guard splits it at its entry.
    # With gradients MPS runs the math path: its products are split (2.14.0's fused kernel is right, so
    # without gradients there is nothing to split).
    want = sdpa_values(case, grad)
    got = sdpa_values(case, grad, lambda: narrow_chunk(profile))
    assert got[2].chunked, "nothing was split: the case does not test the guard"
    torch.testing.assert_close(got[0], want[0])
    for x, y in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(x, y)


def test_sdpa_dropout_that_must_be_split_is_stopped_with_the_reason():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    with emulate(index_bits=8, profile="2.12.1"), guard("chunk"), pytest.raises(OversizedOpError) as error:
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert "dropout_p=0.5 draws one random mask, which no split reproduces" in str(error.value)


def test_transformers_models_with_left_padding_under_strict_chunk_with_gradients_equal_the_plain_ones():
    # transformers' own attention code: SDPA with a boolean padding mask, gradients on, so the strict
    # guard runs SDPA's math path (as MPS does). Before the mask was converted, Llama's logits moved by 0.19.
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, RobertaConfig, RobertaModel

    torch.manual_seed(0)
    sizes = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
    models = {
        "llama": LlamaForCausalLM(LlamaConfig(**sizes, num_key_value_heads=2, attn_implementation="sdpa")),
        "bert": BertModel(BertConfig(**sizes, attn_implementation="sdpa")),
        "roberta": RobertaModel(RobertaConfig(**sizes, attn_implementation="sdpa")),
    }
    ids = torch.randint(3, 99, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[1, :1] = 0  # left padding
    for name, model in models.items():
        model.eval()  # no dropout; the parameters still want gradients
        outputs = model(input_ids=ids, attention_mask=mask)
        want = outputs[0]
        with guard("chunk", devices=("cpu",), strict=True):
            got = model(input_ids=ids, attention_mask=mask)[0]
        torch.testing.assert_close(got, want, msg=name)
