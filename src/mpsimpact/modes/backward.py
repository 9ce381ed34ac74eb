"""Running one call under a dispatch mode together with the derivatives torch takes of it: its backward
pass (eager autograd, `create_graph` too) and, under torch.func's transforms (grad, vjp, jacrev, jacfwd,
jvp, vmap, hessian), their derivatives. The guard's route for a call that may cross a limit and needs
gradients. See Note [A call's derivatives under a mode]."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._pytree import tree_flatten, tree_unflatten

from mpsimpact.modes.base import needs_grad

# Note [A call's derivatives under a mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Autograd runs a backward pass from C++, past every Python entry point, often after the guard has left.
# So a call that may cross a limit runs as one autograd.Function (`_UnderMode`) whose forward computes it
# under the guard's dispatch mode and whose backward enters the mode again. The Function is written in
# the form torch.func composes with (forward without ctx, `setup_context`, `jvp`, `generate_vmap_rule`):
# - eager, first order: the forward keeps the graph it recorded under the mode (on detached inputs), and
#   backward differentiates it: one forward's compute, as without the guard;
# - a derivative of the backward (`create_graph=True`: a Hessian-vector product, a gradient penalty; every
#   backward under torch.func, which differentiates with create_graph) or a second backward through the
#   same graph: backward computes the call again from its saved inputs, under the mode, and
#   differentiates that, so the result stays differentiable (the forward's compute once more);
# - forward mode (torch.func's jvp and jacfwd; torch.autograd.forward_ad on a tensor that also requires
#   gradients): `jvp` computes the call's tangent under the mode;
# - vmap: functorch runs forward, backward and jvp on batched tensors (generate_vmap_rule), so the mode
#   sees the calls MPS would run: the physical, batched ones.
# The Function's own detaches run unseen by other dispatch modes (See Note [Calls other modes see] in
# modes/entrypoint.py); where a derivative computes the call again, they see that computation.
# Every tensor of the call is an input of the Function, not captured by it (functorch cannot lift a
# captured tensor of a transform's level). While torch.jit.trace records, the guard takes no Function (the
# trace would hold a prim::PythonOp where torch records the aten op): the call runs under the mode, and a
# backward of the traced graph runs unjudged, as the traced graph's later runs do.


def needs_derivatives(tensors: Iterable[Any]) -> bool:
    """Whether torch will take derivatives of a call on these tensors: autograd records it, or a torch.func
    transform runs (whose tensors' requires_grad says nothing of an outer grad level under vmap)."""
    return torch._C._are_functorch_transforms_active() or needs_grad(tensors)


def run_with_backward_under(mode: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` under the dispatch `mode`, with its derivatives under `mode` too (See Note
    [A call's derivatives under a mode]). `fn` returns one tensor."""
    leaves, spec = tree_flatten((args, kwargs))
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def inner(*tensors: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, tensor in zip(at, tensors):
            filled[i] = tensor
        call_args, call_kwargs = tree_unflatten(filled, spec)
        return fn(*call_args, **call_kwargs)

    keep = _Kept() if not torch._C._are_functorch_transforms_active() else None
    return _UnderMode.apply(mode, inner, keep, *[leaves[i] for i in at])


class _Kept:
    """What an eager forward recorded for backward, handed from forward to setup_context: (the call's
    tensors, detached, those that require gradients requiring them again; the output with the graph
    recorded on them)."""

    recorded: tuple[list[torch.Tensor], torch.Tensor] | None = None


_FIXED = 3  # the Function's inputs before the call's tensors: mode, inner, kept


class _UnderMode(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(mode: Any, inner: Callable[..., Any], kept: _Kept | None, *tensors: torch.Tensor) -> Any:
        if kept is None:
            with mode:
                return inner(*tensors)
        detached = [_detached(x).requires_grad_(x.requires_grad) for x in tensors]
        with torch.enable_grad(), mode:
            out = inner(*detached)
        kept.recorded = detached, out
        return _detached(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        mode, inner, kept, *tensors = inputs
        ctx.mode, ctx.inner = mode, inner
        ctx.recorded = kept.recorded if kept is not None else None
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        needs = ctx.needs_input_grad[_FIXED:]
        recorded, ctx.recorded = ctx.recorded, None  # this backward frees it: a second one computes again
        with ctx.mode:
            if recorded is not None and not torch.is_grad_enabled():
                tensors, out = recorded
                wanted = [x for x, need in zip(tensors, needs) if need]
                found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
            else:  # computed again, differentiable where the backward is itself differentiated
                found = iter(_vjp(ctx.inner, ctx.saved_tensors, needs, grad))
        return (None,) * _FIXED + tuple(next(found) if need else None for need in needs)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        primals, tangents = ctx.saved_tensors, tangents[_FIXED:]
        with ctx.mode:
            if torch._C._are_functorch_transforms_active():
                filled = tuple(torch.zeros_like(p) if t is None else t for p, t in zip(primals, tangents))
                return torch.func.jvp(ctx.inner, tuple(primals), filled)[1]
            return _eager_tangent(ctx.inner, primals, tangents)


def _detached(x: torch.Tensor) -> torch.Tensor:
    """`x.detach()`, unseen by the dispatch modes active (a user's): the Function's own plumbing, not a call
    of the model. A tensor subclass (FakeTensor, a wrapper subclass) detaches as it would anyway."""
    if type(x) is not torch.Tensor:
        return x.detach()
    with torch._C._DisableTorchDispatch():
        return x.detach()


def _vjp(inner: Callable[..., Any], tensors: tuple, needs: tuple, grad: torch.Tensor) -> tuple:
    """The gradients of `inner(*tensors)` for the tensors that need one, by torch.func.vjp: the call
    computed again, differentiable by whatever differentiates the backward (autograd with create_graph,
    an outer transform)."""
    def of_wanted(*wanted: torch.Tensor) -> Any:
        found = iter(wanted)
        return inner(*(next(found) if need else x for x, need in zip(tensors, needs)))

    _, vjp_fn = torch.func.vjp(of_wanted, *(x for x, need in zip(tensors, needs) if need))
    return vjp_fn(grad)


def _eager_tangent(inner: Callable[..., Any], primals: tuple, tangents: tuple) -> torch.Tensor:
    """The tangent of `inner(*primals)` under torch.autograd.forward_ad, at the dual level being computed
    (torch nests no other): the primals taken as constants of any reverse-mode graph."""
    with fwAD._set_fwd_grad_enabled(True):
        duals = [p if t is None else fwAD.make_dual(p.detach(), t) for p, t in zip(primals, tangents)]
        return fwAD.unpack_dual(inner(*duals)).tangent
