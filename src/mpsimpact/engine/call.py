"""One op call as the modes saw it (`CallRecord`: a matrix product, SDPA, or any other aten op past a
limit), and the one decision function every mode, plan and check uses: `classify_call` (a family -> rule
table for the products) and `classify_record` (any recorded call, through engine.families for the rest).
Pure: shapes in, a Fault out."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from typing import Any

from mpsimpact.engine.families import classify_op
from mpsimpact.engine.faults import (
    OK, Fault, TensorSpec, classify_bmm, classify_mm, classify_sdpa, dim_max, spec_of,
)
from mpsimpact.engine.release import FaultProfile, allocates, family_of

RULES = {"bmm": classify_bmm, "mm": classify_mm, "sdpa": classify_sdpa}
PRODUCTS = frozenset(RULES)


def out_elements(family: str, a: Any, b: Any) -> int:
    """A call's output elements (shapes of `a` and `b`); for sdpa (a = query, b = key), its score
    elements B*H*Lq*Lk, the tensor whose size decides the fused op's fault; for any other family (a =
    its largest input, b = its largest output), the output's."""
    if family == "sdpa":
        return math.prod(a.shape[:-1]) * b.shape[-2]
    if family in ("bmm", "mm"):
        return a.shape[-2] * b.shape[-1] * (a.shape[0] if family == "bmm" else 1)
    return math.prod(b.shape)


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One op call as a dispatch mode saw it, with the fault decided for it.

    For bmm/mm, `a` and `b` are the two operands; for sdpa the query and the key. For every other family
    (cat, elementwise, reduction, ...), `a` is its first input (`self`; cat's first tensor) and `b` its
    largest output (each stands for the other where the op has none: a creation op has no input): what
    the family rules read (Note [Op families past INT_MAX]: the largest tensor and any dimension past
    the limit, which the output carries wherever a broadcast or lookup makes it bigger), so a record can
    be re-decided for another release, or rescaled to another batch, from them alone. (The first input,
    not the largest: which input is largest can change with the batch, and rescaling pairs the calls of
    two traces tensor by tensor.)
    """

    index: int
    op: str
    a: TensorSpec
    b: TensorSpec
    fault: Fault
    phase: str = "forward"
    module: str = ""
    needs_grad: bool = False  # sdpa: whether it needed gradients (which decides its path)
    within: int | None = None  # a call of an sdpa's math path: the index of that sdpa call
    occurrence: int | None = None  # other families: this op's how-manieth call of its name (plan replay)
    # softmax in a trace of every op: bytes of the tensors of its output's size alive while it ran (the scores
    # the model still holds, its input, its output); what memory estimates count (prediction.memory)
    live_bytes: int | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def of_op(cls, index: int, op: str, inputs: Iterable[Any], outputs: Iterable[Any], fault: Fault,
              phase: str = "forward", **fields: Any) -> CallRecord:
        """The record of a call of any family but the products: its first input and largest output."""
        a = next((spec_of(t) for t in inputs), None)
        b = max(map(spec_of, outputs), key=lambda s: s.numel, default=None)
        if a is None and b is None:
            a = b = TensorSpec.contiguous(())
        return cls(index, op, a or b, b or a, fault, phase, **fields)  # type: ignore[arg-type]

    def evolve(self, **changes: Any) -> CallRecord:
        """A copy with `changes` (field names): dataclasses.replace without its per-call introspection, which
        plan and check pay for every call of every rebuilt plan (the record is frozen, with no __post_init__)."""
        new = object.__new__(CallRecord)
        new.__dict__.update(self.__dict__, **changes)
        return new

    def resized(self, a: TensorSpec, b: TensorSpec) -> CallRecord:
        """The same call on operands `a` and `b` (rescaled to another batch or length), its fault not decided
        again; the bytes its softmax kept alive (`live_bytes`) scaled with its output."""
        live = self.live_bytes
        if live is not None and self.b.numel:
            live = live * b.numel // self.b.numel
        return self.evolve(a=a, b=b, live_bytes=live)

    @property
    def family(self) -> str:
        return family_of(self.op)

    @property
    def is_product(self) -> bool:
        """A matrix product or SDPA: `a` and `b` are its operands."""
        return self.family in PRODUCTS

    @property
    def out_numel(self) -> int:
        """Output elements; for sdpa, the score elements B*H*Lq*Lk."""
        return out_elements(self.family, self.a, self.b)

    def describe(self) -> str:
        if self.family == "sdpa":
            return f"sdpa(q {list(self.a.shape)}, k {list(self.b.shape)}) ({self.a.dtype})"
        if self.family == "cat":
            return f"cat to {list(self.b.shape)}, {self.b.numel} elements ({self.b.dtype})"
        if allocates(self.op):  # a "view" op that allocates: what it makes is what counts
            return f"{self.op} of {list(self.b.shape)} ({self.b.dtype}, allocation)"
        if not self.is_product:
            into = f" -> {list(self.b.shape)}" if self.b != self.a else ""
            return f"{self.op}({list(self.a.shape)}{into}) ({self.a.dtype}, {self.family})"
        return f"{self.op}{list(self.a.shape)} @ {list(self.b.shape)} ({self.a.dtype})"

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index, "op": self.op, "phase": self.phase, "module": self.module,
            "a": self.a.to_json(), "b": self.b.to_json(), "out_numel": self.out_numel, "fault": self.fault.to_json(),
            **({"needs_grad": self.needs_grad} if self.family == "sdpa" else {}),
            **({"within_sdpa": self.within} if self.within is not None else {}),
            **({"family": self.family} if not self.is_product else {}),
        }


def rows_per_sample(call: CallRecord, entry: tuple[int, ...] | None) -> int:
    """How many of a product call's rows (bmm batches, mm rows, SDPA's batch-head rows) one sample of the
    caller's first dimension holds, where the caller's operand shape `entry` folds exactly into the call's
    rows (a (B, H, L, L) @ (B, H, L, D) matmul into B*H bmm batches: H); else 1, the rows being the unit.
    See Note [A call's samples] in modes/entrypoint.py."""
    if entry is None or not call.is_product or len(entry) < 2:
        return 1
    folded, rows = (entry[:-1], call.a.shape[0]) if call.family == "mm" else (entry[:-2], math.prod(call.a.shape[:-2]))
    if not folded or not folded[0] or math.prod(folded) != rows:
        return 1
    return rows // folded[0]


def op_cell(op: str, a: list[int], b: list[int]) -> str:
    """A call's op and shapes: "bmm: 192x256x256 @ 192x256x32" for a product, "sdpa: q ..., k ...",
    "mul on 16x12x256x256" (and "-> out" when it differs) for any other op (a = its largest input,
    b = its largest output)."""
    family, shape = family_of(op), lambda dims: "x".join(map(str, dims)) or "scalar"
    if family == "sdpa":
        return f"{op}: q {shape(a)}, k {shape(b)}"
    if family in PRODUCTS:
        return f"{op}: {shape(a)} @ {shape(b)}"
    return f"{op} on {shape(a)}" + (f" -> {shape(b)}" if list(b) != list(a) else "")


def classify_call(family: str, a: Any, b: Any, index_bits: int, profile: FaultProfile) -> Fault:
    """The fault of one matrix-product call, by family ("bmm", "mm", or "sdpa" with a = query, b = key;
    fused path). See Note [MPS 32-bit index faults]."""
    return RULES[family](a, b, index_bits=index_bits, profile=profile)


def classify_record(call: CallRecord, index_bits: int, profile: FaultProfile) -> Fault:
    """The fault of a recorded call under a release: the products' rules on `a` and `b`; any other
    family's rule on its first input and largest output (Note [Op families past INT_MAX]).

    The answer is kept per (call's family or op, a, b, width, release): the rules are pure, and a model's
    layers make the same calls (plan and check decide the same traced calls at many lengths and batches, and
    FaultPlan.from_trace decides them again)."""
    if call.is_product:
        return _decided(True, call.family, call.a, call.b, index_bits, profile)
    if max(call.a.numel, call.b.numel) <= dim_max(index_bits):
        return OK  # no family rule meets a call whose every tensor has at most DIM_MAX elements
    return _decided(False, call.op, call.a, call.b, index_bits, profile)


@functools.lru_cache(maxsize=1 << 16)
def _decided(product: bool, name: str, a: TensorSpec, b: TensorSpec, index_bits: int,
             profile: FaultProfile) -> Fault:
    if product:  # `name` is the family
        return classify_call(name, a, b, index_bits, profile)
    return classify_op(name, [a], b, index_bits=index_bits, profile=profile)
