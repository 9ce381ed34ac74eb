"""Memory: what a device pass or a training step needs, estimated from shapes alone (the preflight
checks it before anything big is allocated; plan, check and the Mac table show it), and whether a run fits the Mac
declared: the largest batch and the longest length that do, and MPS's own stop where it does not (Note [What fits
a Mac])."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from mpsimpact.attention.blocked import NAME as BLOCKED, samples_per_block
from mpsimpact.config import GIB
from mpsimpact.engine.call import CallRecord
from mpsimpact.engine.fault_plan import FaultPlan, runs_on_mps
from mpsimpact.engine.faults import MPS_INDEX_BITS
from mpsimpact.output.page import count_words

# What the training-step estimate counts, for the preflight's message.
TRAINING_PARTS = "activations kept for backward, gradients, Adam state"


def in_gib(n_bytes: int) -> float:
    """Bytes as GiB to one decimal: how plan, check and the demo tables state memory."""
    return round(n_bytes / GIB, 1)


def parameter_count(config: Any, length: int) -> int:
    """Parameters of a BERT-like encoder: embeddings (vocabulary and `length` positions) and layers."""
    hidden, inter = config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size)
    per_layer = 4 * hidden * hidden + 2 * hidden * inter
    return (config.vocab_size + length) * hidden + config.num_hidden_layers * per_layer


# Eager softmax with dtype=torch.float32 on 16-bit scores (the Llama family's `softmax(..., dtype=float32)
# .to(dtype)`): the input is cast to fp32 first, so while softmax runs the scores (model dtype), their fp32
# copy and P in fp32 are live: 2 + 4 + 4 bytes per score in bf16, against 2 + 2 without the upcast (2.5x).
UPCAST_BYTES = 4


def peak_bytes(parameters: int, states: int, attention: int, heads: int, feed_forward: int,
               dtype_bytes: int = 4, upcast: bool = False, softmax_live: int = 0) -> int:
    """The one estimate of an eager forward pass's peak, in bytes: the parameters, 4 hidden-state copies
    (`states` = B*L*D), and the larger of the attention peak (two of its largest tensor live at once,
    e.g. scores and P (B*H, L, L), plus the (B, 1, L, L) mask; with `upcast`, a 16-bit model whose eager
    softmax runs in fp32, the scores plus two fp32 copies) and the feed-forward peak (two of its
    largest output). Calibrated on the published 115 GiB peak of MiniLM-size emulation at B = 4096,
    L = 512 (this gives 112) and within 3 % below four H200 peaks (benchmarks/README.md); the upcast
    against a bf16 Llama's peak measured on CPU (tests/test_memory.py, within 2 %). `softmax_live`: the bytes
    of score-sized tensors a traced model keeps alive while its softmax runs (Falcon's bf16 eager attention
    holds the scores, their masked sum and the output: 3 x 2 bytes a score), counted where it is more."""
    per_score = dtype_bytes + 2 * UPCAST_BYTES if upcast else 2 * dtype_bytes
    mask = attention // heads * dtype_bytes
    attention_bytes = max(attention * per_score, softmax_live) + mask
    return dtype_bytes * (parameters + 4 * states) + max(attention_bytes, 2 * feed_forward * dtype_bytes)


def estimate_peak_bytes(config: Any, batch: int, length: int, dtype_bytes: int = 4, attention: str = "eager") -> int:
    """`peak_bytes` of a BERT-like encoder from its config alone (no trace); `blocked_peak_bytes` for
    blocked_eager attention."""
    if attention == BLOCKED:
        return blocked_peak_bytes(config, batch, length, dtype_bytes)
    hidden, heads = config.hidden_size, config.num_attention_heads
    inter = getattr(config, "intermediate_size", 4 * hidden)
    scores, feed_forward = batch * heads * length * length, batch * length * inter
    states = batch * length * hidden
    return peak_bytes(parameter_count(config, length), states, scores, heads, feed_forward, dtype_bytes)


# Token ids and the attention mask, as the tokenizer gives them to the device: int64.
ID_BYTES = 8


def blocked_peak_bytes(config: Any, batch: int, length: int, dtype_bytes: int = 4, samples: int | None = None) -> int:
    """The peak of a blocked_eager forward pass (Note [Blocked layers] in blocked_attention), counted from
    the tensors alive at it: the weights, the token ids and mask (int64) and the mask's one row per text,
    and the larger of
      - the product P V: P (B*H, L, L), V, the product's output and the hidden states (3 x B*L*D);
      - a fill step: P, V and the hidden states, and of one block of `samples` texts (default: the runs')
        the scores and their softmax (two (b, H, L, L) at once) and five (b, L, D): Q, K, V and matmul's
        copies of Q and K.
    Everything else (the embeddings, the emit steps, pooling) holds at most four (B, L, D) tensors and no
    P. Checked against a peak measured on a CPU (tests/test_blocked_attention.py); on a GPU,
    benchmarks/blocked_attention.py measures it beside this estimate."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    block = min(batch, samples or samples_per_block(heads, length))
    probs, states = batch * heads * length * length, batch * length * hidden
    product = probs + 3 * states
    fill = probs + 2 * states + 2 * block * heads * length * length + 5 * block * length * hidden
    tensors = parameter_count(config, length) + batch * length + max(product, fill)
    return dtype_bytes * tensors + 2 * ID_BYTES * batch * length


def largest_softmax(plan: Any) -> Any | None:
    """The traced forward's largest softmax call (the trace must hold every op: `every_op`), or None."""
    softmaxes = [c for c in plan.calls if c.phase == "forward" and c.family == "softmax"]
    return max(softmaxes, key=lambda c: c.b.numel, default=None)


def traced_peak_bytes(plan: Any, parameters: int, batch: int, length: int, hidden: int, heads: int,
                      dtype: Any, backward: bool) -> tuple[int, str]:
    """`peak_bytes` of any traced model (its largest bmm tensor and mm output from the plan, its softmax's
    dtype), and the basis of the estimate; a training step adds gradients and, per layer, what autograd
    keeps (P, mask, feed-forward outputs, 8 hidden-state copies)."""
    forward = [c for c in plan.calls if c.phase == "forward"]
    bmm = max((max(c.a.numel, c.b.numel, c.out_numel) for c in forward if c.family == "bmm"), default=0)
    mm = max((c.out_numel for c in forward if c.family == "mm"), default=0)
    layer_mm = max((c.out_numel for c in forward if c.family == "mm" and re.search(r"\.\d+\.", c.module)),
                   default=mm)
    softmax, states = largest_softmax(plan), batch * length * hidden
    # a 16-bit model whose largest softmax runs in fp32 (an eager softmax with dtype=torch.float32)
    upcast = softmax is not None and dtype.itemsize < UPCAST_BYTES and softmax.b.dtype == "float32"
    live = (softmax.live_bytes or 0) if softmax is not None and softmax.b.numel * 2 >= bmm else 0
    total = peak_bytes(parameters, states, bmm, heads, mm, dtype.itemsize, upcast, live)
    basis = (f"{str(dtype).removeprefix('torch.')}: weights ({count_words(parameters, 'parameters')}) + 4 "
             f"hidden-state copies + the larger of 2 x the largest bmm tensor ({count_words(bmm, 'elements')}) + "
             f"the L x L mask, and 2 x the largest mm output ({count_words(mm, 'elements')})")
    if upcast:
        basis += "; eager softmax runs in fp32 (dtype=torch.float32): the scores plus two fp32 copies"
    per_score = dtype.itemsize + 2 * UPCAST_BYTES if upcast else 2 * dtype.itemsize
    if live > bmm * per_score:
        basis += (f"; while its softmax runs the model keeps {live / max(softmax.b.numel, 1):.3g} bytes a score "
                  "alive (the scores, their masked sum, the output: traced)")
    if backward:
        layers = len({m[1] for c in forward if (m := re.match(r"^(.*?\.\d+)(\.|$)", c.module))}) or 1
        total += dtype.itemsize * (parameters + layers * (bmm + bmm // heads + 2 * layer_mm + 8 * states))
        basis += (f"; training adds gradients and, in each of {layers} layers, the tensors autograd keeps "
                  "(P, mask, FFN outputs, 8 hidden-state copies)")
    return total, basis + "; rough"


def training_step_parts(config: Any, batch: int, length: int, dtype_bytes: int = 4) -> dict[str, int]:
    """Bytes of one training step of `batch` texts at `length` tokens (the run length actually
    used), beyond the loaded model, by part, as `run_training` holds them under
    `recompute_activations`:

    - copies: the reference-trained copy (its parameters, its first-step gradients kept for the
      comparison) and one device-trained copy (parameters, gradients, Adam's two moments; Adam's
      are made only after backward has freed the activations, so this errs on the safe side);
    - kept: per layer, the attention probabilities P (B*H, L, L) and three hidden states of the
      block (B, L, D): the attention output and the two LayerNorm inputs (Q, K, V, the LayerNorm
      outputs and the feed-forward activations are recomputed), plus the embeddings' sum;
    - working: the layer being computed, forward or backward: three (B*H, L, L) tensors (scores,
      or P's and the scores' gradients) or three (B, L, I) ones (the feed-forward input, GELU's
      output and a gradient), whichever are larger.

    Calibrated on a 2-core CPU (MiniLM, L = 64, the index width scaled with B so that the faults
    are those of the default run): peak RSS above the loaded model measured 2.38 and 4.48 GiB at
    B = 512 and 1024, estimated 2.52 and 4.53 (+6%, +1%).
    """
    hidden, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    inter = getattr(config, "intermediate_size", 4 * hidden)
    per_layer = heads * length * length + 3 * length * hidden  # P, and three (L, D) hidden states
    return {
        "copies": dtype_bytes * 6 * parameter_count(config, length),
        "kept": dtype_bytes * batch * (layers * per_layer + length * hidden),
        "working": dtype_bytes * batch * 3 * max(heads * length * length, length * inter),
    }


def estimate_training_bytes(config: Any, batch: int, length: int, dtype_bytes: int = 4) -> int:
    """Peak bytes of a training run's step beyond the loaded model (see `training_step_parts`)."""
    return sum(training_step_parts(config, batch, length, dtype_bytes).values())


def largest_fitting_batch(estimate: Callable[[int], int], offered: int, ceiling: int = 1 << 40) -> int:
    """The largest batch B with estimate(B) <= offered, for an estimate that never falls as B grows (0 if
    none; `ceiling` if even that fits)."""
    return largest_batch_where(lambda batch: estimate(batch) <= offered, ceiling)


def largest_batch_where(fits: Callable[[int], bool], ceiling: int = 1 << 40) -> int:
    """The largest batch B in 1..ceiling with fits(B), for a `fits` that, once false, stays false as B grows
    (0 if none)."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high < ceiling and fits(high):
        low, high = high, 2 * high
    if high >= ceiling and fits(ceiling):
        return ceiling
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


# Note [What fits a Mac]
# ~~~~~~~~~~~~~~~~~~~~~~
# A run "fits" a Mac where each of its tensors is under the largest buffer (engine.mac_memory.buffer_refuses, judged
# call by call in the fault plan) and its estimated peak within MPS's high watermark (MacMemory.holds: the working
# set times PYTORCH_MPS_HIGH_WATERMARK_RATIO, 1.7 by default). Past the watermark MPS stops the process with "MPS
# backend out of memory" at the allocation that crosses it: the plan says so at the call that makes the run's
# largest tensor (FaultPlan.out_of_memory), and the prediction with it, before any other verdict. Between the working
# set and the watermark a run proceeds, swapping: it fits (it runs), and `plan --memory` sizes its demos within the
# working set all the same (prediction.demo_size). A "safe" size is one that is free of faults and fits: the largest
# safe batch and the longest safe length are the smaller of the index rules' (and the buffer's) answer and the
# largest size whose peak the Mac holds. Judged at MPS's own index width only: a narrowed run's weights do not
# shrink with its limits.


def run_peak(calls: Sequence[CallRecord], subject: Any, batch: int, length: int,
             profile: Any = None) -> tuple[int, str]:
    """The estimated peak of a real run of these calls at `batch` samples of `length` tokens, and its basis
    (`subject`: outcome.Subject, the model beyond its calls; `profile`: the release whose calls MPS runs, of a
    trace's two ways of one SDPA call, as its fault plan keeps them)."""
    kept = runs_on_mps(list(calls), profile) if profile is not None else list(calls)
    return traced_peak_bytes(FaultPlan(tuple(kept)), subject.parameters, batch, length, subject.hidden,
                             subject.heads, subject.dtype, subject.training)


def knows_peak(subject: Any) -> bool:
    """Whether the model is known well enough for a peak (its dtype and parameters: plan's and check's subjects)."""
    return subject.dtype is not None and subject.parameters > 0


def decided_on_memory(plan: FaultPlan, subject: Any, batch: int, length: int) -> FaultPlan:
    """The plan with MPS's out-of-memory stop where the run's peak passes the Mac's high watermark (Note [What fits
    a Mac]); the plan itself where no Mac is declared, the model is not known well enough, or the index is
    narrowed."""
    if plan.mac is None or plan.index_bits != MPS_INDEX_BITS or not knows_peak(subject):
        return plan
    return plan.out_of_memory(run_peak(plan.calls, subject, batch, length)[0])


def batch_fits(calls_at: Callable[[int], Sequence[CallRecord]], subject: Any, length: int, mac: Any,
               profile: Any, index_bits: int = MPS_INDEX_BITS) -> Callable[[int], bool] | None:
    """Whether a batch's run fits `mac` (its peak within the high watermark), `calls_at(batch)` the calls at that
    batch, for the batch searches (safe_size.cut_to_fit); None where nothing limits it: no Mac, no limit, the model
    not known well enough, a narrowed index."""
    if not _limits(mac, subject, index_bits):
        return None
    return lambda batch: mac.holds(run_peak(calls_at(batch), subject, batch, length, profile)[0])


def length_fits(subject: Any, batch: int, mac: Any, profile: Any,
                index_bits: int = MPS_INDEX_BITS) -> Callable[[Sequence[CallRecord], int], bool] | None:
    """Whether the calls at a length (and that length) fit `mac` at `batch` samples, for the length search
    (safe_size.longest_safe_length); None where nothing limits it (as `batch_fits`)."""
    if not _limits(mac, subject, index_bits):
        return None
    return lambda calls, length: mac.holds(run_peak(calls, subject, batch, length, profile)[0])


def _limits(mac: Any, subject: Any, index_bits: int) -> bool:
    return mac is not None and mac.high_watermark is not None and index_bits == MPS_INDEX_BITS and knows_peak(subject)
