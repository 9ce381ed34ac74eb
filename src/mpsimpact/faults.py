"""The MPS large-tensor fault rules: pure functions of shapes, strides, offsets and dtype.

The emulator, the guard, the tracer and the planner all decide through this module; none keeps a
private copy of a threshold.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

# Note [MPS 32-bit index faults]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# PyTorch's MPS backend indexes bmm operands with 32-bit arithmetic (torch 2.4.1 .. 2.14.0; the
# facts are in docs/fault-model.md, from arXiv 2609.22991 and pytorch#197636). For
# a (B, M, K) @ b (B, K, N) with LIMIT = 2**index_bits and VIEW_LIMIT = 2**(index_bits - 1), the
# first rule that applies decides ("rule set B", torch 2.13/2.14):
#   1. output numel > LIMIT: a transposed-view operand is read as if its storage were packed
#      row-major in the view's shape (strides ignored, storage offset kept): every batch wrong.
#      Without a transposed operand the result is correct. Terminal: rules 2 and 3 are skipped.
#   2. a view operand (transposed, or storage offset != 0) with numel >= VIEW_LIMIT raises
#      "MPSGraph does not support tensor dims larger than INT_MAX" before computing.
#   3. a contiguous non-view operand with numel > LIMIT wraps: batch i reads the `per` elements at
#      flat offset (i * per) mod LIMIT, so batches i >= ceil(LIMIT / per) are wrong.
#   4. otherwise correct.
# The backward products grad_a = G @ b^T and grad_b = a^T @ G follow the same rules. A 2-D mm or
# addmm whose output has >= LIMIT elements aborts the process instead (not silent).
# Only element counts matter: the wrap is an element index, the same for every dtype.
# Layouts the study did not measure (general strides, expanded batches) are treated as the
# contiguous copy MPS gathers them into (inferred, not observed).

FaultKind = Literal["ok", "error", "wrong_all", "wrong_tail", "abort"]
Layout = Literal["contiguous", "offset", "transposed", "strided"]

INT_MAX_MESSAGE = "MPSGraph does not support tensor dims larger than INT_MAX"
ENCODE_FAILED_MESSAGE = "is too large for kernel. Encode failed."


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
        return cls(
            tuple(tensor.shape),
            tuple(tensor.stride()),
            int(tensor.storage_offset()),
            str(tensor.dtype).removeprefix("torch."),
        )

    @classmethod
    def contiguous(cls, shape: tuple[int, ...], dtype: str = "float32") -> TensorSpec:
        return cls(tuple(shape), contiguous_strides(shape), 0, dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def per_batch(self) -> int:
        return math.prod(self.shape[1:])

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
        if _is_dense(swapped.shape, swapped.stride):
            return "transposed"
        return "strided"

    @property
    def is_view(self) -> bool:
        # A slice s[1:] of a contiguous tensor counts although is_contiguous() is True.
        return self.layout in ("offset", "transposed")

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "stride": list(self.stride),
            "storage_offset": self.storage_offset,
            "dtype": self.dtype,
        }


@dataclasses.dataclass(frozen=True)
class Fault:
    """What MPS does with one matrix-multiply call.

    Attributes:
        kind: "ok", "error" (raises before computing), "wrong_all" (every batch wrong),
            "wrong_tail" (batches from `first_bad_batch` on wrong) or "abort" (process abort, 2-D).
        operand: the operand that causes it: "a", "b", "ab" (both) or None.
        first_bad_batch: first wrong batch (0 for wrong_all), or None.
        message: the MPS error text for "error" and "abort", else "".
        rule: which rule decided: "output-transposed", "view-int-max", "input-wrap",
            "mm-encode", or "none".
        wrap_elements: the element period of the wrap (2**index_bits) for "wrong_tail".
    """

    kind: FaultKind = "ok"
    operand: str | None = None
    first_bad_batch: int | None = None
    message: str = ""
    rule: str = "none"
    wrap_elements: int | None = None

    @property
    def is_ok(self) -> bool:
        return self.kind == "ok"

    @property
    def is_silent(self) -> bool:
        return self.kind in ("wrong_all", "wrong_tail")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


def _spec(x: Any) -> TensorSpec:
    return x if isinstance(x, TensorSpec) else TensorSpec.of(x)


def limits(index_bits: int) -> tuple[int, int]:
    """(LIMIT, VIEW_LIMIT) = (2**index_bits, 2**(index_bits - 1)). See Note [MPS 32-bit index faults]."""
    if not 2 <= index_bits <= 62:
        raise ValueError(f"index_bits must be in 2..62, got {index_bits}")
    return 1 << index_bits, 1 << (index_bits - 1)


def wrap_start_batch(per: int, wrap_elements: int) -> int:
    """First batch whose flat offset wraps: ceil(wrap_elements / per)."""
    return -(-wrap_elements // per)


def classify_bmm(a: Any, b: Any, *, index_bits: int = 32) -> Fault:
    """Decides what MPS's bmm does with `a @ b` (rule set B, torch 2.13/2.14).

    Args:
        a: (B, M, K) operand: a tensor (real, meta or fake) or a `TensorSpec`.
        b: (B, K, N) operand, likewise.
        index_bits: the index width; every threshold scales with it.

    Returns:
        The `Fault`. See Note [MPS 32-bit index faults].
    """
    limit, view_limit = limits(index_bits)
    sa, sb = _spec(a), _spec(b)
    out_numel = sa.shape[0] * sa.shape[1] * sb.shape[2]
    named = (("a", sa), ("b", sb))
    if out_numel > limit:
        transposed = "".join(name for name, s in named if s.layout == "transposed")
        if transposed:
            return Fault("wrong_all", transposed, 0, rule="output-transposed")
        return OK
    for name, s in named:
        if s.is_view and s.numel >= view_limit:
            return Fault("error", name, None, INT_MAX_MESSAGE, rule="view-int-max")
    wrapped = [(name, s) for name, s in named if not s.is_view and s.numel > limit]
    firsts = {name: wrap_start_batch(s.per_batch, limit) for name, s in wrapped}
    firsts = {name: first for name, first in firsts.items() if first < sa.shape[0]}
    if not firsts:
        return OK
    return Fault(
        "wrong_tail",
        "".join(firsts),
        min(firsts.values()),
        rule="input-wrap",
        wrap_elements=limit,
    )


def classify_bmm_backward(a: Any, b: Any, *, index_bits: int = 32) -> tuple[Fault, Fault]:
    """Decides the two gradient products of `a @ b`: (grad_a = G @ b^T, grad_b = a^T @ G).

    G, the incoming gradient, is taken contiguous, as autograd produces it.
    """
    sa, sb = _spec(a), _spec(b)
    grad = TensorSpec.contiguous((sa.shape[0], sa.shape[1], sb.shape[2]), sa.dtype)
    return (
        classify_bmm(grad, sb.transpose(), index_bits=index_bits),
        classify_bmm(sa.transpose(), grad, index_bits=index_bits),
    )


def classify_mm(a: Any, b: Any, *, index_bits: int = 32) -> Fault:
    """Decides a 2-D `mm`/`addmm`: an output of >= 2**index_bits elements aborts the process."""
    limit, _ = limits(index_bits)
    sa, sb = _spec(a), _spec(b)
    out_numel = sa.shape[0] * sb.shape[1]
    if out_numel >= limit:
        message = (
            f"[MPSGraph] output of mm with {out_numel} elements {ENCODE_FAILED_MESSAGE} "
            "(on MPS the process aborts)"
        )
        return Fault("abort", None, None, message, rule="mm-encode")
    return OK


def largest_safe_batch(a: Any, b: Any, *, index_bits: int = 32, op: str = "bmm", as_slices: bool = False) -> int:
    """The largest leading-dim chunk of this call for which every rule says "ok".

    For bmm the chunk must keep views below VIEW_LIMIT and everything else at or below LIMIT; with
    `as_slices` every operand counts as a view (a chunk s[i:j] of a tensor is one, offset != 0).
    For mm the output must stay below LIMIT.
    """
    limit, view_limit = limits(index_bits)
    sa, sb = _spec(a), _spec(b)
    if op == "mm":
        return max(1, (limit - 1) // max(sb.shape[1], 1))
    per_out = sa.shape[1] * sb.shape[2]
    bounds = [limit // max(per_out, 1)]
    for s in (sa, sb):
        cap = (view_limit - 1) if s.is_view or as_slices else limit
        bounds.append(cap // max(s.per_batch, 1))
    return max(1, min(bounds))


@dataclasses.dataclass(frozen=True)
class FaultProfile:
    """How one range of torch releases behaves on MPS (docs/fault-model.md, "Per-release differences")."""

    name: str
    versions: str
    summary: str
    modelled: bool


_PROFILES = (
    ((0, 0, 0), (2, 4, 0), FaultProfile("unmeasured-old", "< 2.4.1", "Older than every measured release; behaviour unknown.", False)),
    ((2, 4, 1), (2, 4, 1), FaultProfile("A-2.4", "2.4.1", "bmm inputs above 2^32 wrap (P V in attention); the transposed-output rule was not yet wrong.", False)),
    ((2, 5, 0), (2, 8, 0), FaultProfile("A-abort", "2.5.1..2.8.0", "Rule set B, but views over INT_MAX abort the process (exit 134) instead of raising; fused SDPA also wrong.", False)),
    ((2, 9, 0), (2, 12, 1), FaultProfile("A-typo", "2.9.1..2.12.1", "Rule set B, error text misspelt 'MPSGaph does not support ...'; fused SDPA above 2^32 also wrong.", False)),
    ((2, 13, 0), (2, 14, 0), FaultProfile("B", "2.13.0..2.14.0", "Rule set B exactly as emulated; fused SDPA correct (PR #179592).", True)),
    ((2, 14, 1), (99, 0, 0), FaultProfile("unmeasured-new", "> 2.14.0", "Newer than the last measured release: run `mpsimpact sweep` on a Mac to check.", False)),
)


def profile_for(torch_version: str) -> FaultProfile:
    """The fault profile of a torch version string such as "2.13.0+cpu"."""
    core = torch_version.split("+")[0]
    parts = tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in core.split(".")[:3])
    parts = (*parts, 0, 0)[:3]
    for low, high, profile in _PROFILES:
        if low <= parts <= high:
            return profile
    return _PROFILES[-1][2]
