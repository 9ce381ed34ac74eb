"""The entry-point wrappers are good guests: while a guard is installed, TorchScript, pickle, FX, export and
torch.compile treat torch.matmul, F.linear, torch.bmm, torch.cat and friends as torch's own; without a
guard torch is untouched; and the guard (strict too) stays out of program transforms' way.
See Note [Wrappers as good guests] in mpsimpact/modes/stand_in.py."""

import copy
import functools
import inspect
import io
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpsimpact.modes.entrypoint import ENTRY_POINTS, _INSTALLED
from mpsimpact.errors import OversizedOpError
from mpsimpact.modes.guard import guard, install_thread_guard, uninstall_thread_guard

D = 8


def uses_all(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = F.linear(torch.matmul(x, w), w)
    h3 = torch.bmm(h.unsqueeze(0), w.unsqueeze(0))
    return torch.cat([h3[0], x], dim=0)


class UsesAll(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(torch.matmul(x, self.w), self.w)
        h3 = torch.bmm(h.unsqueeze(0), self.w.unsqueeze(0))
        return torch.cat([h3[0], x], dim=0)


ORIGINALS = {attribute: getattr(owner, attribute) for places in ENTRY_POINTS.values()
             for owner, attribute in places if owner is not torch.Tensor}  # no guard yet: torch's own


def originals():
    """torch's own callables (plain calls, no guard)."""
    return ORIGINALS


def expected(x, w):
    o = originals()
    h = o["linear"](o["matmul"](x, w), w)
    return o["cat"]([o["bmm"](h.unsqueeze(0), w.unsqueeze(0))[0], x], dim=0)


@pytest.fixture
def after_a_guard():
    """A guard is installed on this thread (and works): the wrappers are in place, as for a user of the
    one-liner; uninstalled after the test, which leaves torch as it was."""
    a, b = torch.randn(20, 64, 64), torch.randn(20, 64, 2)  # wraps at index width 16: see test_guard_coverage
    installed = install_thread_guard("raise", index_bits=16, devices=("cpu",))
    try:
        with pytest.raises(OversizedOpError):
            torch.bmm(a, b)
        assert len(installed.stopped) == 1
        assert torch.matmul is not originals()["matmul"] and F.linear is not originals()["linear"]  # wrapped
        yield installed
    finally:
        uninstall_thread_guard()
    assert torch.matmul is originals()["matmul"] and F.linear is originals()["linear"] and not _INSTALLED


def run_python(code: str, cwd=None) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_torchscript_compiles_a_function_calling_the_wrapped_entry_points(after_a_guard):
    scripted = torch.jit.script(uses_all)
    kinds = {node.kind() for node in scripted.graph.nodes()}
    assert {"aten::matmul", "aten::linear", "aten::bmm", "aten::cat"} <= kinds  # builtins, not Python
    assert "prim::PythonOp" not in kinds
    x, w = torch.randn(5, D), torch.randn(D, D)
    torch.testing.assert_close(scripted(x, w), expected(x, w), rtol=0, atol=0)


def test_torchscript_compiles_a_module_calling_the_wrapped_entry_points(after_a_guard):
    module = UsesAll()
    scripted = torch.jit.script(module)
    x = torch.randn(5, D)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), module(x), rtol=0, atol=0)
        torch.testing.assert_close(scripted(x), expected(x, module.w), rtol=0, atol=0)


PICKLED = {
    "torch.matmul": (lambda: torch.matmul, lambda a, b: (a, b)),
    "F.linear": (lambda: F.linear, lambda a, b: (a, b.T)),
    "torch.Tensor.bmm": (lambda: torch.Tensor.bmm, lambda a, b: (a[None], b[None])),
    "torch.cat": (lambda: torch.cat, lambda a, b: ([a, b],)),
}


@pytest.mark.parametrize("name", PICKLED)
def test_pickle_round_trip_gives_the_public_callable(after_a_guard, name):
    # Equality held: unpickled is torch's callable (most pickle as their original: tests/test_guest_tools.py),
    # F.linear is the object at its public name in the loading process, here the wrapper.
    get, arguments = PICKLED[name]
    fn = get()
    assert inspect.unwrap(fn) is not fn  # a wrapper
    assert pickle.loads(pickle.dumps(fn)) == fn
    args = arguments(torch.randn(3, 4), torch.randn(4, 4))
    unpickled = pickle.loads(pickle.dumps(fn))
    torch.testing.assert_close(unpickled(*args), inspect.unwrap(fn)(*args), rtol=0, atol=0)


def test_a_pickled_partial_loads_as_torchs_own_callable_where_mpsimpact_is_absent(after_a_guard, tmp_path):
    # What a DataLoader worker or a spawned process receives: the torch function by its public name.
    w = torch.randn(4, 3)
    payload = tmp_path / "payload.pt"
    payload.write_bytes(pickle.dumps([torch.matmul, functools.partial(F.linear, weight=w)]))
    out = run_python(textwrap.dedent(f"""
        import pickle, sys, torch, torch.nn.functional as F
        matmul, lin = pickle.loads(open({str(payload)!r}, "rb").read())
        x = torch.randn(2, 3)
        assert "mpsimpact" not in sys.modules
        assert matmul is torch.matmul and lin.func is F.linear
        print(torch.equal(lin(x), F.linear(x, lin.keywords["weight"])))
    """))
    assert out.strip() == "True"


def test_names_docs_and_signatures_are_torchs(after_a_guard):
    for (owner, attribute), entry in _INSTALLED.items():
        wrapper, original = getattr(owner, attribute), entry.original
        assert wrapper is entry.wrapper and inspect.unwrap(wrapper) is original
        assert wrapper.__name__ == original.__name__ and wrapper.__doc__ == original.__doc__
        # torch's own path, but where pickle would look it up and not find the wrapper: the public one
        public = (owner.__name__, attribute) in {("torch.nn.functional", "linear"), ("torch", "einsum"),
                                                 ("torch.nn.functional", "scaled_dot_product_attention")}
        path = (owner.__name__, attribute) if public else (getattr(original, "__module__", None),
                                                            original.__qualname__)
        assert (wrapper.__module__, wrapper.__qualname__) == path
    assert inspect.signature(torch.einsum) == inspect.signature(originals()["einsum"])
    assert set(_INSTALLED) == {place for places in ENTRY_POINTS.values() for place in places}


def test_fx_symbolic_trace_still_works(after_a_guard):
    module = UsesAll()
    traced = torch.fx.symbolic_trace(module)
    x = torch.randn(5, D)
    torch.testing.assert_close(traced(x), module(x), rtol=0, atol=0)
    targets = {getattr(n.target, "__name__", n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert {"matmul", "linear", "bmm", "cat"} <= targets
    assert "torch.matmul(" in traced.code and "torch._C._nn.linear(" in traced.code


def test_torch_export_still_works(after_a_guard):
    module = UsesAll()
    x = torch.randn(5, D)
    exported = torch.export.export(module, (x,))
    ops = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert "aten.cat.default" in ops and any("mm" in op for op in ops)
    torch.testing.assert_close(exported.module()(x), module(x), rtol=0, atol=0)


def test_torch_compile_folds_the_wrappers_away_without_graph_breaks(after_a_guard):
    from torch._dynamo.testing import CompileCounter

    def everything(a, w, q):
        x = torch.matmul(a, w) + a @ w + a.matmul(w) + torch.mm(a, w) + torch.addmm(a, a, w) + a.mm(w)
        y = torch.bmm(x[None], w[None]) + torch.baddbmm(x[None], x[None], w[None]) + x[None].bmm(w[None])
        z = F.linear(y, w) + torch.einsum("bij,jk->bik", y, w)
        s = F.scaled_dot_product_attention(q, q, q)
        flat = [z.flatten(), s.flatten(), torch.concat([x.flatten()]), torch.concatenate([x.flatten()])]
        return torch.cat(flat)

    targets = []

    def backend(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return counter(gm, example_inputs)

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(everything, backend=backend, fullgraph=True)
    a, w, q = torch.randn(4, 4), torch.randn(4, 4), torch.randn(1, 2, 4, 4)
    with guard("raise", devices=("cpu",)):
        got = compiled(a, w, q)
    torch.testing.assert_close(got, everything(a, w, q))
    assert counter.frame_count == 1 and counter.op_count >= 20
    wrappers = {id(entry.wrapper) for entry in _INSTALLED.values()}
    assert originals()["matmul"] in targets and not [t for t in targets if id(t) in wrappers]  # torch's own


# A sample of how torch itself uses jit, pickle and fx on these functions, with the wrappers installed.

def test_torch_scripts_its_own_attention_and_transformer_layers(after_a_guard):
    # F.multi_head_attention_forward calls F's module-level `linear`, torch.bmm, torch.baddbmm,
    # torch.cat and scaled_dot_product_attention: all wrapped.
    layers = (nn.MultiheadAttention(16, 2, add_bias_kv=True),
              nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0))
    for module in layers:
        module.eval()
        scripted = torch.jit.script(module)
        x = torch.randn(6, 3, 16)
        args = (x, x, x) if isinstance(module, nn.MultiheadAttention) else (x,)
        torch.testing.assert_close(scripted(*args), module(*args))  # MultiheadAttention: (output, weights)


def test_torchscript_string_compilation_trace_save_and_load(after_a_guard, tmp_path):
    unit = torch.jit.CompilationUnit(
        "def f(a, w):\n    return torch.cat([torch.matmul(a, w), torch.nn.functional.linear(a, w)])\n")
    a, w = torch.randn(3, 3), torch.randn(3, 3)
    o = originals()
    torch.testing.assert_close(unit.f(a, w), o["cat"]([o["matmul"](a, w), o["linear"](a, w)]), rtol=0, atol=0)
    module = UsesAll()
    traced = torch.jit.trace(module, (torch.randn(5, D),))
    torch.jit.save(traced, tmp_path / "traced.pt")
    loaded = torch.jit.load(tmp_path / "traced.pt")
    x = torch.randn(5, D)
    torch.testing.assert_close(loaded(x), module(x), rtol=0, atol=0)


def test_torch_save_load_and_deepcopy_of_objects_holding_the_entry_points(after_a_guard):
    module = UsesAll()
    module.op = torch.matmul  # a module that keeps the function it applies, as some libraries do
    buffer = io.BytesIO()
    torch.save({"module": module, "linear": functools.partial(F.linear, bias=None)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded["module"].op == torch.matmul and loaded["linear"].func is F.linear  # torch's own matmul
    assert copy.deepcopy(module).op is torch.matmul
    x = torch.randn(5, D)
    torch.testing.assert_close(loaded["module"](x), module(x), rtol=0, atol=0)


def test_fx_normalizes_calls_of_the_wrapped_entry_points(after_a_guard):
    from torch.fx.experimental.normalize import NormalizeArgs
    from torch.fx.operator_schemas import get_signature_for_torch_op
    from torch.fx.passes.shape_prop import ShapeProp

    for fn in (torch.matmul, F.linear, torch.bmm, torch.cat):  # found through TorchScript's builtin table
        signatures = get_signature_for_torch_op(fn)
        assert signatures and signatures == get_signature_for_torch_op(inspect.unwrap(fn))
    traced = torch.fx.symbolic_trace(UsesAll())
    x = torch.randn(5, D)
    ShapeProp(traced).propagate(x)
    shapes = [n.meta["tensor_meta"].shape for n in traced.graph.nodes if n.op == "output"]
    assert shapes == [torch.Size([10, D])]
    normalized = NormalizeArgs(traced).transform()
    torch.testing.assert_close(normalized(x), traced(x), rtol=0, atol=0)


# Import order: a fresh interpreter each.

@pytest.mark.ci  # fresh processes: CI runs it after the default selection (pytest -m ci)
def test_names_bound_before_installation_still_script_and_compile(tmp_path):
    (tmp_path / "early.py").write_text(textwrap.dedent("""
        import torch
        from torch import matmul as early_matmul
        from torch.nn.functional import linear as early_linear
        # Dynamo's tables built before the wrappers exist:
        torch.compile(lambda x: x + 1, backend="eager", fullgraph=True)(torch.ones(1))

        import mpsimpact.modes.guard
        from torch._dynamo.testing import CompileCounter

        def f(x, w):
            return torch.cat([early_matmul(x, w), early_linear(x, w), torch.matmul(x, w)])

        with mpsimpact.modes.guard.guard("raise"):
            assert torch.matmul is not early_matmul
            x, w = torch.randn(3, 3), torch.randn(3, 3)
            counter = CompileCounter()
            same = torch.equal(torch.jit.script(f)(x, w), f(x, w))
            compiled = torch.compile(f, backend=counter, fullgraph=True)(x, w)
            print(same, torch.allclose(compiled, f(x, w)), counter.frame_count)
    """))
    assert run_python("import early", cwd=tmp_path).split() == ["True", "True", "1"]


def test_the_import_alone_leaves_torch_untouched_and_the_last_guard_restores_it_exactly():
    out = run_python(textwrap.dedent("""
        import threading
        import torch, torch.nn.functional as F
        from torch.jit import _builtins
        def state():  # every attribute of the three namespaces, and TorchScript's builtin table
            names = {(o.__name__, a): (getattr(o, a), a in vars(o))
                     for o in (torch, torch.Tensor, F) for a in dir(o)
                     if getattr(o, a) is getattr(o, a)}  # not Tensor.__dict__, a new proxy each time
            return names, dict(_builtins._get_builtin_table())
        def same(before, wrappers):  # torch's imports may add builtins of their own meanwhile
            (names, table), (names_now, table_now) = before, state()
            moved = [key for key, (v, own) in names.items() if names_now.get(key, (None,))[0] is not v
                     or names_now[key][1] != own]
            kept = all(table_now.get(k) == v for k, v in table.items())
            return sorted(moved), kept, sorted(w.__name__ for w in wrappers if id(w) in table_now)
        before = state()
        import mpsimpact
        import mpsimpact.modes.entrypoint as entrypoint
        from mpsimpact.modes.guard import guard
        print(same(before, []))  # imported: nothing moved
        with guard("raise"):
            wrappers = [entry.wrapper for entry in entrypoint._INSTALLED.values()]  # alive: ids stay theirs
            print(same(before, [])[0], len(same(before, wrappers)[2]))
            print(same(before, wrappers)[2])  # the wrappers TorchScript's table lists
            with guard("chunk"):  # nested: still in place when the inner one leaves
                pass
            print(torch.matmul is not before[0][("torch", "matmul")][0])
        print(same(before, wrappers))
        # A guard on another thread keeps them in place until its thread removes it.
        entered, leave = threading.Event(), threading.Event()
        def other():
            mpsimpact.install_thread_guard("raise")
            entered.set(); leave.wait()
            mpsimpact.uninstall_thread_guard()
        thread = threading.Thread(target=other); thread.start(); entered.wait()
        with guard("raise"):
            pass
        print(torch.matmul is not before[0][("torch", "matmul")][0])
        leave.set(); thread.join()
        print(same(before, wrappers))
    """))
    wrapped = sorted((owner.__name__, a) for places in ENTRY_POINTS.values() for owner, a in places)
    imported, installed, listed, nested, *after = out.splitlines()
    assert imported == "([], True, [])"
    assert installed == f"{wrapped} 11"  # installed: exactly the entry points moved; 11 are jit builtins
    # After: torch as it was; TorchScript's table keeps the wrappers (a name bound to one still scripts).
    kept = f"([], True, {listed})"
    assert after == [kept, "True", kept] and nested == "True"
