"""One bmm/mm/SDPA/cat call as the modes saw it (`CallRecord`), and the one decision function every
mode, plan and check uses: `classify_call`, a family -> rule table. Pure: shapes in, a Fault out."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mpsimpact.engine.faults import Fault, Profile, TensorSpec, classify_bmm, classify_mm, classify_sdpa

RULES = {"bmm": classify_bmm, "mm": classify_mm, "sdpa": classify_sdpa}


def out_elements(family: str, a: Any, b: Any) -> int:
    """A call's output elements (shapes of `a` and `b`); for sdpa (a = query, b = key), its score
    elements B*H*Lq*Lk, the tensor whose size decides the fused op's fault."""
    if family == "sdpa":
        return math.prod(a.shape[:-1]) * b.shape[-2]
    if family == "cat":
        return math.prod(a.shape)  # a: the output
    return a.shape[-2] * b.shape[-1] * (a.shape[0] if family == "bmm" else 1)


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One bmm/mm call as a dispatch mode saw it, with the fault decided for it."""

    index: int
    op: str
    a: TensorSpec
    b: TensorSpec
    fault: Fault
    phase: str = "forward"
    module: str = ""
    needs_grad: bool = False  # sdpa: whether it needed gradients (which decides its path)
    within: int | None = None  # a call of an sdpa's math path: the index of that sdpa call

    @property
    def family(self) -> str:
        return {"mm": "mm", "addmm": "mm", "sdpa": "sdpa", "cat": "cat"}.get(self.op, "bmm")

    @property
    def out_numel(self) -> int:
        """Output elements; for sdpa, the score elements B*H*Lq*Lk."""
        return out_elements(self.family, self.a, self.b)

    def describe(self) -> str:
        if self.family == "sdpa":
            return f"sdpa(q {list(self.a.shape)}, k {list(self.b.shape)}) ({self.a.dtype})"
        if self.family == "cat":
            return f"cat to {self.a.numel} elements ({self.a.dtype})"
        return f"{self.op}{list(self.a.shape)} @ {list(self.b.shape)} ({self.a.dtype})"

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "op": self.op,
            "phase": self.phase,
            "module": self.module,
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "out_numel": self.out_numel,
            "fault": self.fault.to_json(),
            **({"needs_grad": self.needs_grad} if self.family == "sdpa" else {}),
            **({"within_sdpa": self.within} if self.within is not None else {}),
        }


def classify_call(family: str, a: Any, b: Any, index_bits: int, profile: Profile = None) -> Fault:
    """The fault of one call, by family ("bmm", "mm", or "sdpa" with a = query, b = key; fused path).
    See Note [MPS 32-bit index faults]."""
    return RULES[family](a, b, index_bits=index_bits, profile=profile)


