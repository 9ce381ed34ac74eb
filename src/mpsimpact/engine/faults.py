"""The MPS large-tensor fault rules: pure functions of shapes, strides, offsets and dtype.

The emulator, the guard, the tracer and the planner all decide through this module; none keeps a
private copy of a threshold. Here: the matrix products (`classify_bmm`, `classify_mm`, `classify_sdpa`)
and what every rule shares; engine.families has `classify_op`, the one entry for any aten op.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from mpsimpact.engine.release import (
    ENCODE_FAILED_MESSAGE, NDARRAY_ABORT_MESSAGE, FaultProfile, measured_profiles, takes_release,
    view_equal_limit_message,
)

__all__ = ["Fault", "TensorSpec", "classify_bmm", "classify_bmm_backward", "classify_mm", "classify_sdpa"]

# Note [MPS 32-bit index faults]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# PyTorch's MPS backend indexes bmm operands with 32-bit arithmetic (torch 2.4.1 .. 2.14.0; the
# facts are in docs/fault-model.md, from arXiv 2609.22991 and pytorch#197636). For
# a (B, M, K) @ b (B, K, N) with LIMIT = 2**index_bits and VIEW_LIMIT = 2**(index_bits - 1), the
# first rule that applies decides ("rule set B", torch 2.10 .. 2.14):
#   1. output numel > LIMIT: a transposed-view operand is read as if its storage were packed
#      row-major in the view's shape (strides ignored, storage offset kept): every batch wrong.
#      Without a transposed operand the result is correct. Terminal: rules 2 and 3 are skipped.
#   2. a view operand (transposed, or storage offset != 0) with numel >= VIEW_LIMIT raises
#      "MPSGraph does not support tensor dims larger than INT_MAX" before computing.
#   3. a contiguous non-view operand with numel > LIMIT wraps: batch i reads the `per` elements at
#      flat offset (i * per) mod LIMIT, so batches i >= ceil(LIMIT / per) are wrong.
#   4. otherwise correct.
# Older releases differ (release.FaultProfile, docs/fault-model.md "Per-release differences"):
# 2.4.1 is wrong in fp32 (not characterised) above LIMIT output elements whatever the layout, and
# truncates views of LIMIT elements or more; 2.5.1 .. 2.8.0 abort the process for views between
# VIEW_LIMIT and LIMIT of storage extent (offset + numel), raise at exactly LIMIT, and wrap views
# above it; 2.5.1 .. 2.9.1 count a slice's offset towards the view limit; 2.9.1 .. 2.12.1 misspell
# the error text. The backward products grad_a = G @ b^T and grad_b = a^T @ G follow the same rules
# (measured on 2.14.0; inferred elsewhere). A 2-D mm, addmm or Linear is judged on every operand and
# the output: from 2.8.0 an input of more than LIMIT elements aborts the process (measured: Linear 64 -> 32
# on 67,125,249 rows), and so does an output of LIMIT elements or more (measured on 2.14.0, inferred on
# 2.8.0 .. 2.13.0); before 2.8.0 that input is right and that output unmeasured. Another operand past
# LIMIT (a weight, a view such as the weight gradient's x^T) follows the input from 2.8.0 (inferred) and
# is unmeasured before (conservative, see Note [Op families past INT_MAX]). Below LIMIT, mm is taken as
# right whatever the layouts (not measured; bmm's view rule 2 is not applied to mm). Fused SDPA is
# wrong above LIMIT score elements on 2.5.1 .. 2.12.1 (values not characterised); with gradients, and
# on 2.4.1, SDPA is the math path (bmm rules).
# A profile measured by `mpsimpact sweep` (engine.profile_file) sets these per-release fields from its
# cells, and may find a rule gone (output_rule "correct", view_rule "none", input_wrap False); settings its
# cells left open are judged by the worst of them (`undecided`), aspects it did not measure as the
# conservative profile judges them (`conservative`).
# Only element counts matter: the wrap is an element index, the same for every dtype.
# Layouts the study did not measure (general strides, expanded batches) fault wherever a transposed
# view would (kind wrong_other, inferred): the guard stops them; the emulator computes them as the
# contiguous copy the strided read is inferred to equal, and says so.

FaultKind = Literal["ok", "error", "wrong_all", "wrong_tail", "abort", "truncated", "wrong_other", "undecided"]
Layout = Literal["contiguous", "offset", "transposed", "strided"]
SILENT_KINDS = frozenset({"wrong_all", "wrong_tail", "truncated", "wrong_other"})
STOP_KINDS = frozenset({"error", "abort"})
# The index width of MPS's kernels; every limit is a power of two of it (smaller widths scale them).
MPS_INDEX_BITS = 32
# The widths the planner and the CLI accept (the rules below take 2..62).
INDEX_BITS_RANGE = (8, MPS_INDEX_BITS)
# The widths the modes (guard, emulator, tracer) accept: narrower too, so that at 4 bits (LIMIT 16) every
# operand of PyTorch's OpInfo samples crosses a limit and a differential test sees the guard split all
# it can.
MODE_INDEX_BITS_RANGE = (4, MPS_INDEX_BITS)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """The metadata of one operand: all the fault rules ever look at."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0
    dtype: str = "float32"

    @classmethod
    def of(cls, tensor: Any) -> TensorSpec:
        """Reads the spec of a real, meta or fake tensor without touching its data."""
        return cls(tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()),
                   str(tensor.dtype).removeprefix("torch."))

    @classmethod
    def contiguous(cls, shape: tuple[int, ...], dtype: str = "float32") -> TensorSpec:
        return cls(tuple(shape), contiguous_strides(shape), 0, dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def per_batch(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def extent(self) -> int:
        """Elements of storage from its start to one past the last element this view reads."""
        if self.numel == 0:
            return self.storage_offset
        return self.storage_offset + 1 + sum((size - 1) * abs(step) for size, step in zip(self.shape, self.stride))

    def transpose(self) -> TensorSpec:
        """The spec of `.transpose(-1, -2)` of this operand (a view)."""
        shape = (*self.shape[:-2], self.shape[-1], self.shape[-2])
        stride = (*self.stride[:-2], self.stride[-1], self.stride[-2])
        return TensorSpec(shape, stride, self.storage_offset, self.dtype)

    @property
    def layout(self) -> Layout:
        if _is_dense(self.shape, self.stride):
            return "contiguous" if self.storage_offset == 0 else "offset"
        swapped = self.transpose()
        return "transposed" if _is_dense(swapped.shape, swapped.stride) else "strided"

    @property
    def is_view(self) -> bool:
        # A slice s[1:] of a contiguous tensor counts although is_contiguous() is True.
        return self.layout in ("offset", "transposed")

    def as_layout(self, layout: str) -> TensorSpec:
        """The same shape, dtype and offset in another layout (for unmeasured layouts)."""
        if layout == "transposed":
            swapped = TensorSpec.contiguous((*self.shape[:-2], self.shape[-1], self.shape[-2]), self.dtype)
            return dataclasses.replace(swapped.transpose(), storage_offset=self.storage_offset)
        return dataclasses.replace(TensorSpec.contiguous(self.shape, self.dtype), storage_offset=self.storage_offset)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "stride": list(self.stride), "storage_offset": self.storage_offset,
                "dtype": self.dtype}


@dataclasses.dataclass(frozen=True)
class Fault:
    """What MPS does with one op call (a matrix product, or any op of Note [Op families past INT_MAX]).

    Attributes:
        kind: "ok", "error" (raises before computing), "abort" (the process aborts), "wrong_all"
            (every batch wrong), "wrong_tail" (batches from `first_bad_batch` on wrong), "truncated"
            (2.4.1: mostly zeros) or "wrong_other" (wrong, pattern not characterised); "undecided" only on a
            tracer's record before FaultPlan.from_trace decides it (modes.tracer.UNDECIDED).
        operand: the operand that causes it: "a", "b", "ab" (both), "bias" (mm) or None.
        first_bad_batch: first wrong batch (0 for wrong_all), or None.
        message: the MPS error text for "error" and "abort", else "".
        rule: which rule decided: "output-transposed", "output-fp32", "view-int-max", "view-abort",
            "view-truncated", "input-wrap", "mm-encode", "mm-operand", "unmeasured-layout", "sdpa-fused",
            "dim-int-max:<family>", "reduction-wrap", "sum-64-bit", "masked-fill-numel", "int32-kernel",
            "cat-int32-offsets", "unmeasured:<family>", "conservative:<rule>" or "none".
        wrap_elements: the element period of the wrap (2**index_bits) for "wrong_tail", and for a
            "reduction-wrap" (the result is that of the first numel mod wrap_elements elements).
        release: the torch release whose profile decided ("" for ok).
        inferred: the decision rests on an inference, not a measurement (unmeasured layouts,
            backward outside 2.14.0, conservative profiles).
    """

    kind: FaultKind = "ok"
    operand: str | None = None
    first_bad_batch: int | None = None
    message: str = ""
    rule: str = "none"
    wrap_elements: int | None = None
    release: str = ""
    inferred: bool = False

    @property
    def is_ok(self) -> bool:
        return self.kind == "ok"

    @property
    def is_silent(self) -> bool:
        """Wrong values with no error."""
        return self.kind in SILENT_KINDS

    @property
    def is_stop(self) -> bool:
        """MPS raises or aborts: the run ends at this call."""
        return self.kind in STOP_KINDS

    @property
    def is_unmeasured(self) -> bool:
        """Nobody measured this call's case (rule unmeasured:<family>): judged conservatively (a plan says
        "unmeasured"). An unmeasured layout is not this: its value is inferred from a measured rule."""
        return self.rule.removeprefix("conservative:").startswith("unmeasured:")

    @property
    def nobody_measured(self) -> bool:
        """Nobody measured what MPS does here: an unmeasured case, or any call of an unmeasured release
        (rule conservative:<rule>): a speaker says "cannot tell", never what the rule guesses."""
        return self.is_unmeasured or self.rule.startswith("conservative")

    def to_json(self) -> dict[str, Any]:
        # Its fields are scalars: the dict dataclasses.asdict gives, without its recursive copy (a fit asks
        # for hundreds of thousands).
        return {name: getattr(self, name) for name in _FAULT_FIELDS}


_FAULT_FIELDS = tuple(field.name for field in dataclasses.fields(Fault))
OK = Fault()


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides for `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _is_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    # Same test as Tensor.is_contiguous(): size-1 dims may carry any stride.
    step = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != step:
            return False
        step *= size
    return True


def spec_of(x: Any) -> TensorSpec:
    return x if isinstance(x, TensorSpec) else TensorSpec.of(x)


def limits(index_bits: int) -> tuple[int, int]:
    """(LIMIT, VIEW_LIMIT) = (2**index_bits, 2**(index_bits - 1)). See Note [MPS 32-bit index faults]."""
    if not 2 <= index_bits <= 62:
        raise ValueError(f"index_bits must be in 2..62, got {index_bits}")
    return 1 << index_bits, 1 << (index_bits - 1)


def dim_max(index_bits: int) -> int:
    """DIM_MAX = 2**(index_bits - 1) - 1 (INT_MAX at 32 bits): the per-dimension limit. A call whose every
    tensor has at most this many elements is past no limit. See Note [Op families past INT_MAX]."""
    return limits(index_bits)[1] - 1


def wrap_start_batch(per: int, wrap_elements: int) -> int:
    """First batch whose flat offset wraps: ceil(wrap_elements / per)."""
    return -(-wrap_elements // per)


Profile = str | FaultProfile | None


@takes_release
def classify_bmm(a: Any, b: Any, *, index_bits: int = MPS_INDEX_BITS, profile: Profile = None) -> Fault:
    """Decides what MPS's bmm does with `a @ b`.

    Args:
        a: (B, M, K) operand: a tensor (real, meta or fake) or a `TensorSpec`.
        b: (B, K, N) operand, likewise.
        index_bits: the index width; every threshold scales with it.
        profile: a torch release ("2.12.1"), a `FaultProfile`, or None for the installed torch's.

    Returns:
        The `Fault`. See Note [MPS 32-bit index faults].
    """
    sa, sb = spec_of(a), spec_of(b)
    if profile.judges_conservatively("bmm"):
        return conservative(lambda p: classify_bmm(sa, sb, index_bits=index_bits, profile=p), profile)
    if profile.alternatives:
        return undecided(lambda p: classify_bmm(sa, sb, index_bits=index_bits, profile=p), profile)
    strided = "".join(name for name, s in (("a", sa), ("b", sb)) if s.layout == "strided")
    if not strided:
        return _classify_measured(sa, sb, index_bits, profile)
    # Unmeasured layouts: what a contiguous copy would get (the measured operands may decide alone);
    # if that is ok, still unsafe wherever a transposed view would not be.
    copy = {name: (s.as_layout("contiguous") if name in strided else s) for name, s in (("a", sa), ("b", sb))}
    fault = _classify_measured(copy["a"], copy["b"], index_bits, profile)
    if not fault.is_ok:
        return dataclasses.replace(fault, inferred=True) if set(fault.operand or "") & set(strided) else fault
    swap = {name: (s.as_layout("transposed") if name in strided else s) for name, s in (("a", sa), ("b", sb))}
    as_view = _classify_measured(swap["a"], swap["b"], index_bits, profile)
    if as_view.is_ok:
        return OK
    message = f"unmeasured layout (general strides); as a transposed view MPS would give {as_view.kind}"
    return Fault("wrong_other", strided, None, message, "unmeasured-layout", release=profile.release, inferred=True)


def _classify_measured(sa: TensorSpec, sb: TensorSpec, index_bits: int, profile: FaultProfile) -> Fault:
    limit, view_limit, release = *limits(index_bits), profile.release
    named = (("a", sa), ("b", sb))
    if sa.shape[0] * sa.shape[1] * sb.shape[2] > limit:  # rule 1, terminal
        if profile.output_rule == "correct":
            return OK
        if profile.output_rule == "fp32-wrong":
            return OK if sa.dtype == "float16" else Fault("wrong_other", rule="output-fp32", release=release)
        transposed = "".join(name for name, s in named if s.layout == "transposed")
        return Fault("wrong_all", transposed, 0, rule="output-transposed", release=release) if transposed else OK
    for name, s in named:
        if s.is_view and (fault := _view_fault(name, s, limit, view_limit, profile)) is not None:
            return fault
    if not profile.input_wrap:
        return OK
    wraps = profile.view_rule == "abort"  # 2.5.1 .. 2.8.0 wrap views above LIMIT too
    wrapped = [(name, s) for name, s in named if (wraps or not s.is_view) and s.numel > limit]
    firsts = {name: wrap_start_batch(s.per_batch, limit) for name, s in wrapped}
    firsts = {name: first for name, first in firsts.items() if first < sa.shape[0]}
    if not firsts:
        return OK
    return Fault("wrong_tail", "".join(firsts), min(firsts.values()), rule="input-wrap", wrap_elements=limit,
                 release=release)


def _view_fault(name: str, s: TensorSpec, limit: int, view_limit: int, profile: FaultProfile) -> Fault | None:
    """Rule 2, per release: what a view operand of this size does, or None if nothing."""
    size = s.extent if profile.slice_extent and s.layout == "offset" else s.numel
    release = profile.release
    if profile.view_rule == "none":
        return None
    if profile.view_rule == "truncate":
        return Fault("truncated", name, 0, rule="view-truncated", release=release) if s.numel >= limit else None
    if profile.view_rule == "abort":
        if s.numel > limit:
            return None  # wraps (rule 3)
        if size == limit:
            return Fault("error", name, None, view_equal_limit_message(profile), "view-int-max", release=release)
        if view_limit <= size < limit:
            return Fault("abort", name, None, NDARRAY_ABORT_MESSAGE, "view-abort", release=release)
        return None
    if size >= view_limit:
        return Fault("error", name, None, profile.view_message, "view-int-max", release=release)
    return None


def conservative(classify: Any, asked: FaultProfile) -> Fault:
    """An unmeasured release: unsafe if any measured release faults; the newest such fault, labelled
    with the release asked for and the measured one whose fault it is."""
    worst = next((f for f in map(classify, reversed(measured_profiles())) if not f.is_ok), None)
    return OK if worst is None else _judged_unmeasured(worst, f"{asked.release}, unmeasured: as on {worst.release}")


def _judged_unmeasured(worst: Fault, release: str) -> Fault:
    """A fault labelled as the conservative profile labels its faults (`release` says why)."""
    return dataclasses.replace(worst, rule=f"conservative:{worst.rule}", inferred=True, release=release)


# Where the settings a sweep left open disagree on a call, the worst decides: wrong values without an error
# before a stop, a stop before nothing (the order of this tuple, worst last).
_SEVERITY = ("ok", "error", "abort", "wrong_tail", "truncated", "wrong_all", "wrong_other")


def undecided(classify: Any, profile: FaultProfile) -> Fault:
    """A profile whose sweep left several settings of the bmm fields open (`FaultProfile.alternatives`):
    where they agree on a call, that decision, exactly; where they differ, the cells did not decide it:
    the worst of them, labelled as the conservative profile labels its faults."""
    faults = [classify(p) for p in profile.settings()]
    if all(f == faults[0] for f in faults):
        return faults[0]
    worst = max(faults, key=lambda f: _SEVERITY.index(f.kind))
    return _judged_unmeasured(worst, f"{profile.release}, unmeasured: its sweep left this call open")


@takes_release
def classify_bmm_backward(a: Any, b: Any, *, index_bits: int = MPS_INDEX_BITS, profile: Profile = None) -> tuple[Fault, Fault]:
    """Decides the two gradient products of `a @ b`: (grad_a = G @ b^T, grad_b = a^T @ G).

    G, the incoming gradient, is taken contiguous, as autograd produces it. Measured on 2.14.0;
    for other releases their forward rules are applied (inferred).
    """
    sa, sb = spec_of(a), spec_of(b)
    grad = TensorSpec.contiguous((sa.shape[0], sa.shape[1], sb.shape[2]), sa.dtype)
    faults = (classify_bmm(grad, sb.transpose(), index_bits=index_bits, profile=profile),
              classify_bmm(sa.transpose(), grad, index_bits=index_bits, profile=profile))
    measured = profile.release == "2.14.0"
    return tuple(f if f.is_ok or measured else dataclasses.replace(f, inferred=True) for f in faults)  # type: ignore


@takes_release
def classify_mm(a: Any, b: Any, *, bias: Any = None, index_bits: int = MPS_INDEX_BITS, profile: Profile = None) -> Fault:
    """Decides a 2-D `mm`/`addmm` on every operand and the output; for a Linear, `a` is its input rows,
    `b` the weight transposed and `bias` the added input. See Note [MPS 32-bit index faults]."""
    if profile.judges_conservatively("mm"):
        return conservative(lambda p: classify_mm(a, b, bias=bias, index_bits=index_bits, profile=p), profile)
    limit = limits(index_bits)[0]
    named = [("a", spec_of(a)), ("b", spec_of(b))] + ([("bias", spec_of(bias))] if bias is not None else [])
    out_numel = named[0][1].shape[0] * named[1][1].shape[1]
    if out_numel >= limit:
        if not profile.mm_aborts:
            return unmeasured("mm", profile, f"an output of {out_numel} elements")
        message = (f"[MPSNDArrayMatrixMultiplication encodeToCommandBuffer:] destination: output of mm with "
                   f"{out_numel} elements {ENCODE_FAILED_MESSAGE} (the process aborts)")
        return Fault("abort", None, None, message, "mm-encode", release=profile.release,
                     inferred=profile.release != "2.14.0")  # measured on 2.14.0
    for name, s in named:
        measured = name == "a" and s.layout == "contiguous"  # the first-pass Linear's input
        if s.numel <= limit or (measured and not profile.mm_aborts):  # such an input is right before 2.8.0
            continue
        if not profile.mm_aborts:
            return unmeasured("mm", profile, f"operand {name} ({s.layout}) of {s.numel} elements")
        how = "measured; its text was not recorded" if measured else "inferred from the input's"
        message = (f"operand {name} of mm with {s.numel} elements, more than 2**{index_bits}: the "
                   f"process aborts ({how})")
        return Fault("abort", name, None, message, "mm-operand", release=profile.release, inferred=not measured)
    return OK


def unmeasured(family: str, profile: FaultProfile, what: str) -> Fault:
    """Nobody measured this case on MPS: conservative (wrong_other, inferred); the guard stops it."""
    message = f"unmeasured: nobody measured {family} with {what} on MPS {profile.release}; judged conservatively"
    rule = f"unmeasured:{family}"
    return Fault("wrong_other", None, None, message, rule, release=profile.release, inferred=True)


@takes_release
def sdpa_path(needs_grad: bool, profile: Profile = None) -> str:
    """"fused" (MPS's own SDPA op) or "math" (matmul/softmax/matmul: the bmm rules decide).

    2.4.1 has no MPS SDPA op; with gradients SDPA takes the math path (inferred from upstream code).
    """
    fused = profile.sdpa_fused and not needs_grad and not profile.judges_conservatively("sdpa")
    return "fused" if fused else "math"


@takes_release
def classify_sdpa(query: Any, key: Any, *, index_bits: int = MPS_INDEX_BITS, profile: Profile = None) -> Fault:
    """Decides MPS's fused SDPA op: wrong above 2**index_bits score elements (B*H*Lq*Lk) on 2.5.1 ..
    2.12.1, values not characterised (pytorch PR #179592); correct from 2.13.0. Only meaningful where
    `sdpa_path` is "fused"; on the math path the bmm rules decide."""
    if profile.judges_conservatively("sdpa"):
        return conservative(lambda p: classify_sdpa(query, key, index_bits=index_bits, profile=p), profile)
    limit, _ = limits(index_bits)
    sq, sk = spec_of(query), spec_of(key)
    scores = math.prod(sq.shape[:-1]) * sk.shape[-2]
    if profile.sdpa_fused and profile.sdpa_fused_wrong and scores > limit:
        message = f"fused SDPA with {scores} score elements is wrong on MPS {profile.release}; values not characterised"
        return Fault("wrong_other", "ab", None, message, "sdpa-fused", release=profile.release)
    return OK


def rows_per_safe_chunk(a: Any, b: Any, *, index_bits: int = MPS_INDEX_BITS, op: str = "bmm", as_slices: bool = False) -> int:
    """The largest leading-dim chunk of this call for which every rule says "ok".

    For bmm the chunk must keep views below VIEW_LIMIT and everything else at or below LIMIT; with
    `as_slices` every operand counts as a view (a chunk s[i:j] of a tensor is one, offset != 0).
    For mm the output must stay below LIMIT and the input at or below LIMIT (below VIEW_LIMIT as a view).
    """
    limit, view_limit = limits(index_bits)
    sa, sb = spec_of(a), spec_of(b)
    if op == "mm":  # the output below LIMIT; the input rows at most LIMIT, below VIEW_LIMIT as a slice
        cap = (view_limit - 1) if sa.is_view or as_slices else limit
        return max(1, min((limit - 1) // max(sb.shape[1], 1), cap // max(sa.shape[1], 1)))
    per_out = sa.shape[1] * sb.shape[2]
    bounds = [limit // max(per_out, 1)]
    for s in (sa, sb):
        cap = (view_limit - 1) if s.is_view or as_slices else limit
        bounds.append(cap // max(s.per_batch, 1))
    return max(1, min(bounds))


def rows_safe_whole(a: Any, b: Any, *, index_bits: int, profile: FaultProfile, op: str = "bmm") -> int | None:
    """The largest first dimension at which this product runs correctly whole, its operands laid out as they are
    (a contiguous operand stays one, a view a view): what the same code runs on a smaller batch. A whole operand
    may hold up to LIMIT elements where a piece of it, a slice, is held below VIEW_LIMIT (rule 2), so this is up to
    twice `rows_per_safe_chunk(..., as_slices=True)`, the guard's pieces. Decided by `profile`'s rules at that size;
    None where they do not call it correct there (another rule, a release judged conservatively)."""
    sa, sb = spec_of(a), spec_of(b)
    rows = rows_per_safe_chunk(sa, sb, index_bits=index_bits, op=op)
    if not sa.shape or rows >= sa.shape[0]:
        return None
    smaller = dataclasses.replace(sa, shape=(rows, *sa.shape[1:]))
    if op == "mm":  # a Linear's weight does not grow with the batch
        fault = classify_mm(smaller, sb, index_bits=index_bits, profile=profile)
    else:
        fault = classify_bmm(smaller, dataclasses.replace(sb, shape=(rows, *sb.shape[1:])), index_bits=index_bits,
                             profile=profile)
    return rows if fault.is_ok else None
