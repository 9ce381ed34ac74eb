"""The shape-only fault tracer: runs a model on meta tensors at any size and predicts, call by
call, what MPS does with each bmm/mm. Its `FaultPlan` can be replayed by the emulator."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mpsimpact.calls import CallRecord, MatmulMode, classify_call, current_phase, op_name
from mpsimpact.faults import TensorSpec


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """Every bmm/mm call of one traced run, in order, with its predicted fault."""

    calls: tuple[CallRecord, ...]
    index_bits: int = 32

    @property
    def faults(self) -> list[CallRecord]:
        """The calls that do not simply compute correctly."""
        return [call for call in self.calls if not call.fault.is_ok]

    @property
    def first_stop(self) -> CallRecord | None:
        """The first call that raises or aborts: on MPS the run ends there."""
        return next((c for c in self.calls if c.fault.kind in ("error", "abort")), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "index_bits": self.index_bits,
            "calls": len(self.calls),
            "faults": [call.to_json() for call in self.faults],
        }


class TraceMode(MatmulMode):
    """Records every bmm/mm call with its predicted fault; computes nothing on meta tensors."""

    def __init__(self, index_bits: int = 32, module: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.index_bits = index_bits
        self.calls: list[CallRecord] = []
        self._names: list[str] = []
        self._module = module

    def on_matmul(self, func, family, a, b, args, kwargs):
        phase = current_phase()
        fault = classify_call(family, a, b, self.index_bits)
        self.calls.append(CallRecord(len(self.calls), op_name(func), TensorSpec.of(a), TensorSpec.of(b), fault, phase, self._where(phase)))
        return func(*args, **kwargs)

    def _where(self, phase: str) -> str:
        if phase == "backward":
            return torch._C._current_autograd_node().name()
        return self._names[-1] if self._names else ""

    @contextlib.contextmanager
    def naming_modules(self) -> Iterator[None]:
        """Tracks the innermost module running a forward, to name each call's layer."""
        if self._module is None:
            yield
            return
        def enter(name: str) -> Callable[..., None]:
            return lambda *_: self._names.append(name)

        def leave(*_: Any) -> None:
            self._names.pop()

        handles = []
        for name, sub in self._module.named_modules():
            handles.append(sub.register_forward_pre_hook(enter(name)))
            handles.append(sub.register_forward_hook(leave))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def trace_faults(
    fn: Callable[..., Any],
    *args: Any,
    index_bits: int = 32,
    module: torch.nn.Module | None = None,
    **kwargs: Any,
) -> FaultPlan:
    """Runs `fn(*args, **kwargs)` (on meta tensors, typically) and predicts every call's fault.

    Args:
        fn: the computation; with meta inputs and a meta model it allocates nothing.
        index_bits: the index width of the rules.
        module: if given, each forward call is labelled with the innermost submodule's name.

    Returns:
        The `FaultPlan`, whose calls are in the order any run of `fn` makes them.
    """
    mode = TraceMode(index_bits, module)
    with mode.naming_modules(), mode:
        fn(*args, **kwargs)
    return FaultPlan(tuple(mode.calls), index_bits)


def trace_module(
    module: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    *,
    backward: bool = False,
    index_bits: int = 32,
) -> FaultPlan:
    """Traces `module(**inputs)` in eval mode, and one backward pass of its output's sum if asked."""

    def step() -> None:
        if not backward:
            with torch.no_grad():
                module(**inputs)
            return
        output = module(**inputs)
        first = output if isinstance(output, torch.Tensor) else output[0]
        first.float().sum().backward()

    return trace_faults(step, index_bits=index_bits, module=module)
