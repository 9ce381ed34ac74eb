"""The guard's decisions at torch's Python entry points (modes/entrypoint.py): which calls run as they are (the
hot path, `passes`), and the route of the others: through the dispatch mode, SDPA at its entry, a nested
tensor's call, a call recorded by torch.jit.trace. GuardMode (modes/guard_mode.py) is built on it."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from mpsimpact.modes.budget import budget_scores
from mpsimpact.engine.call import CallRecord, classify_call
from mpsimpact.engine.families import classify_op
from mpsimpact.engine.faults import OK, TensorSpec, sdpa_path
from mpsimpact.errors import OversizedOpError
from mpsimpact.modes.backward import needs_derivatives, run_with_backward_under
from mpsimpact.modes.base import (
    ACTIVE, JAGGED, active_emulator, current_phase, flat_arguments, has_nested, needs_grad, sdpa_arguments,
    sdpa_dropout, sdpa_math, sdpa_operands,
)
from mpsimpact.modes.chunking import entry_bound, run_sdpa_chunked, split_sdpa
from mpsimpact.modes.op_size import has_symbolic_sizes
from mpsimpact.modes.op_table import ENTRY_KINDS, JOINED, WEIGHTED_ROWS, EntryKind, op_entry, stacked_shapes
from mpsimpact.modes.shape_table import LARGEST, largest_count

_tracing_state = torch._C._get_tracing_state
_transforming = torch._C._are_functorch_transforms_active
_fake_mode, _FAKE = torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.FAKE
_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)  # cat's tensors


class EntryJudge:
    """The entry-point handler half of GuardMode (modes/entrypoint.py's EntryHandler): `passes` answers a call
    that cannot meet a rule at once; `on_entry` routes the others. It reads the guard's state (`_view_limit`,
    `everywhere`, `watching`, `_passing`, `profile`, `index_bits`, `_paused_trace`) and acts through its
    methods (`_applies`, `_watch`, `_act`, `_bits`, `_copies`, `_as_one_op`, entering it as a dispatch mode)."""

    # Entry points (Python level): see Note [Entry points and the dispatch mode].
    def on_entry(self, name: str, proceed: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if _tracing_state() is not None:
            return self._on_traced_entry(name, proceed, args, kwargs)
        if self.passes(name, args, kwargs):
            return proceed(*args, **kwargs)
        kind = ENTRY_KINDS[name]
        if has_nested(args, kwargs):
            return self._on_nested(kind, proceed, args, kwargs)
        if kind.at_entry:
            return self._on_sdpa(proceed, args, kwargs)
        return self._through_dispatch(proceed, args, kwargs)

    def passes(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether the call runs as it is: an outer guard's (nested guards: the inner one decides alone), one
        not on a guarded device, or one that cannot meet a rule (the wrappers' hot path)."""
        guards = ACTIVE.stacks["guard"]  # _is_outer, inlined
        if not guards or guards[-1] is not self or self._passing:  # inside a fused SDPA decided at its entry
            return True
        kind = ENTRY_KINDS[name]
        try:
            if kind.at_entry:
                return self._sdpa_is_plain(kind, args, kwargs)
            if self.watching:
                return True  # the dispatch mode decides every op
            if kind.batched and _transforming():
                return self._passes_transformed(kind, args, kwargs)
            if not self.everywhere:
                return self._quick_pass(kind, args, kwargs)
            if kind.elements is not None:  # a factory: none for the fast path; a gated strict guard sees a birth
                return kind.elements(args, kwargs) < self._view_limit or self._watch()
            return self._quick_pass(kind, args, kwargs) or self._watch()
        except (RuntimeError, AttributeError, TypeError, ValueError):  # sizes that are not numbers
            if has_nested(args, kwargs):
                return False  # on_entry decides it: See Note [Nested tensors]
            raise

    # Note [The guard under torch.jit.trace]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The trace records every op that runs while it is on: the guard's reading of sizes would add aten::size
    # nodes, name values after the guard's locals and warn (a traced size is a tensor). So while a trace
    # records, the guard decides a call with tracing paused, and resumes it for what the call computes:
    # torch's callable (run as the caller: Note [Calls jit.trace records] in modes/entrypoint.py) and a
    # split SDPA's pieces. A product's route through the dispatch mode is not recorded (the trace holds the
    # op as the caller called it) and takes no autograd.Function (See Note [A call's derivatives under a
    # mode]). The graph is the one torch records without a guard, with and without gradients (jit.trace's
    # check traces again under no_grad, where SDPA takes another route).

    def _on_traced_entry(self, name: str, proceed: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """on_entry while torch.jit.trace records: See Note [The guard under torch.jit.trace]."""
        state, paused = _tracing_state(), self._paused_trace
        self._paused_trace = state
        torch._C._set_tracing_state(None)
        try:
            return self.on_entry(name, functools.partial(self._recorded, proceed), args, kwargs)
        finally:
            torch._C._set_tracing_state(state)
            self._paused_trace = paused

    def _recorded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` recorded by the trace the guard paused, if any."""
        if self._paused_trace is None:
            return fn(*args, **kwargs)
        previous = _tracing_state()
        torch._C._set_tracing_state(self._paused_trace)
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._set_tracing_state(previous)

    def _passes_transformed(self, kind: EntryKind, args: tuple, kwargs: dict) -> bool:
        """`passes` under torch.func's transforms, whose tensors show their logical sizes: under vmap the
        calls that run are batched, so a product's bound is taken that many times over (See Note [A call's
        derivatives under a mode] for the route of one that may cross a limit). SDPA is judged on the sizes
        it shows."""
        first = next((x for x in flat_arguments(args, kwargs) if isinstance(x, _Tensor)), None)
        if first is None or not self._applies(first):
            return True
        scale = math.prod(level.batch_size() for level in retrieve_all_functorch_interpreters()
                          if level.key() == TransformType.Vmap)
        passing = entry_bound(kind, args, kwargs) * scale < self._view_limit
        return passing or self.everywhere and self._watch()

    def _sdpa_is_plain(self, kind: EntryKind, args: tuple, kwargs: dict) -> bool:
        """An SDPA call that needs nothing of the guard: not on a guarded device; on MPS's math path (with
        gradients), too small to meet a rule; fused, decided safe (outside a dispatch mode, which would
        otherwise judge the kernel that runs it here)."""
        query, key, value = sdpa_operands(args, kwargs)
        if not self._applies(query):
            return True
        if _fake_mode(_FAKE) is not None and has_symbolic_sizes((query, key, value)):
            return True  # See Note [Symbolic sizes] in modes/guard_mode.py
        if active_emulator() is not None:
            return False  # the emulator decides every SDPA call: see _on_sdpa
        if sdpa_path(needs_grad((query, key, value)), self.profile) == "math":
            return entry_bound(kind, args, kwargs) < self._view_limit  # its scores included
        return not self.everywhere and classify_call("sdpa", query, key, self.index_bits, self.profile).is_ok

    def _quick_pass(self, kind: EntryKind, args: tuple, kwargs: dict) -> bool:
        """True when the call cannot meet any rule (or is not on a guarded device). The hot path: a matrix product
        or linear of a transformer is decided by its shapes, read from a table (LARGEST), and storage offsets."""
        weighted = kind.bound is WEIGHTED_ROWS
        if kind.quick and not kwargs and (len(args) == 2 or weighted and len(args) > 2):
            a, b = args[0], args[1]
            if isinstance(b, _Tensor):
                if not self._applies(a):
                    return True
                key = (weighted, a.shape, b.shape)
                try:
                    top = LARGEST.get(key) or largest_count(key)
                except TypeError:  # symbolic sizes: See Note [Symbolic sizes] in modes/guard_mode.py
                    if a.is_nested or b.is_nested:  # a jagged dim, not a symbol of export's: on_entry decides
                        raise
                    return True
                limit = self._view_limit
                return top + a.storage_offset() < limit and top + b.storage_offset() < limit
        if kind.elements is not None:
            return True  # wrapped for another thread's gated strict guard: births are that guard's business
        joined = kind.bound is JOINED and args and type(args[0]) in _SEQUENCES and args[0]
        if joined and _fake_mode(_FAKE) is None:
            tensors = args[0]
            if isinstance(tensors[0], _Tensor) and not self._applies(tensors[0]):
                return True
            try:  # the sum of the storage extents: above both terms of entry_bound's (the largest, all numels)
                return sum([t.storage_offset() + t.numel() for t in tensors]) < self._view_limit
            except AttributeError:  # not all tensors: the route below says what torch will
                pass
        first = args[0] if args and isinstance(args[0], torch.Tensor) else next(
            (x for x in flat_arguments(args, kwargs) if isinstance(x, torch.Tensor)), None)
        if first is None or not self._applies(first):
            return True
        if _fake_mode(_FAKE) is not None and has_symbolic_sizes(flat_arguments(args, kwargs)):
            return True  # See Note [Symbolic sizes] in modes/guard_mode.py
        return entry_bound(kind, args, kwargs) < self._view_limit

    def _through_dispatch(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A call that may cross a limit: its bmm/mm calls, and its derivatives', decided one by one."""
        tensors = (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        if self._paused_trace is None and needs_derivatives(tensors):
            return run_with_backward_under(self, fn, args, kwargs)
        with self:
            return fn(*args, **kwargs)

    def _on_sdpa(self, proceed: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        query, key, value = sdpa_operands(args, kwargs)
        active = active_emulator()
        dropout = sdpa_dropout(args, kwargs)
        if sdpa_path(needs_grad((query, key, value)), active.profile if active else self.profile) == "math":
            if active is not None:  # the emulator runs the math path: our dispatch mode sees its calls
                return proceed(*args, **kwargs)
            if dropout and not query.is_mps:
                raise OversizedOpError(
                    f"mpsimpact guard: scaled_dot_product_attention with dropout_p={dropout} near MPS's index "
                    f"limits on {query.device.type}: the guard looks at it through SDPA's math path (what MPS "
                    "runs with gradients), whose random mask is not this device's kernel's, so it stops "
                    "instead of computing other values. Use dropout_p=0, or run it on MPS.",
                    op="sdpa", phase=current_phase())
            return sdpa_math(*args, **kwargs) if self.watching else self._through_dispatch(sdpa_math, args, kwargs)
        fault, full_q, full_k = (
            active.peek("sdpa", None, query, key) if active
            else (classify_call("sdpa", query, key, self.index_bits, self.profile), query, key)
        )
        if fault.is_ok:
            return self._as_one_op(proceed, *args, **kwargs)
        spec_q, spec_k = (s if isinstance(s, TensorSpec) else TensorSpec.of(s) for s in (full_q, full_k))
        bound = sdpa_arguments(args, kwargs)
        mask = bound.get("attn_mask")
        full_mask = isinstance(mask, torch.Tensor) and mask.dim() > 2 and mask.shape[-2] > 1
        split = None if dropout else split_sdpa(spec_q.shape, spec_k.shape, value.shape[-1], self._bits(active),
                                                bool(bound.get("is_causal")), full_mask, budget_scores(query))
        record = CallRecord(len(self.stopped) + len(self.chunked), "sdpa", spec_q, spec_k, fault, current_phase())
        copies = self._copies(active)
        why_not = f"its dropout_p={dropout} draws one random mask, which no split reproduces" if dropout else None
        return self._act(record, fault, split and split.rows,
                         lambda: self._recorded(self._as_one_op, run_sdpa_chunked, proceed, args, kwargs,
                                                split, copies),
                         lambda: self._as_one_op(proceed, *args, **kwargs), active, why_not=why_not)

    def on_nested(self, func, args: tuple, kwargs: dict) -> Any:
        """A strided nested tensor's op under the dispatch mode: its product or cat judged as at an entry point."""
        kind = op_entry(func).nested_as
        return func(*args, **kwargs) if kind is None else self._on_nested(kind, func, args, kwargs)

    def _on_nested(self, kind: EntryKind, proceed: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A call with a nested tensor: See Note [Nested tensors]."""
        tensors = [t for t in flat_arguments(args, kwargs) if isinstance(t, _Tensor)]
        if any(type(t) is JAGGED for t in tensors):
            return self._through_dispatch(proceed, args, kwargs)
        active = active_emulator()
        shapes = stacked_shapes(kind, tensors) if self._applies(tensors[0]) else None
        joined = kind.bound is JOINED
        fault = OK
        if shapes is not None:
            a, b = (TensorSpec.contiguous(shape, str(tensors[0].dtype).removeprefix("torch.")) for shape in shapes)
            fault = (classify_op("cat", [a], b, index_bits=self._bits(active), profile=self.profile) if joined
                     else classify_call("mm", a, b, self._bits(active), self.profile))
        if fault.is_ok:
            return self._as_one_op(proceed, *args, **kwargs)
        record = CallRecord(len(self.stopped) + len(self.chunked), "cat" if joined else "mm", a, b, fault,
                            current_phase())
        return self._act(record, fault, None, lambda: None, lambda: self._as_one_op(proceed, *args, **kwargs),
                         active, why_not="the guard does not split a nested tensor's call")
