"""The guard as a guest of the tools around a model (issue 46), as a differential suite: each case runs
without a guard and under each mode on the same inputs, and compares values, graphs (node targets in
order) and tables.

- torch.func's transforms (grad, vjp, jacrev, jacfwd, jvp, vmap, hessian, functional_call) and eager
  double backward through every entry-point kind, at MPS's width (the guard's slow path: einsum always,
  SDPA's math path) and at a narrow width, where raise stops and chunk splits under the transform.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from mpsimpact.errors import EmulatedMpsError, NotEmulatedError, OversizedOpError
from mpsimpact.modes import backward as backward_module
from mpsimpact.modes.call_site import is_in_packages
from mpsimpact.modes.entrypoint import ENTRY_POINTS, FACTORY_POINTS
from mpsimpact.modes.emulator import emulate
from mpsimpact.modes.guard import guard

MODES = {  # name -> guard()'s arguments (CPU tensors guarded as MPS ones on a Mac)
    "raise": dict(mode="raise"), "chunk": dict(mode="chunk"),
    "strict raise": dict(mode="raise", strict=True), "strict chunk": dict(mode="chunk", strict=True),
}
NARROW = 6  # LIMIT 64, VIEW_LIMIT 32: the cases' operands and outputs cross a limit
PROFILE = "2.13.0"  # rule set B; cat past the limit silently wrong


def entered(name: str | None, **options):
    """The condition `name` (None: no guard) on CPU tensors."""
    if name is None:
        return contextlib.nullcontext()
    return guard(**MODES[name], devices=("cpu",), **options)


# Each entry-point kind (modes.entrypoint.ENTRY_POINTS) as a function of one input x of shape (4, 4, 12)
# (a sample: vmap adds a batch), its other operands fixed. At NARROW bits x (192 elements) and the outputs
# (96) pass LIMIT. Float64: a split's other order of sums stays far below the tolerance, second derivatives
# too.
DTYPE = torch.float64
_make = torch.Generator().manual_seed(0)
W = torch.randn(12, 6, generator=_make, dtype=DTYPE)  # (K, N)
W3 = torch.randn(4, 6, 12, generator=_make, dtype=DTYPE).transpose(1, 2)  # (B, K, N), a transposed view
BIAS = torch.randn(6, generator=_make, dtype=DTYPE)
KEYS = torch.randn(4, 8, 12, generator=_make, dtype=DTYPE)  # (B, Lk, D)
ENTRIES = {
    "matmul": lambda x: torch.matmul(x, W),
    "bmm": lambda x: x.bmm(W3),
    "baddbmm": lambda x: torch.baddbmm(BIAS, x, W3),
    "mm": lambda x: torch.mm(x.flatten(0, 1), W),
    "addmm": lambda x: torch.addmm(BIAS, x.flatten(0, 1), W),
    "linear": lambda x: F.linear(x, W.T, W[0]),
    "einsum": lambda x: torch.einsum("bmk,bkn->bmn", x, W3),
    "sdpa": lambda x: F.scaled_dot_product_attention(x.repeat(1, 4, 1), KEYS, KEYS),  # 4 * 16 * 8 scores
    "cat": lambda x: torch.cat([x, x.sin()], dim=1),
}


class Entry(nn.Module):
    """An entry-point call whose fixed operand is a parameter (for functional_call)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.scale = name, nn.Parameter(torch.ones(12, dtype=DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ENTRIES[self.name](x * self.scale)


def scalar(f):
    return lambda x: f(x).sin().sum()


def functional_grad(name: str, x: torch.Tensor) -> torch.Tensor:
    module = Entry(name)
    params = {key: value.detach() * 1.5 for key, value in module.named_parameters()}
    return torch.func.grad(lambda p: torch.func.functional_call(module, p, (x,)).sin().sum())(params)["scale"]


def double_backward(f, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(scalar(f)(x), x, create_graph=True)
    return torch.autograd.grad(g.pow(2).sum(), x)[0]


TRANSFORMS = {  # name -> (entry name, x) -> value
    "grad": lambda n, x: torch.func.grad(scalar(ENTRIES[n]))(x),
    "vjp": lambda n, x: torch.func.vjp(ENTRIES[n], x)[1](torch.ones_like(ENTRIES[n](x)))[0],
    "jacrev": lambda n, x: torch.func.jacrev(ENTRIES[n])(x),
    "jacfwd": lambda n, x: torch.func.jacfwd(ENTRIES[n])(x),
    "jvp": lambda n, x: torch.func.jvp(ENTRIES[n], (x,), (torch.ones_like(x),))[1],
    "vmap": lambda n, x: torch.func.vmap(ENTRIES[n])(torch.stack([x, x.cos(), -x])),
    "vmap(grad)": lambda n, x: torch.func.vmap(torch.func.grad(scalar(ENTRIES[n])))(torch.stack([x, -x])),
    "hessian": lambda n, x: torch.func.hessian(scalar(ENTRIES[n]))(x[:, :1]),
    "functional_call": functional_grad,
    "double backward": lambda n, x: double_backward(ENTRIES[n], x),
}


def sample(name: str) -> torch.Tensor:
    return torch.randn(4, 4, 12, generator=torch.Generator().manual_seed(1), dtype=DTYPE)


def transformed(transform: str, entry: str, condition: str | None, **options):
    with entered(condition, **options) as g:
        value = TRANSFORMS[transform](entry, sample(entry))
    return value, g


# At MPS's width every call of these takes the fast path; the transforms that vmap (jacrev, jacfwd, hessian)
# are run where the guard acts on them, at a narrow width below.
UNSPLIT = ("grad", "vjp", "jvp", "vmap", "vmap(grad)", "functional_call", "double backward")


@pytest.mark.parametrize("transform", UNSPLIT)
@pytest.mark.parametrize("entry", ENTRIES)
def test_transforms_at_mps_width_give_the_unguarded_values_in_every_mode(entry, transform):
    want, _ = transformed(transform, entry, None)
    for condition in MODES:
        got, g = transformed(transform, entry, condition)
        assert not g.stopped and not g.chunked, condition
        if condition.startswith("strict"):  # a dispatch mode on every op: torch's subclass branches
            torch.testing.assert_close(got, want, msg=condition)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=condition)


# At NARROW bits under chunk the calls that fault are split (forward, backward, the transforms' batched
# calls): the values are the plain ones within the tolerance of sums in another order; raise stops.
SPLIT = ("grad", "vjp", "jacrev", "jacfwd", "jvp", "vmap", "hessian", "functional_call", "double backward")
# SDPA at 8 bits (LIMIT 256): a piece keeps one key head whole (8 * 12 < VIEW_LIMIT 128), the 512 scores
# cross; on 2.12.1, whose fused SDPA is wrong past LIMIT scores (without gradients: jvp, vmap).
OPTIONS = {"sdpa": dict(index_bits=8, profile="2.12.1")}
# vmap's batch rule for bmm copies the transposed W3 into one contiguous batch: no rule applies to what runs.
NOTHING_TO_SPLIT = {("bmm", "vmap"), ("baddbmm", "vmap"), ("einsum", "vmap")}


@pytest.mark.parametrize("transform", SPLIT)
@pytest.mark.parametrize("entry", ["matmul", "bmm", "baddbmm", "addmm", "linear", "einsum", "sdpa", "cat"])
def test_transforms_at_a_narrow_width_chunk_to_the_unguarded_values_and_raise_stops(entry, transform):
    options = OPTIONS.get(entry, dict(index_bits=NARROW, profile=PROFILE))
    want, _ = transformed(transform, entry, None)
    got, g = transformed(transform, entry, "chunk", **options)
    torch.testing.assert_close(got, want)
    if (entry, transform) in NOTHING_TO_SPLIT:
        assert not g.chunked
        return
    assert g.chunked, "nothing was split: the case does not test the guard"
    with pytest.raises(OversizedOpError):
        transformed(transform, entry, "raise", **options)


# The slow path that judges and lets the call run: at NARROW bits x (4, 12) has 48 >= VIEW_LIMIT 32 elements,
# so each call goes through the dispatch mode (an autograd.Function with gradients), yet every 2-D product
# stays below LIMIT 64, where mm is right whatever its layouts: raise stops nothing. (Under vmap the batched
# products pass LIMIT: the narrow test above covers those.)
W2 = torch.randn(12, 2, generator=_make, dtype=DTYPE)  # (K, N)
SLOW = {
    "matmul": lambda x: torch.matmul(x, W2), "mm": lambda x: torch.mm(x, W2),
    "addmm": lambda x: torch.addmm(W2[0], x, W2), "linear": lambda x: F.linear(x, W2.T, W2[0]),
    "einsum": lambda x: torch.einsum("ik,kn->in", x, W2),
}
UNBATCHED = {
    "grad": lambda f, x: torch.func.grad(scalar(f))(x),
    "vjp": lambda f, x: torch.func.vjp(f, x)[1](torch.ones(4, 2, dtype=DTYPE))[0],
    "jvp": lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1],
    "double backward": double_backward,
}


@pytest.mark.parametrize("transform", UNBATCHED)
@pytest.mark.parametrize("entry", SLOW)
def test_the_slow_path_under_raise_gives_the_unguarded_values(entry, transform, monkeypatch):
    import mpsimpact.modes.guard_entry as guard_module  # where the slow path is taken

    slow = []
    monkeypatch.setattr(guard_module, "run_with_backward_under",
                        lambda *a: slow.append(1) or backward_module.run_with_backward_under(*a))
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(5), dtype=DTYPE)
    want = UNBATCHED[transform](SLOW[entry], x)
    with entered("raise", index_bits=NARROW, profile=PROFILE) as g:
        got = UNBATCHED[transform](SLOW[entry], x)
    assert slow and not g.stopped, "the call did not take the slow path"
    torch.testing.assert_close(got, want, rtol=0, atol=0)

# torch.jit.trace: the graph torch records without a guard (nodes, their order, source lines and value
# names), jit.trace's own check passing (it traces again under no_grad, where SDPA's route differs), and
# torch.jit.save of the result.
class LinearEinsum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)  # (B, L, 12), needs gradients
        return torch.einsum("bld,bmd->blm", h, x * 2.0)  # (B, L, L)


class LinearCausal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.linear(x)[:, None]  # (B, 1, L, 12)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


class EveryEntry(nn.Module):
    """Every entry-point kind, as the methods and operators a model writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(12, 12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        h = torch.matmul(x, w) + x @ w + x.matmul(w) + F.linear(x, w)  # (B, L, 12)
        h = torch.bmm(h, x.transpose(1, 2)) + torch.baddbmm(h[..., :1], x, x.mT)  # (B, L, L)
        rows = h.flatten(0, 1)  # (B*L, L)
        flat = torch.mm(rows, x[0]) + torch.addmm(x.flatten(0, 1), rows, x[0])  # (B*L, 12)
        s = F.scaled_dot_product_attention(x, x, x) + torch.einsum("bld,de->ble", x, w)
        return torch.cat([flat.flatten(), s.flatten(), torch.concat([w.flatten()])])


TRACED = {"linear, einsum of a scaled input": LinearEinsum, "linear, causal SDPA": LinearCausal,
          "every entry point": EveryEntry}
_MANGLED = re.compile(r"___torch_mangle_\d+\.")
_SOURCE = re.compile(r"# (\S+\.py):\d+")  # a node's source line in a graph's text


def ours(graph: str) -> list[str]:
    """The source files of a graph's nodes that are mpsimpact's own code: by the package's folders, so a clone, a
    venv or a home folder named mpsimpact (the user's code, named in the graph) counts as the user's."""
    return [path for path in _SOURCE.findall(graph) if is_in_packages(path, ("mpsimpact", "mpsimpact.scenarios"))]


def traced(model: str, condition: str | None, path) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(the traced graph as text, its output, the output of what torch.jit.save wrote and load read)."""
    torch.manual_seed(3)
    module, x = TRACED[model](), torch.randn(2, 4, 12)
    with entered(condition), warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)  # the guard adds nothing to warn of
        graph_module = torch.jit.trace(module, (x,))  # check_trace: traced again and compared
        torch.jit.save(graph_module, path)
        out = graph_module(x)
    return _MANGLED.sub("", str(graph_module.inlined_graph)), out, torch.jit.load(path)(x)


@pytest.mark.parametrize("model", TRACED)
def test_jit_trace_records_torchs_graph_in_every_mode_and_saves(model, tmp_path):
    want, out, _ = traced(model, None, tmp_path / "plain.pt")
    assert "prim::PythonOp" not in want and ours(want) == [] and _SOURCE.findall(want)  # the test's lines
    for condition in MODES:
        got, got_out, loaded = traced(model, condition, tmp_path / "guarded.pt")
        assert got == want, condition  # node kinds in order, source lines (the test's), value names
        torch.testing.assert_close(got_out, out, msg=condition)
        torch.testing.assert_close(loaded, out, msg=condition)


# What torch and libraries build while a guard is active keeps working as torch's own, inside and after it:
# tables keyed by torch's callables (the __torch_function__ idiom), names bound to them, torch's own tables
# of its callables, pickles of them.
class Logged:
    """A tensor-like with __torch_function__ and its handler table: the idiom of torch's docs."""

    def __init__(self, value: torch.Tensor, table: dict) -> None:
        self.value, self.table = value, table

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        leaves, spec = tree_flatten(args)
        table = next(a.table for a in leaves if isinstance(a, Logged))
        if func not in table:
            return NotImplemented
        plain = tree_unflatten([a.value if isinstance(a, Logged) else a for a in leaves], spec)
        return table[func](*plain, **(kwargs or {}))


def handler_table() -> dict:
    """Handlers keyed by the public callables, as a library writes them (evaluated where it is built)."""
    return {torch.matmul: lambda a, b: ("matmul", a @ b), F.linear: lambda x, w: ("linear", x @ w.T),
            torch.bmm: lambda a, b: ("bmm", a @ b), torch.einsum: lambda eq, *ts: ("einsum", len(ts)),
            torch.cat: lambda ts, dim=0: ("cat", torch.tensor(len(ts))),
            torch.Tensor.matmul: lambda a, b: ("Tensor.matmul", a.as_subclass(torch.Tensor) @ b)}


class LoggedTensor(torch.Tensor):
    """A tensor subclass whose __torch_function__ reads the same kind of table (torch passes a Tensor method
    as the attribute of torch.Tensor)."""

    table: dict = {}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.table:
            return cls.table[func](*args, **(kwargs or {}))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def use_table(table: dict) -> list:
    a, w = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(4)), torch.eye(3)
    x = Logged(a, table)
    LoggedTensor.table = table
    method = a.as_subclass(LoggedTensor).matmul(w)
    return [torch.matmul(x, w), F.linear(x, w), torch.bmm(x, a), torch.einsum("bij,jk->bik", x, w),
            torch.cat([x, x]), method]


def same_values(got, want) -> None:
    for (name, value), (want_name, want_value) in zip(got, want, strict=True):
        assert name == want_name
        torch.testing.assert_close(value, want_value, rtol=0, atol=0)


@pytest.mark.parametrize("condition", MODES)
def test_a_handler_table_built_inside_a_guard_dispatches_inside_and_after_it(condition):
    outside = handler_table()  # a library imported before the guard
    want = use_table(outside)
    with entered(condition):
        inside = handler_table()
        same_values(use_table(inside), want)
        same_values(use_table(outside), want)
    same_values(use_table(inside), want)


LATE_MODULE = """
import torch
from torch import bmm, cat, einsum, matmul
from torch.nn.functional import linear, scaled_dot_product_attention


def uses_names(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = linear(matmul(a, b), b[0]) + einsum("bij,bjk->bik", a, b)
    return cat([bmm(h, b), scaled_dot_product_attention(h, h, h)])
"""


def plain_uses_names(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = F.linear(torch.matmul(a, b), b[0]) + torch.einsum("bij,bjk->bik", a, b)
    return torch.cat([torch.bmm(h, b), F.scaled_dot_product_attention(h, h, h)])


@pytest.mark.parametrize("condition", MODES)
def test_names_bound_inside_a_guard_work_after_it_scripted_traced_and_pickled(condition, tmp_path,
                                                                                monkeypatch):
    # A library imported inside a guard: its names are the wrappers. After the guard they call torch, script
    # to torch's graph, trace to torch's callables and pickle as torch's.
    (tmp_path / "late_library.py").write_text(LATE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with entered(condition):
        import late_library
    try:
        a, b = torch.randn(2, 3, 3), torch.randn(2, 3, 3)
        want = plain_uses_names(a, b)
        torch.testing.assert_close(late_library.uses_names(a, b), want, rtol=0, atol=0)
        scripted = torch.jit.script(late_library.uses_names)
        plain_kinds = [n.kind() for n in torch.jit.script(plain_uses_names).graph.nodes()]
        assert [n.kind() for n in scripted.graph.nodes()] == plain_kinds
        torch.testing.assert_close(scripted(a, b), want, rtol=0, atol=0)
        fx_targets = call_targets(torch.fx.symbolic_trace(late_library.uses_names).graph)
        assert fx_targets == call_targets(torch.fx.symbolic_trace(plain_uses_names).graph)
        assert torch.bmm in fx_targets  # torch's own callable, by identity
        for name in ("bmm", "cat", "matmul"):
            assert pickle.dumps(getattr(late_library, name)) == pickle.dumps(getattr(torch, name))
    finally:
        del sys.modules["late_library"]


def call_targets(graph) -> list:
    return [node.target for node in graph.nodes if node.op == "call_function"]


# Pickle: every wrapped callable, entry points and factories (wrapped for a gated strict guard).
PLACES = [(owner, attribute) for group in (ENTRY_POINTS, FACTORY_POINTS) for places in group.values()
          for owner, attribute in places]
# See Note [Wrappers as good guests] (modes/stand_in.py): these three pickle by a path (torch._C._nn.linear,
# torch.functional.einsum) that does not lead to the wrapper, so the wrapper pickles by its public path,
# which loads the same callable (why the wrapper cannot stand at torch's path: BOUND_BEFORE below).
BY_PUBLIC_PATH = {(F, "linear"): b"torch.nn.functional", (torch, "einsum"): b"torch",
                  (F, "scaled_dot_product_attention"): b"torch.nn.functional"}


def pickled() -> dict:
    return {(owner, attribute): pickle.dumps(getattr(owner, attribute)) for owner, attribute in PLACES}


def test_every_wrapped_callable_pickles_as_torchs_own():
    want = pickled()
    with guard("raise", strict=True, devices=("cuda",)):  # gated (CUDA counts bytes): factories wrapped too
        wrappers = {place: getattr(*place) for place in PLACES}
        got = pickled()
        loaded = {place: pickle.loads(data) for place, data in got.items()}
        copies = {place: copy.deepcopy(wrapper) for place, wrapper in wrappers.items()}
    for place, wrapper in wrappers.items():
        assert wrapper is not getattr(*place)  # it was a wrapper
        assert loaded[place] == wrapper == getattr(*place) and copies[place] is wrapper
        if place in BY_PUBLIC_PATH:
            assert got[place] != want[place] and BY_PUBLIC_PATH[place] in got[place], place
            assert pickle.loads(pickle.dumps(wrapper)) is getattr(*place)  # after: torch's own
        else:
            assert got[place] == want[place] == pickle.dumps(wrapper), place  # inside and after


def test_torchs_tables_first_built_inside_a_guard_list_torchs_own_callables():
    # In a fresh process (torch builds them once): torch.overrides' tables, which TorchDynamo reads, first
    # asked for inside a guard, equal the same tables computed again after it; Dynamo first imported inside a
    # guard compiles the same graph there and after. The wrappers' first installation, whatever the mode,
    # builds them first.
    out = run_python("""
        import torch, torch.nn.functional as F
        import torch.overrides as overrides
        from mpsimpact.modes.guard import guard

        def f(x, w):
            return torch.matmul(x, w) + x.matmul(w) + F.linear(x, w) + x @ w + torch.cat([x, w]).sum()

        x, w = torch.randn(4, 4), torch.randn(4, 4)
        with guard("chunk", devices=("cpu",), strict=True):
            tables = overrides.get_overridable_functions()
            names = [overrides.resolve_name(f) for f in (torch.matmul, F.linear, torch.Tensor.matmul)]
        print(tables == overrides._get_overridable_functions.__wrapped__()[0])
        print(torch.matmul in tables[torch], F.linear in tables[F], names)
        with guard("raise", devices=("cpu",)):
            from torch._dynamo.testing import CompileCounter
            inside = CompileCounter()
            torch.compile(f, backend=inside, fullgraph=True)(x, w)
        torch._dynamo.reset()
        after = CompileCounter()
        torch.compile(f, backend=after, fullgraph=True)(x, w)
        print(inside.frame_count, inside.op_count == after.op_count, after.frame_count)
    """)
    assert out.split("\n")[:3] == [
        "True", "True True ['torch.matmul', 'torch.nn.functional.linear', 'torch.Tensor.matmul']", "1 True 1"]


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


# Other modes: a user's TorchFunctionMode or TorchDispatchMode, entered outside or inside the guard, logs the
# calls it logs without one (the guard's reads of sizes, its Function's detaches and its decompositions of
# calls it lets run are its own).
class FunctionLog(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__qualname__", str(func)))
        return func(*args, **(kwargs or {}))


class DispatchLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def model_step(x: torch.Tensor, w: torch.Tensor) -> None:
    h = F.linear(torch.matmul(x, w), w) + torch.einsum("bij,jk->bik", x, w) + x @ w + x.bmm(w.expand(2, 8, 8))
    out = torch.cat([F.scaled_dot_product_attention(h, h, h), h], dim=1).sum()
    if out.requires_grad:
        out.backward()


def logged(log_class, where: str, condition: str | None, grad_mode) -> list[str]:
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(6))
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(7), requires_grad=True)
    log = log_class()
    outer, inner = (log, entered(condition)) if where == "outside" else (entered(condition), log)
    with grad_mode(), outer, inner:
        model_step(x, w)
    return log.seen


class FunctionsHanded(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.funcs: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


# Why F.linear, SDPA and torch.einsum pickle by their public path inside a guard (BY_PUBLIC_PATH): pickle writes
# torch's path (torch._C._nn.linear, torch.functional.einsum) only where it leads to the very object pickled, and
# torch looks its callable up at that same path to hand `__torch_function__` its `func`. A wrapper standing there
# would be the `func` every TorchFunctionMode, tensor subclass and FX proxy is handed for these three while a guard
# is active: no longer the callable they bound before it (`func is F.linear` taken at import).
BOUND_BEFORE = {"linear": F.linear, "sdpa": F.scaled_dot_product_attention, "einsum": torch.einsum}


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_users_mode_is_handed_torchs_own_linear_sdpa_and_einsum_inside_a_guard(where):
    x = torch.randn(1, 2, 4)
    w = x[0]
    for condition in (None, "raise", "strict chunk"):
        mode = FunctionsHanded()
        outer, inner = (mode, entered(condition)) if where == "outside" else (entered(condition), mode)
        with outer, inner:
            F.linear(x, w), F.scaled_dot_product_attention(x, x, x), torch.einsum("bij,bkj->bik", x, x)
        handed = [name for func in mode.funcs for name, bound in BOUND_BEFORE.items() if func is bound]
        assert handed == ["linear", "sdpa", "einsum"], condition


@pytest.mark.parametrize("grad_mode", [torch.enable_grad, torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("log_class", [FunctionLog, DispatchLog])
def test_a_users_mode_sees_the_calls_it_sees_without_a_guard(log_class, where, grad_mode):
    want = logged(log_class, where, None, grad_mode)
    assert want
    for condition in MODES:
        assert logged(log_class, where, condition, grad_mode) == want, condition


# torch.export with a dynamic batch dim: every op family the guard judges keeps it dynamic under each mode,
# strict too (See Note [Symbolic sizes] in modes/guard_mode.py): the same graph, the same range, the same values.
class EveryFamily(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.embedding, self.norm = nn.Linear(8, 8), nn.Embedding(10, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.linear(x) + self.embedding(ids)  # (B, L, 8): addmm/linear, embedding, elementwise
        h = self.norm(torch.cat([h, x], dim=1))  # (B, 2L, 8): cat, layer norm
        scores = torch.matmul(h, h.transpose(1, 2)).softmax(-1)  # (B, 2L, 2L): matmul/bmm, softmax
        h = torch.bmm(scores, h) + torch.einsum("bld,de->ble", h, self.linear.weight)
        h = torch.baddbmm(h, scores, h) + F.scaled_dot_product_attention(h, h, h)
        rows = h.flatten(0, 1)  # (B*2L, 8)
        flat = torch.addmm(self.linear.bias, rows, self.linear.weight) + torch.mm(rows, h[0, :8])
        masked = flat.masked_fill(flat > 0, 0.0) + torch.zeros_like(flat) + torch.full_like(flat, 0.5)
        return masked.sum(-1) + masked.amax(-1) + masked.mean()  # (B*2L,): reductions


def exported(condition: str | None, strict_export: bool):
    torch.manual_seed(8)
    module, x, ids = EveryFamily(), torch.randn(3, 5, 8), torch.randint(0, 10, (3, 5))
    batch = torch.export.Dim("batch")
    with entered(condition):
        program = torch.export.export(module, (x, ids), dynamic_shapes=({0: batch}, {0: batch}),
                                      strict=strict_export)
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    other = (torch.randn(7, 5, 8), torch.randint(0, 10, (7, 5)))  # another batch size: still dynamic
    return targets, str(program.range_constraints), program.module()(*other), module(*other)


def same_export(conditions, strict_export: bool) -> None:
    want_targets, want_ranges, _, _ = exported(None, strict_export)
    for condition in conditions:
        targets, ranges, got, plain = exported(condition, strict_export)
        assert (targets, ranges) == (want_targets, want_ranges), condition
        torch.testing.assert_close(got, plain, msg=condition)


def test_export_keeps_dynamic_dims_dynamic_under_raise_and_strict():
    same_export(("raise", "strict chunk"), strict_export=False)  # an export costs a second: the rest is slow


@pytest.mark.slow
@pytest.mark.parametrize("strict_export", [False, True], ids=["non-strict export", "strict export"])
def test_export_keeps_dynamic_dims_dynamic_under_every_mode(strict_export):
    same_export(MODES, strict_export)


# Nested tensors (torch.nested), both layouts: See Note [Nested tensors] in modes/shape_table.py. Components
# (3, 8) and (5, 8): 64 elements, so at NARROW bits the products' outputs (128) and cat's cross the limits.
NESTED_CALLS = {
    "linear": lambda x, w: F.linear(x, w),
    "matmul": lambda x, w: torch.matmul(x, w.t()),  # the strided layout: torch refuses nested @ dense
    "cat": lambda x, w: torch.cat([x, x], dim=-1),
    "bmm by its own transpose": lambda x, w: torch.bmm(x, x.transpose(-1, -2)),  # jagged: torch refuses
}


def nested_outcome(layout, call: str, condition: str | None, **options):
    """What the call gives (its components) or raises (type and message), under a condition."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided layout is a prototype, and says so
        x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=layout)
    try:
        with entered(condition, **options):
            return NESTED_CALLS[call](x, torch.ones(16, 8)).unbind()
    except RuntimeError as e:  # torch's, the guard's and the emulator's errors alike
        return e


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
@pytest.mark.parametrize("call", NESTED_CALLS)
def test_a_nested_tensor_gives_under_every_mode_what_it_gives_without_one(layout, call):
    torch.manual_seed(0)
    want = nested_outcome(layout, call, None)
    for condition in MODES:
        torch.manual_seed(0)
        got = nested_outcome(layout, call, condition)
        if isinstance(want, Exception):  # torch's own refusal, not the guard's
            assert type(got) is type(want), (condition, got)  # a jagged dim's name (j1) is the process's count
            assert re.sub(r"j\d+", "j", str(got)) == re.sub(r"j\d+", "j", str(want)), (condition, got)
        else:
            assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True)), condition


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
def test_the_emulator_takes_a_nested_tensor_as_a_dense_one_or_says_it_cannot(layout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided layout is a prototype, and says so
        x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=layout)
    w = torch.randn(16, 8)
    want = F.linear(x, w).unbind()
    with emulate(profile=PROFILE):  # far below every limit: what runs here is what MPS computes
        got = F.linear(x, w).unbind()
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(got, want, strict=True))
    with pytest.raises(RuntimeError) as stopped, emulate(index_bits=NARROW, profile=PROFILE):
        F.linear(x, w)
    if layout is torch.jagged:  # its dense mm, emulated as any: 2.13.0 aborts there (an error in emulation)
        assert stopped.type is EmulatedMpsError and "mm[8, 8] @ [8, 16]" in str(stopped.value)
    else:
        assert stopped.type is NotEmulatedError and "strided nested tensor" in str(stopped.value)


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
@pytest.mark.parametrize("call", ["linear", "cat"])
def test_a_nested_tensors_call_past_a_limit_is_stopped_or_split(layout, call):
    torch.manual_seed(0)
    want = nested_outcome(layout, call, None)
    for condition in MODES:
        torch.manual_seed(0)
        got = nested_outcome(layout, call, condition, index_bits=NARROW, profile=PROFILE)
        if "chunk" in condition and layout is torch.jagged:  # its dense ops, split as any dense op
            assert all(torch.allclose(g, e, atol=1e-5) for g, e in zip(got, want, strict=True)), condition
        else:
            assert isinstance(got, OversizedOpError), (condition, got)
            assert ("mm[8, 8] @ [8, 16]" if call == "linear" else "cat to [") in str(got)
            if layout is torch.strided and "chunk" in condition:
                assert "does not split a nested tensor's call" in str(got)
