"""What stands at one of torch's callables while the entry-point wrappers are in place (modes/entrypoint.py):
an object that the rest of the process takes for torch's own, inside a guard and after it. See Note
[Wrappers as good guests]."""

from __future__ import annotations

import functools
import pydoc
import types
from collections.abc import Callable
from typing import Any

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
#   linear), which loads the same callable everywhere (other bytes than torch's own: tests pin it). The
#   wrapper cannot stand at torch's path too: torch looks its callable up there to hand `__torch_function__`
#   its `func`, so every TorchFunctionMode, subclass and FX proxy would be handed the wrapper, not the
#   callable it bound before the guard (tests/test_guest_tools.py).
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


class EntryPoint:
    """What stands at one of torch's callables while the wrappers are in place: a call goes to the handlers,
    and the object is compared, hashed, copied and pickled as the callable it stands for. Each is the one
    instance of its own class, whose `__call__` is the wrapper function itself (no bound method on the hot
    path). See Note [Wrappers as good guests]."""

    original: Any  # torch's callable (also its __wrapped__, which functools sets for inspect.signature)

    def __eq__(self, other: object) -> bool:
        return self.original == (other.original if isinstance(other, EntryPoint) else other)

    def __hash__(self) -> int:
        return hash(self.original)

    def __copy__(self) -> EntryPoint:
        return self

    def __deepcopy__(self, memo: dict) -> EntryPoint:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        """The original's own reduction (torch's builtins pickle as getattr(their class, name)); F.linear,
        F.scaled_dot_product_attention and torch.einsum, which pickle by a path that does not lead here, by
        their public one."""
        reduced = _reduction(self.original, protocol)
        if reduced is not None:
            return reduced
        path = f"{self.__module__}.{self.__qualname__}"  # its public path (make_stand_in)
        return self.__qualname__ if pydoc.locate(path) is self else (pydoc.locate, (path,))

    def __repr__(self) -> str:
        return repr(self.original)


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


def make_stand_in(wrapped: Callable[..., Any], original: Callable[..., Any], owner: Any,
                  attribute: str) -> EntryPoint:
    """The EntryPoint calling `wrapped` for `original` at `owner.attribute`: torch's name, doc, annotations
    and __wrapped__ (so inspect.signature), its public path, and the original for torch.compile to trace
    (Note [Wrappers as good guests])."""
    functools.update_wrapper(wrapped, original)  # a bound method's name is its function's: Dynamo reads it
    members = {"__call__": staticmethod(wrapped), "__doc__": original.__doc__}
    if isinstance(owner, type):
        members["__get__"] = _bound
    made = type(attribute, (EntryPoint,), members)()
    made.original = original  # on the instance: a method descriptor held by the class would bind
    functools.update_wrapper(made, original)  # type: ignore[arg-type]
    made.__module__ = getattr(original, "__module__", None)  # a method descriptor has none: nor do we
    if _reduction(original, 2) is None:  # pickled by path: the public one (See EntryPoint.__reduce_ex__)
        made.__module__, made.__qualname__ = _public_path(owner, attribute)
    setattr(made, "__script_if_tracing_wrapper", True)  # Dynamo traces `__original_fn` in its place
    setattr(made, "__original_fn", original)
    wrapped._torchdynamo_inline = original  # type: ignore[attr-defined]  # and a bound method's function
    return made


def _public_path(owner: Any, attribute: str) -> tuple[str, str]:
    """(module, qualified name) of `owner.attribute` as reached from outside: ("torch", "matmul"),
    ("torch.nn.functional", "linear"), ("torch", "Tensor.bmm")."""
    if isinstance(owner, type):
        return owner.__module__, f"{owner.__qualname__}.{attribute}"
    return owner.__name__, attribute
