"""The Python entry points that reach MPS's matrix-multiply, attention and concatenation kernels,
wrapped while a handler (a guard, the emulator, the tracer) is active, so that only these calls pay
for a look, and every other op runs at full speed.

See Note [Entry points and the dispatch mode].
"""

from __future__ import annotations

import contextlib
import functools
import pydoc
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch.jit import _builtins as jit_builtins

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
# guests] for what the rest of the process sees of them while they are in place.

# Note [Wrappers as good guests]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# While a handler is active, the wrappers replace torch's callables for the whole process, also for
# code on other threads that never enters a guard, and whatever is made meanwhile (a table keyed by
# torch.matmul, `from torch import bmm` in a library imported then, a pickle) outlives them. So each
# wrapper is an `EntryPoint` that everything but the guard takes for torch's own, inside a guard and after:
# - it equals and hashes as the callable it stands for, so a table keyed by torch's callables (the
#   `__torch_function__` idiom) finds its handlers whichever of the two keyed it and whichever looks it
#   up (torch passes its builtin to `__torch_function__`; a Tensor method as the attribute of
#   torch.Tensor, the wrapper while it is in place). `is` tells them apart: `func is torch.matmul`
#   evaluated inside a guard is False for torch's builtin.
# - pickle: torch's builtins pickle as getattr(their class, name), and so does the wrapper: the same bytes,
#   inside a guard and after, loading torch's own callable. F.linear, F.scaled_dot_product_attention and
#   torch.einsum pickle by a path (torch._C._nn.linear, torch.functional.einsum) whose identity check
#   finds torch's callable, not the wrapper: the wrapper pickles by its public path (torch.nn.functional.
#   linear), which loads the same callable everywhere (other bytes than torch's own: tests pin it).
#   copy and deepcopy give the wrapper itself, as for a function.
# - TorchScript resolves a Python callable it meets in scripted code through
#   torch.jit._builtins._find_builtin (a table keyed by id) before it would compile it as Python
#   source; each wrapper is entered there under the aten op of the callable it replaces
#   (torch.matmul -> aten::matmul), and stays there after the guard (wrappers are made once and kept
#   alive, so the id stays theirs): a name bound to a wrapper scripts as torch's, also later.
# - torch's tables of its own callables that are built on first use and kept (torch.overrides'
#   get_overridable_functions, which Dynamo reads, and its kin) are built before the wrappers are first
#   in place, from torch's own callables.
# - torch.compile: Dynamo traces the callable named in `__original_fn` (its protocol for wrappers of
#   torch.jit._script_if_tracing) in the wrapper's place, and a Tensor method's bound function through
#   `_torchdynamo_inline`, so compiled graphs call torch's builtins whichever of Dynamo and mpsimpact was
#   loaded first; `_compiling()` folds the wrapper away for a Dynamo that ignores both.
# - `__name__`, `__doc__`, annotations and `__wrapped__` (so inspect.signature) are torch's; a Tensor
#   method's wrapper binds to its tensor as a method does.
# - The cost: a call of an object, not of a function (about 0.1 us; a Tensor method's binding 0.2 us more).
# Identity that cannot hold while a handler is active: FX graphs record torch's builtins (a wrapper called
# with a proxy hands it to the original at once), so an FX pass comparing `node.target is torch.bmm` then
# compares a builtin with the wrapper (`==` holds); `isinstance(torch.matmul, types.BuiltinFunctionType)`
# is False, so torch.fx.operator_schemas.normalize_function(torch.matmul, ...) raises then (FX passes meet
# the builtins, not the wrappers).

# name -> (owner, attribute) of every wrapped callable, grouped by the kind of call it is.
ENTRY_POINTS: dict[str, tuple[tuple[Any, str], ...]] = {
    # Tensor.__rmatmul__ calls torch.matmul, so it needs no wrapper of its own.
    "matmul": ((torch, "matmul"), (torch.Tensor, "matmul"), (torch.Tensor, "__matmul__")),
    "bmm": ((torch, "bmm"), (torch.Tensor, "bmm")),
    "baddbmm": ((torch, "baddbmm"), (torch.Tensor, "baddbmm")),
    "mm": ((torch, "mm"), (torch.Tensor, "mm")),
    "addmm": ((torch, "addmm"), (torch.Tensor, "addmm")),
    "linear": ((F, "linear"),),
    "einsum": ((torch, "einsum"),),
    "sdpa": ((F, "scaled_dot_product_attention"),),
    "cat": ((torch, "cat"), (torch, "concat"), (torch, "concatenate")),
}
# Factories, by how their size is given: the births a gated strict guard sees (Note [Strict, gated] in
# modes/guard.py), wrapped only while a handler that asks for them (`sees_births`) is active.
FACTORY_POINTS: dict[str, tuple[tuple[Any, str], ...]] = {
    "sized": tuple((torch, f) for f in ("empty", "zeros", "ones", "rand", "randn")),
    "full": ((torch, "full"),),
    "randint": ((torch, "randint"),),
    "arange": ((torch, "arange"),),
    "like": tuple((torch, f"{f}_like") for f in ("empty", "zeros", "ones", "full", "rand", "randn", "randint")),
    "new": tuple((torch.Tensor, f"new_{f}") for f in ("empty", "zeros", "ones", "full")),
}
# Each group as one flat tuple of (kind, owner, attribute): installed and taken away as a whole.
_ENTRY_PLACES = tuple((name, owner, attribute) for name, places in ENTRY_POINTS.items() for owner, attribute in places)
_FACTORY_PLACES = tuple((name, owner, attribute) for name, places in FACTORY_POINTS.items()
                        for owner, attribute in places)
# Entry points whose operands are sizes, not tensors (the wrapper hands them on without looking for a tensor).
FACTORIES = frozenset({"sized", "full", "randint", "arange"})


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
# lists them); its first entry marks torch's tables as built (_torch_tables).
_RETIRED: list[Any] = []
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
    sizes = name in FACTORIES

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        handlers = _LOCAL.__dict__.get("handlers")
        if _tracing_state() is not None:  # See Note [Calls torch.jit.trace records]
            return _traced(name, original, handlers or [], sys._getframe(1), args, kwargs)
        # Not for arguments that are not tensors (an FX proxy: symbolic tracing records torch's own callable);
        # a factory's are sizes (a handler passes what it cannot read as numbers).
        if not handlers or not (sizes or args and isinstance(args[0], _Tensor)
                                or isinstance(_first_operand(args, kwargs), _Tensor)):
            return original(*args, **kwargs)
        if _has_torch_function(args):  # See Note [Calls other modes see]
            return _beside_torch_function(name, original, handlers, args, kwargs)
        # The hot path: the thread's one handler (a guard, the emulator, the tracer) lets the call run as it is.
        if len(handlers) == 1 and handlers[0].passes(name, args, kwargs) or _compiling():
            return original(*args, **kwargs)  # nor while torch.compile traces: the wrapper folds away there
        if len(handlers) == 1:
            return handlers[0].on_entry(name, original, args, kwargs)
        return _chain(name, original, list(handlers), len(handlers) - 1)(*args, **kwargs)

    return _stand_in(wrapped, original, owner, attribute)


class EntryPoint:
    """What stands at one of torch's callables while the wrappers are in place: a call goes to the handlers,
    and the object is compared, hashed, copied and pickled as the callable it stands for. Each is the one
    instance of its own class, whose `__call__` is the wrapper function itself (no bound method on the hot
    path). See Note [Wrappers as good guests]."""

    __wrapped__: Any

    def __eq__(self, other: object) -> bool:
        return self.__wrapped__ == (other.__wrapped__ if isinstance(other, EntryPoint) else other)

    def __hash__(self) -> int:
        return hash(self.__wrapped__)

    def __copy__(self) -> EntryPoint:
        return self

    def __deepcopy__(self, memo: dict) -> EntryPoint:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        """The original's own reduction (torch's builtins pickle as getattr(their class, name)); F.linear,
        F.scaled_dot_product_attention and torch.einsum, which pickle by a path that does not lead here, by
        their public one."""
        reduced = _reduction(self.__wrapped__, protocol)
        if reduced is not None:
            return reduced
        path = f"{self.__module__}.{self.__qualname__}"  # its public path (_stand_in)
        return self.__qualname__ if pydoc.locate(path) is self else (pydoc.locate, (path,))

    def __repr__(self) -> str:
        return repr(self.__wrapped__)


def _bound(self: EntryPoint, instance: Any, owner: Any = None) -> Any:
    """`__get__` of a Tensor method's EntryPoint: bound to the tensor, as the method it stands for."""
    return self if instance is None else types.MethodType(type(self).__call__, instance)


def _reduction(original: Any, protocol: Any) -> tuple | None:
    """How pickle stores `original` where that is a (callable, arguments) pair (no path to look up)."""
    try:
        reduced = original.__reduce_ex__(protocol)
    except TypeError:  # a Python function: pickle stores it by its path
        return None
    return reduced if isinstance(reduced, tuple) else None


def _stand_in(wrapped: Callable[..., Any], original: Callable[..., Any], owner: Any,
              attribute: str) -> EntryPoint:
    """The EntryPoint calling `wrapped` for `original` at `owner.attribute`: torch's name, doc, annotations
    and __wrapped__ (so inspect.signature), its public path, and the original for torch.compile to trace
    (Note [Wrappers as good guests])."""
    functools.update_wrapper(wrapped, original)  # a bound method's name is its function's: Dynamo reads it
    members = {"__call__": staticmethod(wrapped), "__doc__": original.__doc__}
    if isinstance(owner, type):
        members["__get__"] = _bound
    stand_in = type(attribute, (EntryPoint,), members)()
    functools.update_wrapper(stand_in, original)  # type: ignore[arg-type]
    stand_in.__module__ = getattr(original, "__module__", None)  # a method descriptor has none: nor do we
    if _reduction(original, 2) is None:  # pickled by path: the public one (See EntryPoint.__reduce_ex__)
        stand_in.__module__, stand_in.__qualname__ = _public_path(owner, attribute)
    setattr(stand_in, "__script_if_tracing_wrapper", True)  # Dynamo traces `__original_fn` in its place
    setattr(stand_in, "__original_fn", original)
    wrapped._torchdynamo_inline = original  # type: ignore[attr-defined]  # and a bound method's function
    return stand_in


# Note [Calls torch.jit.trace records]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
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


def _traced(name: str, original: Callable[..., Any], handlers: list[EntryHandler], caller: types.FrameType,
            args: tuple, kwargs: dict) -> Any:
    """A wrapped call while torch.jit.trace records: See Note [Calls torch.jit.trace records]."""
    proceed = functools.partial(_as_caller, caller, original)
    if not handlers or not any(isinstance(x, _Tensor) for x in (*args, _first_operand(args, kwargs))):
        return proceed(*args, **kwargs)
    return _chain(name, proceed, list(handlers), len(handlers) - 1)(*args, **kwargs)


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


def _first_operand(args: tuple, kwargs: dict) -> Any:
    """The call's first operand: the first argument that is not einsum's equation, the first tensor of
    cat's list."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, str):
        first = args[1] if len(args) > 1 else next(iter(kwargs.values()), None)
    if isinstance(first, (list, tuple)):
        return first[0] if first else None
    return first


def _public_path(owner: Any, attribute: str) -> tuple[str, str]:
    """(module, qualified name) of `owner.attribute` as reached from outside: ("torch", "matmul"),
    ("torch.nn.functional", "linear"), ("torch", "Tensor.bmm")."""
    if isinstance(owner, type):
        return owner.__module__, f"{owner.__qualname__}.{attribute}"
    return owner.__name__, attribute


def install() -> None:
    """Puts the wrappers in place (idempotent); `push_handler` does it for the first handler.

    Each wrapper is also entered in TorchScript's builtin table under its original's aten op, so
    scripted code that calls it compiles as before (Note [Wrappers as good guests]).

    Note:
        The wrappers are in place only while some handler is active: a process that imports
        mpsimpact and never guards sees torch's own callables, so identity checks (an FX pass
        testing `node.target is torch.bmm`, a table keyed by torch.matmul) behave as without it.
        The price: a name bound to torch's callable before the first handler was entered (`op =
        torch.bmm`, `from torch import matmul`) is not seen by the fast path; `guard(strict=True)`
        sees every op whatever its name.
    """
    _install(_ENTRY_PLACES)


def _install(places: tuple[tuple[str, Any, str], ...]) -> None:
    if (places[0][1], places[0][2]) in _INSTALLED:
        return  # a group is in place as a whole or not at all
    table = _torch_tables()
    for name, owner, attribute in places:
        original = getattr(owner, attribute)
        own = attribute in owner.__dict__
        made = _MADE.get((owner, attribute))
        if made is None or made.original is not original or made.own is not own:
            # made once per original: entering a guard is cheap
            if made is not None:
                _RETIRED.append(made.wrapper)  # alive, so that its id in the builtin table stays its own
            made = _MADE[(owner, attribute)] = _Installed(original, own, _wrapper(name, original, owner, attribute))
        _INSTALLED[(owner, attribute)] = made
        setattr(owner, attribute, made.wrapper)
        if id(original) in table:
            table[id(made.wrapper)] = table[id(original)]  # kept after uninstall: the wrapper lives on


def _torch_tables() -> dict[int, str]:
    """TorchScript's builtin table (by id); before it returns it the first time, torch's other tables of
    its callables, built on first use and kept (torch.overrides'), are built from torch's own callables:
    See Note [Wrappers as good guests]."""
    if not _RETIRED:
        torch.overrides.get_overridable_functions()  # also resolve_name's index
        torch.overrides.get_ignored_functions()
        torch.overrides.get_default_nowrap_functions()
        torch.overrides._get_tensor_methods()
        _RETIRED.append(None)
    return jit_builtins._get_builtin_table()


def uninstall() -> None:
    """Restores torch exactly as `install()` found it.

    Every wrapped attribute is the original callable again (an inherited one, such as
    `Tensor.__matmul__` from `TensorBase`, inherited again). An attribute another library replaced
    after us keeps that library's callable. A wrapper someone kept a reference to (`from torch import
    bmm` inside a guard) still works as torch's callable: it calls it, TorchScript's builtin table
    keeps listing it, and it equals, hashes and pickles as it. Entering a guard, emulator or tracer
    installs the wrappers again.
    """
    _uninstall(_INSTALLED)
    _INSTALLED.clear()


def _uninstall(places: Iterable[tuple[Any, str]]) -> None:
    """Takes the wrappers of `places` away (each must be in place)."""
    for owner, attribute in places:
        original, own, wrapper = _INSTALLED[(owner, attribute)]
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
        install()
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
            uninstall()
        elif births and not _BIRTHS:
            places = [(owner, attribute) for _, owner, attribute in _FACTORY_PLACES]
            _uninstall(places)
            for place in places:
                del _INSTALLED[place]


@contextlib.contextmanager
def handling(handler: EntryHandler) -> Iterator[EntryHandler]:
    """Activates `handler` for the duration of the block."""
    push_handler(handler)
    try:
        yield handler
    finally:
        remove_handler(handler)
