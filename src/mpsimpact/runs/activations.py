"""Keeping fewer activations in a training step: what autograd saves for backward and backward can
recompute bit for bit is recomputed instead of kept (see Note [Recomputed activations])."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

aten = torch.ops.aten


# Note [Recomputed activations]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A training step at 2048 x 64 saves about 10 MiB per text for backward (21 GiB), most of it
# tensors that are a cheap function of other saved tensors: a LayerNorm's output of its saved
# input, GELU's output of its saved input, a Linear's output (Q, K, V, the feed-forward input) of
# its saved input and the weights, the attention output of the saved P and V. A saved-tensor hook
# keeps, instead of such a tensor, a recipe read off the autograd graph (the producing node's saved
# inputs and the view ops on the way), and backward runs the recipe. The figures stay identical:
# - a recipe runs with every dispatch mode off (the emulator, the guard), so no extra matmul is
#   counted, altered or replayed against the fault plan;
# - a matmul the step may have altered (a family the emulator or the guard acts on in this step,
#   or any matmul on a real device) is recomputed when saved and kept unless it is reproduced bit
#   for bit; other recipes are checked that way once per kind of tensor (ops, shape, strides).
#   Recomputing one op on one device from the same inputs is deterministic.
# Unlike torch.utils.checkpoint this re-runs no module forward, so no call reaches the emulator
# twice, and a layer with a faulted call still drops what it can.

MIN_RECOMPUTED_BYTES = 1 << 20  # smaller tensors are not worth a recipe
MATMULS = frozenset({"mm", "bmm"})
_VIEWS = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ExpandBackward0", "TransposeBackward0", "CloneBackward0",
})
_FAMILY = {"AddmmBackward0": "mm", "BmmBackward0": "bmm"}


@contextlib.contextmanager
def recompute_activations(module: torch.nn.Module, trusted: frozenset[str] = MATMULS) -> Iterator[None]:
    """Within the block, saved activations that backward can recompute bit for bit are recomputed
    instead of kept (see Note [Recomputed activations]).

    Args:
        module: the model being trained (a LayerNorm output is recomputed with its LayerNorms' eps).
        trusted: the matmul families ("mm", "bmm") nothing alters in this step, so that recomputing
            them needs no check per tensor: all on a plain CPU step, none on a real device.
    """
    eps = tuple(sorted({m.eps for m in module.modules() if isinstance(m, torch.nn.LayerNorm)}))
    recomputer = _Recomputer(eps, trusted)
    try:
        with torch.autograd.graph.saved_tensors_hooks(recomputer.pack, recomputer.unpack):
            yield
    finally:
        recomputer.last = None  # it holds a graph node: let a stopped step's graph go


class _Recomputer:
    """The hooks' state: which kinds of tensor were checked, and the last matmul output recomputed
    (backward asks for the feed-forward input twice in a row: for GELU's output and its input)."""

    def __init__(self, eps: tuple[float, ...], trusted: frozenset[str]) -> None:
        self.eps, self.trusted = eps, trusted
        self.checked: dict[tuple, int] = {}  # kind of tensor -> which producer reproduced it
        self.last: tuple[Any, torch.Tensor] | None = None

    def pack(self, tensor: torch.Tensor) -> Any:
        # Kept tensors are detached: a node saving its own output would otherwise hold itself
        # through the tensor's grad_fn, and a step whose backward stops would never be freed.
        if tensor.grad_fn is None or tensor.nbytes < MIN_RECOMPUTED_BYTES:
            return tensor.detach()
        try:
            return self._recipe(tensor) or tensor.detach()
        except (RuntimeError, TypeError, AttributeError, ValueError, IndexError):
            return tensor.detach()  # a graph this reader does not know: keep the tensor

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved() if callable(saved) else saved

    def _recipe(self, tensor: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        views, producer = _view_chain(tensor.grad_fn)
        kind = (type(producer).__name__, *(type(v).__name__ for v in views), tuple(tensor.shape), tensor.stride())
        candidates = _producers(producer, self.eps)
        if kind in self.checked and _FAMILY.get(kind[0], "elementwise") not in MATMULS - self.trusted:
            return _with_views(self._memoized(producer, candidates[self.checked[kind]]), views, kind[-2])
        for index, produce in enumerate(candidates):
            recipe = _with_views(self._memoized(producer, produce), views, kind[-2])
            if _reproduces(recipe, tensor):
                self.checked[kind] = index
                return recipe
        return None

    def _memoized(self, node: Any, produce: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        if type(node).__name__ not in _FAMILY:
            return produce  # elementwise: cheaper to redo than to hold

        def value() -> torch.Tensor:
            if self.last is None or self.last[0] is not node:
                self.last = None  # free the old value before making the new one
                self.last = (node, produce())
            return self.last[1]

        return value


def _view_chain(node: Any) -> tuple[list[Any], Any]:
    """The view and clone nodes from `node` down to the node that computed the values (top first)."""
    views = []
    while node is not None and type(node).__name__ in _VIEWS:
        views.append(node)
        node = node.next_functions[0][0]
    return views, node


def _producers(node: Any, eps: tuple[float, ...]) -> list[Callable[[], torch.Tensor]]:
    """Ways to recompute `node`'s output from what the graph keeps anyway (one per eps for a
    LayerNorm, whose eps the graph does not keep)."""
    kind = type(node).__name__
    if kind == "NativeLayerNormBackward0":
        shape = list(node._saved_normalized_shape)
        return [lambda e=e: aten.native_layer_norm.default(
            node._saved_input, shape, node._saved_weight, node._saved_bias, e)[0] for e in eps]
    if kind == "GeluBackward0":
        return [lambda: aten.gelu.default(node._saved_self, approximate=node._saved_approximate)]
    if kind == "BmmBackward0":
        return [lambda: aten.bmm.default(node._saved_self, node._saved_mat2)]
    if kind == "AddmmBackward0" and type(bias := node.next_functions[0][0]).__name__ == "AccumulateGrad":
        return [lambda: aten.addmm.default(bias.variable, node._saved_mat1, node._saved_mat2,
                                           beta=node._saved_beta, alpha=node._saved_alpha)]
    return []


def _with_views(produce: Callable[[], torch.Tensor], views: list[Any], shape: tuple[int, ...]
                ) -> Callable[[], torch.Tensor]:
    """`produce` followed by the chain's view ops, every dispatch mode off. Each node keeps its
    input's size, so the output sizes follow from the top (`shape`) down."""
    steps, out = [], shape
    for node in views:
        kind = type(node).__name__
        if kind == "TransposeBackward0":
            dim0, dim1 = node._saved_dim0 % len(out), node._saved_dim1 % len(out)
            steps.append(lambda x, a=dim0, b=dim1: x.transpose(a, b))
            out = tuple(out[dim1] if i == dim0 else out[dim0] if i == dim1 else s for i, s in enumerate(out))
        elif kind == "CloneBackward0":
            steps.append(lambda x: x.clone(memory_format=torch.contiguous_format))
        else:
            expand = kind == "ExpandBackward0"
            steps.append((lambda x, s=out: x.expand(s)) if expand else (lambda x, s=out: x.view(s)))
            out = tuple(node._saved_self_sym_sizes)

    def recompute() -> torch.Tensor:
        with _disable_current_modes(), torch.no_grad():
            value = produce()
            for step in reversed(steps):
                value = step(value)
            return value

    return recompute


def _reproduces(recipe: Callable[[], torch.Tensor], tensor: torch.Tensor) -> bool:
    value = recipe()
    with _disable_current_modes():
        same_layout = value.stride() == tensor.stride() and value.dtype == tensor.dtype
        return same_layout and torch.equal(value, tensor.detach())
