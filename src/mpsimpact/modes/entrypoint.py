"""The Python entry points that reach MPS's matrix-multiply, attention and concatenation kernels,
wrapped while a handler (a guard, the emulator, the tracer) is active, so that only these calls pay
for a look, and every other op runs at full speed.

See Note [Entry points and the dispatch mode].
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Protocol

import torch
from torch.jit import _builtins as jit_builtins

from mpsimpact.modes.op_table import ENTRY_KINDS
from mpsimpact.modes.stand_in import EntryPoint, make_stand_in

# Note [Entry points and the dispatch mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A TorchDispatchMode sees every aten op with its real operands, which is what the fault rules need,
# but puts Python on every op of the model (about 200 per forward of a 6-layer encoder): a fixed
# cost of milliseconds that small, latency-bound batches feel most. Only a few entry points reach
# the kernels that can fault: the callables below. While any handler is active (on any thread) they
# are replaced by wrappers that hand the call to the innermost handler of the calling thread (which
# may pass it on to the next, and the last one to the original). A handler answers a small call at
# once, and sends a call that may cross a limit through a dispatch mode, where decompositions (4-D
# matmul, einsum, linear on 3-D inputs) cannot hide the bmm/mm they reach. The wrappers are put in
# place when the first handler is entered and taken away when the last one leaves, so a process that
# only imports mpsimpact sees torch exactly as it is (an FX pass testing `node.target is torch.bmm`
# finds its nodes). Calls made from C++ (autograd's backward, TorchScript, compiled graphs), names
# bound before the first handler was entered (`from torch import matmul`, `op = torch.bmm`) and
# arguments that are not tensors (FX's proxies: symbolic tracing records torch's own callable) bypass
# them: handlers cover backward themselves, and `guard(strict=True)` covers the rest. A
# TorchFunctionMode would see those too without replacing anything, but it runs Python on every torch
# call, not only these (about 220 per forward of the encoder): measured 1.14x to 1.16x at 1 x 16 on
# this project's CPU against 1.03x for the wrappers (benchmarks/README.md). See Note [Wrappers as good
# guests] in modes/stand_in.py for what the rest of the process sees of them.

# name -> (owner, attribute) of every wrapped callable, grouped by the kind of call it is (the table's kinds,
# modes/op_table.py's ENTRY_KINDS); the factories apart: the births a gated strict guard sees (Note [Strict,
# gated] in modes/guard_mode.py), wrapped only while a handler that asks for them (`sees_births`) is active.
ENTRY_POINTS: dict[str, tuple[tuple[Any, str], ...]] = {
    name: kind.places for name, kind in ENTRY_KINDS.items() if kind.elements is None}
FACTORY_POINTS: dict[str, tuple[tuple[Any, str], ...]] = {
    name: kind.places for name, kind in ENTRY_KINDS.items() if kind.elements is not None}
# Each group as one flat tuple of (kind, owner, attribute, (owner, attribute)): put in place and taken away whole.
_ENTRY_PLACES = tuple((name, owner, attribute, (owner, attribute)) for name, places in ENTRY_POINTS.items()
                      for owner, attribute in places)
_FACTORY_PLACES = tuple((name, owner, attribute, (owner, attribute)) for name, places in FACTORY_POINTS.items()
                        for owner, attribute in places)


class EntryHandler(Protocol):
    """What an active handler implements: decide a call, and run it through `proceed` (the next
    handler, or the original callable) unless it stops it."""

    def passes(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether the call of the entry-point kind `name` runs as it is, unseen (asked first, when this is the
        thread's only handler: one frame on the hot path instead of on_entry's two)."""

    def on_entry(self, name: str, proceed: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Handles one call of the entry-point kind `name`."""


_LOCAL = threading.local()


class _Installed(NamedTuple):
    original: Any
    own: bool  # whether the owner defined the attribute itself (not inherited)
    wrapper: Callable[..., Any]


_INSTALLED: dict[tuple[Any, str], _Installed] = {}
# Each place's wrapper, kept across uninstall with the original it wraps (functools.update_wrapper costs).
_MADE: dict[tuple[Any, str], _Installed] = {}
# Wrappers made for an original that was replaced since (kept alive: a name may hold them, the builtin table
# lists them by id).
_RETIRED: list[EntryPoint] = []
_TABLES_BUILT = False  # torch's tables of its callables (_torch_tables)
# Handlers active on all threads: the wrappers are in place while there is one.
_ACTIVE = 0
_BIRTHS = 0  # of them, those that see factories (sees_births)
_ACTIVE_LOCK = threading.Lock()

_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor  # a global read on the hot path, not an attribute of one


def _handlers() -> list[EntryHandler]:
    return _LOCAL.__dict__.setdefault("handlers", [])


def _chain(name: str, original: Callable[..., Any], handlers: list[EntryHandler],
           depth: int) -> Callable[..., Any]:
    if depth < 0:
        return original

    def proceed(*args: Any, **kwargs: Any) -> Any:
        return handlers[depth].on_entry(name, _chain(name, original, handlers, depth - 1), args, kwargs)

    return proceed


def _wrapper(name: str, original: Callable[..., Any], owner: Any, attribute: str) -> EntryPoint:
    """The EntryPoint standing at `owner.attribute` for `original`, whose calls go to the handlers."""
    sizes = ENTRY_KINDS[name].sizes  # a factory's operands are sizes, not tensors

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        handlers = _LOCAL.__dict__.get("handlers")
        # Not for arguments that are not tensors (an FX proxy: symbolic tracing records torch's own callable);
        # a factory's are sizes (a handler passes what it cannot read as numbers).
        if not handlers or not (sizes or args and isinstance(args[0], _Tensor)
                                or isinstance(_first_operand(args, kwargs), _Tensor)):
            if _tracing_state() is None:
                return original(*args, **kwargs)
            return _as_caller(sys._getframe(1), original, *args, **kwargs)  # Note [Calls jit.trace records]
        if _tracing_state() is not None:  # See Note [Calls jit.trace records]
            caller = functools.partial(_as_caller, sys._getframe(1), original)
            return _decide(name, caller, handlers, args, kwargs)
        if _has_torch_function(args):  # See Note [Calls other modes see]
            return _beside_torch_function(name, original, handlers, args, kwargs)
        # The hot path: the thread's one handler (a guard, the emulator, the tracer) lets the call run as it is.
        if len(handlers) == 1 and handlers[0].passes(name, args, kwargs) or _compiling():
            return original(*args, **kwargs)  # nor while torch.compile traces: the wrapper folds away there
        if _LOCAL.__dict__.get("entry") is not None:  # a call inside one (a decomposition's bmm): the caller's
            return _decide(name, original, handlers, args, kwargs)
        _LOCAL.entry = _shape_of(_first_operand(args, kwargs))  # See Note [A call's samples]
        try:
            return _decide(name, original, handlers, args, kwargs)
        finally:
            _LOCAL.entry = None

    return make_stand_in(wrapped, original, owner, attribute)


def _decide(name: str, original: Callable[..., Any], handlers: list[EntryHandler], args: tuple, kwargs: dict) -> Any:
    if len(handlers) == 1:
        return handlers[0].on_entry(name, original, args, kwargs)
    return _chain(name, original, list(handlers), len(handlers) - 1)(*args, **kwargs)


# Note [Calls jit.trace records]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.jit.trace gives each node the source line of the innermost Python frame when torch's op runs, and
# each value the name of a local variable of that frame. A wrapper (or, on the guard's slow path, a frame of
# the guard's) would be that frame: nodes named the wrapper's line, and the guard's routes, which differ with
# and without gradients, gave other graphs when jit.trace's check traced again under no_grad
# (TracingCheckError). So while a trace records, a wrapped call goes to the handlers whatever its size, and
# torch's callable is run from a frame that reads as the caller's: the caller's file, line and function
# name, and a copy of its locals (`_as_caller`: a code object made once per call site, run by exec). The
# graph is torch's own: the same nodes, lines and names as without a guard.
_CALL = compile("_mpsimpact_out = _mpsimpact_call(*_mpsimpact_args, **_mpsimpact_kwargs)", "<call>", "exec")
_SITES: dict[tuple[str, int, str], types.CodeType] = {}
_tracing_state = torch._C._get_tracing_state


def _as_caller(caller: types.FrameType, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`original(*args, **kwargs)` run from a frame that reads as `caller` (file, line, name, locals)."""
    code = caller.f_code
    site = (code.co_filename, caller.f_lineno, code.co_name)
    made = _SITES.get(site)
    if made is None:
        made = _SITES[site] = _CALL.replace(co_filename=site[0], co_firstlineno=site[1], co_name=site[2])
    names = dict(caller.f_locals)
    names.update(_mpsimpact_call=original, _mpsimpact_args=args, _mpsimpact_kwargs=kwargs)
    exec(made, caller.f_globals, names)
    return names["_mpsimpact_out"]


# Note [Calls other modes see]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A user's TorchFunctionMode, or a tensor subclass's __torch_function__, sees every torch call made while it
# is active, the handlers' own too: the sizes, strides and storage offsets a guard reads (each a
# `Tensor.shape.__get__`, `storage_offset` call), the slices and copies of a split. So where torch function
# handling would see the call, the handlers decide it with torch function off, and torch's callable runs
# with it as the caller had it: such a mode sees the call once, with the caller's arguments, as without a
# guard (torch hands a Tensor method's `func` as the attribute of torch.Tensor: the wrapper, equal to it).
# A user's TorchDispatchMode sees no guard's reads (they dispatch nothing), nor its Function's detaches
# (modes/backward.py), and a product reaching the guard's dispatch mode whole (under inference_mode) runs
# whole where its bound is below every limit (einsum's too: chunking.einsum_elements). A call a guard
# computes another way (a split, SDPA's math path, a call near a limit that it decomposes to judge, a
# derivative computed again) shows such modes the calls that run.
_has_torch_function = torch._C._has_torch_function
_ALL_DISABLED = torch._C._TorchFunctionState.ALL_DISABLED


def _beside_torch_function(name: str, original: Callable[..., Any], handlers: list[EntryHandler], args: tuple,
                           kwargs: dict) -> Any:
    """A wrapped call that torch function handling would see: See Note [Calls other modes see]."""
    state = torch._C._get_torch_function_state()
    proceed = functools.partial(_in_function_state, state, original)
    torch._C._set_torch_function_state(_ALL_DISABLED)
    try:
        return _chain(name, proceed, list(handlers), len(handlers) - 1)(*args, **kwargs)
    finally:
        torch._C._set_torch_function_state(state)


def _in_function_state(state: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`original(*args, **kwargs)` with torch function handling in `state` (the caller's)."""
    previous = torch._C._get_torch_function_state()
    torch._C._set_torch_function_state(state)
    try:
        return original(*args, **kwargs)
    finally:
        torch._C._set_torch_function_state(previous)


# Note [A call's samples]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A caller counts in the first dimension of the tensor it hands a product's entry point (torch.matmul, linear,
# bmm, SDPA): samples, texts. What reaches MPS folds the leading dimensions into rows (B*H batches of a bmm
# for a (B, H, L, L) @ (B, H, L, D) matmul, B*L rows of an mm for a linear on (B, L, D)), so a first wrong
# batch or a safe chunk in rows says little to the caller. While the handlers decide a call that did not pass
# at once, the shape of its first operand is kept (`entry_shape`; the outermost call's: torch's own
# decompositions call bmm through the entry points too), and the modes tell rows in the caller's
# samples where that shape folds into the rows they judge (engine.call.rows_per_sample); elsewhere (autograd's
# backward, TorchScript, a call reaching a dispatch mode alone) they stay rows.
def entry_shape() -> tuple[int, ...] | None:
    """The first operand's shape of the entry-point call the handlers are deciding on this thread, or None.
    See Note [A call's samples]."""
    return _LOCAL.__dict__.get("entry")


def _shape_of(operand: Any) -> tuple[int, ...] | None:
    if not isinstance(operand, _Tensor) or operand.is_nested:  # a nested tensor has no one shape
        return None
    shape = operand.shape  # not read as numbers where symbolic (export's dynamic dims)
    return tuple(shape) if all(type(n) is int for n in shape) else None


def _first_operand(args: tuple, kwargs: dict) -> Any:
    """The call's first operand: the first argument that is not einsum's equation, the first tensor of
    cat's list."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, str):
        first = args[1] if len(args) > 1 else next(iter(kwargs.values()), None)
    if isinstance(first, (list, tuple)):
        return first[0] if first else None
    return first


def _install(places: tuple[tuple[str, Any, str, tuple[Any, str]], ...]) -> None:
    """Puts the wrappers of `places` in place, each also entered in TorchScript's builtin table under its
    original's aten op, so scripted code that calls it compiles as before (Note [Wrappers as good guests])."""
    if places[0][3] in _INSTALLED:
        return  # a group is in place as a whole or not at all
    table = _torch_tables() if not _TABLES_BUILT else None  # the first time, before any wrapper is in place
    for name, owner, attribute, place in places:
        original = getattr(owner, attribute)
        own = attribute in owner.__dict__
        made = _MADE.get(place)
        if made is None or made.original is not original or made.own is not own:
            # made once per original: entering a guard is cheap
            if made is not None:
                _RETIRED.append(made.wrapper)  # alive, so that its id in the builtin table stays its own
            made = _MADE[place] = _Installed(original, own, _wrapper(name, original, owner, attribute))
            table = _torch_tables() if table is None else table
            if id(original) in table:
                table[id(made.wrapper)] = table[id(original)]  # kept after uninstall: the wrapper lives on
        _INSTALLED[place] = made
        setattr(owner, attribute, made.wrapper)


def _torch_tables() -> dict[int, str]:
    """TorchScript's builtin table (by id); before it returns it the first time, torch's other tables of
    its callables, built on first use and kept (torch.overrides'), are built from torch's own callables:
    See Note [Wrappers as good guests] in modes/stand_in.py."""
    global _TABLES_BUILT
    if not _TABLES_BUILT:
        torch.overrides.get_overridable_functions()  # also resolve_name's index
        torch.overrides.get_ignored_functions()
        torch.overrides.get_default_nowrap_functions()
        torch.overrides._get_tensor_methods()
        _TABLES_BUILT = True
    return jit_builtins._get_builtin_table()


def _uninstall(places: Iterable[tuple[Any, str]]) -> None:
    """Takes the wrappers of `places` away (each must be in place): torch as they found it, but where another
    library replaced one since. A wrapper someone kept still works as torch's callable (stand_in.EntryPoint)."""
    for owner, attribute in places:
        original, own, wrapper = _INSTALLED.pop((owner, attribute))
        if getattr(owner, attribute) is not wrapper:
            continue  # replaced again since: not ours to undo
        if own:
            setattr(owner, attribute, original)
        else:
            delattr(owner, attribute)  # inherited (Tensor.__matmul__ from TensorBase): uncover it again


def push_handler(handler: EntryHandler) -> None:
    """Activates `handler` on this thread (innermost); the first active handler of the process puts
    the wrappers in place, the first that `sees_births` the factories' too."""
    global _ACTIVE, _BIRTHS
    with _ACTIVE_LOCK:
        _ACTIVE += 1
        _install(_ENTRY_PLACES)
        if getattr(handler, "sees_births", False):
            _BIRTHS += 1
            _install(_FACTORY_PLACES)
    _handlers().append(handler)


def remove_handler(handler: EntryHandler) -> None:
    """Deactivates `handler`; the last active handler of the process takes the wrappers away (the last
    that `sees_births`, the factories')."""
    global _ACTIVE, _BIRTHS
    _handlers().remove(handler)
    with _ACTIVE_LOCK:
        _ACTIVE -= 1
        births = getattr(handler, "sees_births", False)
        _BIRTHS -= births
        if not _ACTIVE:
            _uninstall(list(_INSTALLED))
        elif births and not _BIRTHS:
            _uninstall([place for _, _, _, place in _FACTORY_PLACES])


@contextlib.contextmanager
def handling(handler: EntryHandler) -> Iterator[EntryHandler]:
    """Activates `handler` for the duration of the block."""
    push_handler(handler)
    try:
        yield handler
    finally:
        remove_handler(handler)
