"""The Python entry points that reach MPS's matrix-multiply, attention and concatenation kernels,
wrapped while a handler (a guard, the emulator, the tracer) is active, so that only these calls pay
for a look, and every other op runs at full speed.

See Note [Entry points and the dispatch mode].
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F

# Note [Entry points and the dispatch mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A TorchDispatchMode sees every aten op with its real operands, which is what the fault rules need,
# but puts Python on every op of the model (about 200 per forward of a 6-layer encoder): a fixed
# cost of milliseconds that small, latency-bound batches feel most. Only a few entry points reach
# the kernels that can fault: the callables below. While any handler is active they are replaced by
# wrappers that hand the call to the innermost handler (which may pass it on to the next, and the
# last one to the original). A handler answers a small call at once, and sends a call that may
# cross a limit through a dispatch mode, where decompositions (4-D matmul, einsum, linear on 3-D
# inputs) cannot hide the bmm/mm they reach. The wrappers are put in place when this module is
# first imported (so code that looks `torch.bmm` up before entering a guard still meets them), and
# cost one thread-local lookup per call while no handler is active. Calls made from C++
# (autograd's backward, TorchScript, compiled graphs) and names bound before mpsimpact was imported
# (`from torch import matmul`) bypass them: handlers cover backward themselves, and
# `guard(strict=True)` covers the rest.

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


class EntryHandler(Protocol):
    """What an active handler implements: decide a call, and run it through `proceed` (the next
    handler, or the original callable) unless it stops it."""

    def on_entry(self, name: str, proceed: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Handles one call of the entry-point kind `name`."""


_LOCAL = threading.local()
_ORIGINALS: dict[tuple[Any, str], tuple[Any, bool]] = {}  # -> (callable, whether the owner defined it itself)


_compiling = torch.compiler.is_compiling


def _handlers() -> list[EntryHandler]:
    return _LOCAL.__dict__.setdefault("handlers", [])


def _chain(name: str, original: Callable[..., Any], handlers: list[EntryHandler], depth: int) -> Callable[..., Any]:
    if depth < 0:
        return original

    def proceed(*args: Any, **kwargs: Any) -> Any:
        return handlers[depth].on_entry(name, _chain(name, original, handlers, depth - 1), args, kwargs)

    return proceed


def _wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        handlers = None if _compiling() else _LOCAL.__dict__.get("handlers")
        if not handlers:  # also while torch.compile traces: the wrapper folds away there
            return original(*args, **kwargs)
        if len(handlers) == 1:
            return handlers[0].on_entry(name, original, args, kwargs)
        return _chain(name, original, list(handlers), len(handlers) - 1)(*args, **kwargs)

    wrapped.__name__ = getattr(original, "__name__", name)
    wrapped.__doc__ = getattr(original, "__doc__", None)
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapped


def install() -> None:
    """Puts the wrappers in place (done on import; idempotent)."""
    if _ORIGINALS:
        return
    for name, places in ENTRY_POINTS.items():
        for owner, attribute in places:
            original = getattr(owner, attribute)
            _ORIGINALS[(owner, attribute)] = (original, attribute in vars(owner))
            setattr(owner, attribute, _wrapper(name, original))


def uninstall() -> None:
    """Restores torch's own callables (tests; a process that wants torch untouched)."""
    for (owner, attribute), (original, own) in _ORIGINALS.items():
        if own:
            setattr(owner, attribute, original)
        else:
            delattr(owner, attribute)  # inherited (Tensor.__matmul__ from TensorBase): uncover it again
    _ORIGINALS.clear()


def push_handler(handler: EntryHandler) -> None:
    """Activates `handler` on this thread (innermost)."""
    install()
    _handlers().append(handler)


def remove_handler(handler: EntryHandler) -> None:
    """Deactivates `handler`."""
    _handlers().remove(handler)


@contextlib.contextmanager
def handling(handler: EntryHandler) -> Iterator[EntryHandler]:
    """Activates `handler` for the duration of the block."""
    push_handler(handler)
    try:
        yield handler
    finally:
        remove_handler(handler)


install()
