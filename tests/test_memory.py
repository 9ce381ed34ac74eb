"""Memory: the training-step estimate (by hand on a tiny config), the batch that fits, and the
saved-activation recomputation (bit for bit, and keeping what a dispatch mode altered)."""

import contextlib
import gc
import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpsimpact.models.classifier import SentenceClassifier
from mpsimpact.prediction.memory import estimate_training_bytes, largest_fitting_batch, training_step_parts
from mpsimpact.runs import activations
from mpsimpact.runs.activations import recompute_activations
from tiny import tiny_bert, token_batch

TINY = types.SimpleNamespace(vocab_size=10, hidden_size=8, num_attention_heads=2, num_hidden_layers=1, intermediate_size=16)
MINILM = types.SimpleNamespace(vocab_size=30522, hidden_size=384, num_attention_heads=12, num_hidden_layers=6, intermediate_size=1536)


def test_training_step_parts_by_hand():
    # B = 3, L = 4, D = 8, H = 2, I = 16, one layer; fp32.
    # parameters: (10 + 4) * 8 + 1 * (4 * 8 * 8 + 2 * 8 * 16) = 112 + 256 + 256 = 624
    # copies: reference (parameters, gradients) + trained (parameters, gradients, 2 Adam moments)
    #   = 6 * 624 * 4 = 14976
    # kept: per layer P (H L^2 = 32) + 3 hidden states (3 L D = 96) = 128, plus the embeddings'
    #   sum (L D = 32): 3 texts * (128 + 32) * 4 = 1920
    # working: 3 * max(scores-sized H L^2 = 32, feed-forward-sized L I = 64) * 3 texts * 4 = 2304
    assert training_step_parts(TINY, 3, 4) == {"copies": 14976, "kept": 1920, "working": 2304}
    assert estimate_training_bytes(TINY, 3, 4) == 14976 + 1920 + 2304
    # At L = 16 the attention dominates the working set: H L^2 = 512 > L I = 256.
    assert training_step_parts(TINY, 3, 16)["working"] == 3 * 512 * 3 * 4


def test_estimate_grows_with_batch_and_length():
    at = lambda batch, length: estimate_training_bytes(MINILM, batch, length)  # noqa: E731
    assert at(1024, 64) < at(2048, 64) < at(4096, 64)
    assert at(2048, 64) < at(2048, 128) < at(2048, 512)
    # Affine in the batch: what a text adds does not depend on how many there are.
    assert at(2048, 64) - at(1024, 64) == at(1024, 64) - at(0, 64)
    # The (B*H, L, L) term is quadratic in L: doubling L more than doubles what a text keeps.
    kept = lambda length: training_step_parts(MINILM, 1, length)["kept"]  # noqa: E731
    assert kept(512) > 2 * kept(256) > 4 * kept(128)


def test_largest_fitting_batch():
    estimate = lambda batch: 100 + 10 * batch  # noqa: E731
    assert largest_fitting_batch(estimate, 1000) == 90  # 100 + 10 * 90 = 1000
    assert largest_fitting_batch(estimate, 1009) == 90
    assert largest_fitting_batch(estimate, 50) == 0


def _step(model, ids, mask, context):
    """Logits and gradients of one cross-entropy step under `context`."""
    model.zero_grad(set_to_none=True)
    with context():
        logits = model(input_ids=ids, attention_mask=mask)
        torch.nn.functional.cross_entropy(logits, torch.arange(len(ids)) % 3).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def classifier(monkeypatch):
    # Every saved tensor of the tiny model is small: let all of them take recipes.
    monkeypatch.setattr(activations, "MIN_RECOMPUTED_BYTES", 0)
    model = SentenceClassifier(tiny_bert(hidden_size=32, intermediate_size=64)).train()
    ids = token_batch(6, 12)
    mask = (torch.arange(12)[None] < torch.tensor([[12], [9], [5], [12], [3], [7]])).long()
    return model, ids, mask


def _kept_kinds(model, ids, mask):
    """The producing ops of the saved tensors kept as tensors (not recipes) in one forward."""
    recomputer = activations._Recomputer((1e-12,), activations.MATMULS)
    kept = []

    def pack(tensor):
        saved = recomputer.pack(tensor)
        if not callable(saved) and tensor.grad_fn is not None:
            kept.append(type(activations._view_chain(tensor.grad_fn)[1]).__name__)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, recomputer.unpack):
        model(input_ids=ids, attention_mask=mask)
    return kept


def test_recomputed_step_equals_the_kept_one_bit_for_bit(classifier):
    model, ids, mask = classifier
    kept_logits, kept_grads = _step(model, ids, mask, contextlib.nullcontext)
    for trusted in (activations.MATMULS, frozenset()):
        logits, grads = _step(model, ids, mask, lambda: recompute_activations(model, trusted))
        assert torch.equal(logits, kept_logits)
        assert grads.keys() == kept_grads.keys() and all(torch.equal(grads[n], kept_grads[n]) for n in grads)
    kept = _kept_kinds(model, ids, mask)
    # Kept: P (softmax's output, and the view P V reads), the LayerNorm inputs (the embeddings'
    # sum and two per layer), weights and small tensors. Every LayerNorm, GELU and Linear output,
    # Q, K, V and the attention output are recomputed.
    assert kept.count("AddBackward0") == 1 + 2 * 2 and "SoftmaxBackward0" in kept
    assert not set(kept) & {"NativeLayerNormBackward0", "GeluBackward0", "AddmmBackward0", "BmmBackward0"}, kept


class _NudgeLastFeedForward(TorchDispatchMode):
    """Alters the output of the last layer's feed-forward input Linear in forward (as the emulator
    alters a faulted call), not the first layer's."""

    def __init__(self, inter):
        super().__init__()
        self.inter, self.seen = inter, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        forward = torch._C._current_autograd_node() is None
        if func is torch.ops.aten.addmm.default and forward and out.shape[-1] == self.inter:
            self.seen += 1
            out = out + 1e-3 if self.seen == 2 else out
        return out


@contextlib.contextmanager
def _nudged(model, trusted=None):
    with _NudgeLastFeedForward(64), recompute_activations(model, trusted) if trusted is not None else contextlib.nullcontext():
        yield


def test_an_altered_matmul_is_kept_not_recomputed(classifier):
    model, ids, mask = classifier
    _, altered = _step(model, ids, mask, lambda: _nudged(model))
    _, checked = _step(model, ids, mask, lambda: _nudged(model, frozenset()))
    assert all(torch.equal(checked[n], altered[n]) for n in altered)
    # Trusting the altered family recomputes the last layer's input from clean values (the first
    # layer's passed the check once): the gradients differ, which the check per tensor prevents.
    _, trusting = _step(model, ids, mask, lambda: _nudged(model, frozenset({"mm"})))
    assert any(not torch.equal(trusting[n], altered[n]) for n in altered)


class _StopInBackward(TorchDispatchMode):
    """Raises at the first bmm of backward, as emulated MPS does for a too-large transposed view."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bmm.default and torch._C._current_autograd_node() is not None:
            raise RuntimeError("stopped in backward")
        return func(*args, **(kwargs or {}))


def test_a_step_stopped_in_backward_leaves_no_activation_behind(classifier, monkeypatch):
    model, ids, mask = classifier
    packed = []
    pack = activations._Recomputer.pack
    monkeypatch.setattr(activations._Recomputer, "pack", lambda self, t: packed.append(weakref.ref(t)) or pack(self, t))
    with pytest.raises(RuntimeError, match="stopped in backward"):
        _step(model, ids, mask, lambda: _stopped(model))
    gc.collect()
    alive = [t for t in (ref() for ref in packed) if t is not None and t.requires_grad and not isinstance(t, torch.nn.Parameter)]
    # A kept tensor that its own node saved (softmax's P) must not hold that node: nothing survives.
    assert packed and not alive, [tuple(t.shape) for t in alive]


@contextlib.contextmanager
def _stopped(model):
    with _StopInBackward(), recompute_activations(model):
        yield


# Peak memory of a forward pass, measured: a subprocess resets its peak RSS (/proc/self/clear_refs, "5")
# after loading the model and warming up, runs one forward, and reports VmHWM - VmRSS (bytes above what was
# resident: the forward's own tensors). Large tensors are mmap'ed and unmapped when freed, so the high-water
# mark follows the live tensors.
MEASURE = """
import json, sys, torch, transformers
def status(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))
torch.set_num_threads(1)
config = transformers.LlamaConfig(**json.loads(sys.argv[1]))
model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager", dtype=config.dtype)
model.eval()
with torch.no_grad():
    model(torch.zeros(1, 8, dtype=torch.long))
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    model(torch.zeros(1, int(sys.argv[2]), dtype=torch.long))
    print(status("VmHWM") - before)
"""


LLAMA_FIELDS = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
                    num_key_value_heads=8, max_position_embeddings=2048)


def _traced_estimate(tmp_path, architecture, model_type, fields):
    """(estimate in bytes, its basis, the trace, the module's dtype) of `check`'s memory estimate at 1 x 2048."""
    import json

    from mpsimpact.config import CheckConfig
    from mpsimpact.prediction.check import prepare
    from mpsimpact.prediction.memory import traced_peak_bytes

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": model_type,
                                                      **fields}))
    model, info = prepare(CheckConfig(str(tmp_path), seq_len=2048, attention="eager"))
    plan = model.trace(1, 2048)
    estimate, basis = traced_peak_bytes(plan, info["parameters"], 1, 2048, 64, 8, model.module.dtype, False)
    return estimate, basis, plan, model.module.dtype, info["parameters"]


def _measured_peak(script, fields):
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", script, json.dumps(fields), "2048"], capture_output=True, text=True)
    if run.returncode != 0 and "clear_refs" in run.stderr:
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    assert run.returncode == 0, run.stderr
    return int(run.stdout)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_peak_estimate_knows_the_dtype_and_the_fp32_softmax(tmp_path, dtype):
    from mpsimpact.prediction.memory import largest_softmax

    # One layer, 8 heads, 2048 tokens: scores 8 * 2048**2 = 33,554,432 elements (64 MiB in bf16) dominate.
    # bf16: Llama's eager softmax(..., dtype=torch.float32) casts the scores to fp32 first, so the scores (2
    # bytes), their fp32 copy and P in fp32 (4 + 4) are live at once: 10 bytes a score, not 2 x 2 (traced).
    estimate, basis, plan, _, _ = _traced_estimate(tmp_path, "LlamaForCausalLM", "llama", {**LLAMA_FIELDS, "dtype": dtype})
    scores = 8 * 2048**2
    assert largest_softmax(plan).live_bytes == (10 if dtype == "bfloat16" else 8) * scores
    assert ("fp32" in basis) == (dtype == "bfloat16")
    assert estimate >= largest_softmax(plan).live_bytes


@pytest.mark.slow  # two fresh processes each import torch and transformers and run a 2048-token layer
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_peak_estimate_against_a_measured_peak(tmp_path, dtype):
    from mpsimpact.prediction.memory import peak_bytes

    fields = {**LLAMA_FIELDS, "dtype": dtype}
    measured = _measured_peak(MEASURE, fields)
    estimate, _, _, _, parameters = _traced_estimate(tmp_path, "LlamaForCausalLM", "llama", fields)
    # Measured 331 MiB on a 2-core CPU, estimated 329 MiB; fp32: 279 against 274 (the rest: RoPE tables, the
    # (L, D) activations, allocator slack). 15 % either side covers those; the old estimate is 2.5x low.
    print(f"{dtype}: estimate {estimate / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB")
    assert 0.85 < estimate / measured < 1.15, (estimate, measured)
    if dtype == "bfloat16":
        scores = 8 * 2048**2
        without_upcast = peak_bytes(parameters, 2048 * 64, scores, 8, 2048 * 128, 2)
        assert without_upcast / measured < 0.5


MEASURE_FALCON = MEASURE.replace("LlamaConfig", "FalconConfig").replace("LlamaForCausalLM", "FalconForCausalLM")


FALCON_FIELDS = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
                     max_position_embeddings=2048)


def _falcon_has_its_own_eager() -> bool:
    """Older transformers: Falcon's own eager attention (softmax(scores + mask, dtype=model dtype));
    later releases give Falcon Llama's shared eager_attention_forward (softmax in fp32, then cast back)."""
    from transformers.models.falcon import modeling_falcon

    return not hasattr(modeling_falcon, "eager_attention_forward")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_peak_estimate_counts_what_falcons_softmax_keeps_alive(tmp_path, dtype):
    from mpsimpact.prediction.memory import largest_softmax

    # Falcon's own eager attention: scores = q @ k^T; scores /= sqrt(d); softmax(scores + mask, dtype=model
    # dtype): while softmax runs, the scores (still named), their masked sum (its input) and the output are
    # alive: 3 score-sized tensors, not the 2 the formula assumes. Where Falcon uses the shared eager code,
    # what is alive is Llama's: bf16 scores, their fp32 copy and fp32 P (10 bytes a score), fp32 4 + 4.
    # One layer, 8 heads, 2048 tokens; the count is the trace's, whichever code transformers has.
    estimate, basis, plan, module_dtype, _ = _traced_estimate(tmp_path, "FalconForCausalLM", "falcon",
                                                              {**FALCON_FIELDS, "dtype": dtype})
    scores, size = 8 * 2048**2, module_dtype.itemsize
    per_score = 3 * size if _falcon_has_its_own_eager() else (10 if dtype == "bfloat16" else 8)
    assert largest_softmax(plan).live_bytes == per_score * scores  # traced, not assumed
    if _falcon_has_its_own_eager():  # more than the formula counts: the basis says so
        assert f"keeps {per_score} bytes a score alive" in basis
    else:
        assert ("fp32" in basis) == (dtype == "bfloat16")
    assert estimate >= per_score * scores


@pytest.mark.slow  # two fresh processes each import torch and transformers and run a 2048-token layer
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_falcon_estimate_against_a_measured_peak(tmp_path, dtype):
    from mpsimpact.prediction.memory import peak_bytes

    fields = {**FALCON_FIELDS, "dtype": dtype}
    measured = _measured_peak(MEASURE_FALCON, fields)
    estimate, _, _, module_dtype, parameters = _traced_estimate(tmp_path, "FalconForCausalLM", "falcon", fields)
    scores, size = 8 * 2048**2, module_dtype.itemsize
    # Measured on a 2-core CPU: bf16 203 MiB, estimated 201; fp32 404, estimated 402. The two-tensor formula
    # alone says 137 and 274 MiB: a third low.
    print(f"{dtype}: estimate {estimate / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB")
    assert 0.9 < estimate / measured < 1.1, (estimate, measured)
    if _falcon_has_its_own_eager():  # the shared eager code is Llama's, measured above
        formula = peak_bytes(parameters, 2048 * 64, scores, 8, 2048 * 64 * 4, size)
        assert formula / measured < 0.8