"""The guard's dispatch-mode half: strict's hot path (Note [Strict's hot path]), which answers from the table
(modes/op_table.py) every op whose tensors cannot reach a limit, and the ops of the other families past DIM_MAX
(`on_other`): judged by their family, split into pieces, or judged on what they made. GuardMode
(modes/guard_mode.py) is built on it, as on EntryJudge (modes/guard_entry.py) for the entry points."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mpsimpact.engine.call import CallRecord
from mpsimpact.engine.faults import TensorSpec, dim_max
from mpsimpact.engine.families import classify_op
from mpsimpact.modes.base import (
    MatmulMode, active_emulator, current_phase, eval_frame_callback, has_nested, numbers_as_tensors, op_name,
)
from mpsimpact.modes.chunking import cat_in_place
from mpsimpact.modes.op_size import (
    SizedCall, judged_at, judged_outputs, outputs_of, size_call, tensors_of,
)
from mpsimpact.modes.op_table import (
    AFTER, BROADCAST, FULL, INPUTS, NO_KERNEL, OP_ENTRIES, QUICK, broadcast_within, op_entry, plain_types,
    within,
)
from mpsimpact.modes.piecewise import run_pieces, split_call

_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)


class DispatchJudge:
    """The dispatch-mode half of GuardMode: its `__torch_dispatch__` (strict's hot path, then MatmulMode's route)
    and `on_other`. It reads the guard's state (`_most`, `_hot`, `_passing`, `index_bits`, `everywhere`,
    `devices`, `profile`, `stopped`, `chunked`) and acts through its methods (`_quick_pass`, `_applies`,
    `_is_outer`, `_act`, `_bits`, `dispatch`)."""

    # Note [Strict's hot path]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~
    # Watching, the dispatch mode sees every op of the model, and almost none can reach a limit. So each op is
    # first looked up in the table (modes/op_table.py: one dictionary lookup by the overload's id) and decided
    # there, before any of the route's work: a view runs (NO_KERNEL); an op whose every tensor has at most
    # DIM_MAX elements runs where its output cannot outgrow them (INPUTS; BROADCAST where its inputs share a
    # shape or their sizes' product is at most DIM_MAX, the most a broadcast makes); an op nobody sized (AFTER)
    # runs and is judged only if what it made passes DIM_MAX; a Linear or matmul runs within its entry's bound
    # (QUICK: read from the shape table). Everything else (a product past its bound, a GROWN op such as a
    # factory or a lookup, a tensor past DIM_MAX, a tensor subclass, an emulator below, a compiled region
    # running) takes the full route, which decides exactly as it did before this path existed: the hot path
    # only answers calls that route would have run as they are. An op is run through its C++ callable
    # (OpEntry.run), and Dynamo is kept out as MatmulMode does (Note [Dynamo kept out at no cost]).
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        entry = OP_ENTRIES.get(id(func)) or op_entry(func)
        hot = entry.hot
        if hot is FULL or types and not plain_types(types) or not self._hot or eval_frame_callback() is not None:
            return MatmulMode.__torch_dispatch__(self, func, types, args, kwargs)
        if kwargs is None:
            kwargs = {}
        fixed = None
        try:
            if hot is NO_KERNEL or self._passing:
                return entry.run(*args, **kwargs)
            if hot is QUICK:
                if self._quick_pass(entry.bound_by, args, kwargs):
                    return entry.run(*args, **kwargs)
            elif hot is BROADCAST:
                if broadcast_within(args, kwargs, self._most):
                    return entry.run(*args, **kwargs)
            else:
                most = self._most
                for arg in args:  # every tensor within DIM_MAX (the most common case inline: no list, no kwargs)
                    if isinstance(arg, _Tensor):
                        if arg.numel() > most:
                            break
                    elif type(arg) in _SEQUENCES and not within(arg, most):
                        break
                else:
                    if not kwargs or within(kwargs.values(), most):
                        if hot is INPUTS:
                            return entry.run(*args, **kwargs)
                        if hot is AFTER:
                            return self._made(func, args, kwargs, entry.run(*args, **kwargs))
                        if size_call(func, args, kwargs, *judged_at(self.index_bits)) is None:
                            return entry.run(*args, **kwargs)  # GROWN, to no more than DIM_MAX
        except RuntimeError:  # as MatmulMode's route does with an op that refused its arguments
            if has_nested(args, kwargs):
                return self.on_nested(func, args, kwargs)
            fixed = numbers_as_tensors(func, args)  # See Note [TorchScript's numbers under a dispatch mode]
            if fixed is None:
                raise
        if fixed is not None:
            return self.dispatch(func, fixed, kwargs)
        return self._torch_dispatch(func, types, args, kwargs)  # the full route

    def _made(self, func, args: tuple, kwargs: dict, out: Any) -> Any:
        """An AFTER op's output on the hot path: as it is below DIM_MAX, else judged as on_other would."""
        most = self._most
        if type(out) is torch.Tensor and out.numel() <= most and not out.is_nested:
            return out
        if max((t.numel() for t in outputs_of(out)), default=0) <= most or self._passing or self._is_outer():
            return out
        sized = size_call(func, args, kwargs, *judged_at(self.index_bits))
        if sized is None or not self.everywhere or not self._applies_call(sized, kwargs):
            return out
        return self._judge_after(func, args, kwargs, sized, self.index_bits, None, out)

    def on_other(self, func, args, kwargs):
        """Every other op: cat on every route; with `everywhere`, every family past the per-dimension
        limit (prefiltered: a call whose tensors all have at most DIM_MAX elements passes at once; under
        a replayed plan, the plan's full-scale decision)."""
        if self._passing or self._is_outer():
            return func(*args, **kwargs)
        active = active_emulator()
        if active is not None and active.plan is not None:
            return self._replayed_other(func, args, kwargs, active)
        bits = self._bits(active)
        sized = size_call(func, args, kwargs, *judged_at(bits))
        if sized is None or not (self.everywhere or sized.family == "cat"):
            return func(*args, **kwargs)
        if not self._applies_call(sized, kwargs):
            return func(*args, **kwargs)
        if sized.after:
            return self._judge_after(func, args, kwargs, sized, bits, active)
        profile = active.profile if active else self.profile
        fault = classify_op(func, sized.inputs, sized.out, index_bits=bits, profile=profile)
        if fault.is_ok:
            return func(*args, **kwargs)
        made = [sized.out] if sized.out is not None else sized.inputs  # the same size, or a reduction's
        index = len(self.stopped) + len(self.chunked)
        record = CallRecord.of_op(index, op_name(func), sized.inputs, made, fault, current_phase())
        return self._split_other(func, args, kwargs, record, sized.family, sized.out, dim_max(bits), active)

    def _replayed_other(self, func, args, kwargs, active) -> Any:
        """A call of the other families under a replayed plan: the full-scale decision, and pieces scaled
        from the full-scale call's (as `_split_here` does for mm rows)."""
        planned = active.peek_op(func)
        if planned is None or planned.fault.is_ok:
            return func(*args, **kwargs)
        here = max((t.numel() for t in tensors_of(args, kwargs)), default=1)
        full = max(planned.a.numel, planned.b.numel, 1)
        most = max(1, dim_max(active.plan.index_bits) * here // full)
        record = dataclasses.replace(planned, index=len(self.stopped) + len(self.chunked))
        return self._split_other(func, args, kwargs, record, op_entry(func).family, None, most, active)

    def _split_other(self, func, args, kwargs, record: CallRecord, family: str, out: TensorSpec | None,
                     most: int, active) -> Any:
        if family == "cat":
            return self._act(record, record.fault, 1, lambda: cat_in_place(func, args, kwargs, most),
                             lambda: func(*args, **kwargs), active, op_name(func))
        pieces = split_call(func, args, kwargs, out, most)
        return self._act(record, record.fault, pieces, lambda: run_pieces(func, args, kwargs, pieces),
                         lambda: func(*args, **kwargs), active, op_name(func))

    def _applies_call(self, sized: SizedCall, kwargs: dict) -> bool:
        if sized.inputs:
            return self._applies(sized.inputs[0])
        device = torch.device(kwargs.get("device") or "cpu")  # a creation op: where it makes its tensor
        return device.type in self.devices if self.devices is not None else (
            device.type == "mps" or active_emulator() is not None)

    def _judge_after(self, func, args, kwargs, sized: SizedCall, bits: int, active, out: Any = None) -> Any:
        """An op whose output size only running it tells ('other' ops, lookups by mask): judged on what it
        made (`out`, where it ran already). Nobody measured these families past a limit, so they fault silently
        or not at all: the wrong values are dropped before anyone reads them."""
        if out is None:
            out = func(*args, **kwargs)
        outputs = judged_outputs(func, outputs_of(out), judged_at(bits)[1])
        if max((t.numel() for t in (*sized.inputs, *outputs)), default=0) <= dim_max(bits):
            return out
        profile = active.profile if active else self.profile
        fault = classify_op(func, sized.inputs, outputs, index_bits=bits, profile=profile)
        if fault.is_ok:
            return out
        record = CallRecord.of_op(len(self.stopped) + len(self.chunked), op_name(func), sized.inputs, outputs,
                                  fault, current_phase())
        return self._act(record, fault, None, lambda: out, lambda: out, active, op_name(func))
