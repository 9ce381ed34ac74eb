"""The guard stays out of program transforms' way: FX symbolic tracing, torch.export, torch.compile
(fullgraph too) and jit trace/script behave with a guard installed on the thread (plain and strict) as
without one, and importing mpsimpact alone changes nothing torch's users can see (identity checks on
torch.bmm and torch.matmul). Where strict cannot follow a transform it says so once and steps aside."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpsimpact.modes.guard import install_thread_guard, uninstall_thread_guard
from mpsimpact.modes.guard_mode import MpsImpactWarning

GUARDS = {  # name -> install_thread_guard's arguments
    "raise": dict(mode="raise"), "chunk": dict(mode="chunk"),
    "strict raise": dict(mode="raise", strict=True), "strict chunk": dict(mode="chunk", strict=True),
}


class LinearBmmMatmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)  # (B, L, 8)
        scores = torch.bmm(h, h.transpose(1, 2))  # (B, L, L)
        return torch.matmul(scores.softmax(-1), h)  # (B, L, 8)


class Attention(nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.fixture(params=list(GUARDS))
def installed(request):
    """A guard installed on this thread for the whole test, on CPU tensors (as on MPS ones on a Mac)."""
    guard = install_thread_guard(**GUARDS[request.param], devices=("cpu",))
    try:
        yield guard
    finally:
        uninstall_thread_guard()


def call_targets(graph):
    return [node.target for node in graph.nodes if node.op == "call_function"]


def test_fx_symbolic_trace_with_a_guard_installed_gives_the_plain_graph_and_values(installed):
    torch.manual_seed(0)
    module, x = LinearBmmMatmul(), torch.randn(2, 5, 8)
    uninstall_thread_guard()
    try:
        plain_graph, want = torch.fx.symbolic_trace(module).graph, module(x)
    finally:
        install_thread_guard(installed.mode, strict=installed.everywhere, devices=("cpu",))
    traced = torch.fx.symbolic_trace(module)
    assert call_targets(traced.graph) == call_targets(plain_graph)  # torch's own callables, by identity
    assert sum(target is torch._C._VariableFunctions.bmm for target in call_targets(traced.graph)) == 1
    torch.testing.assert_close(traced(x), want)


def test_an_fx_pass_finds_torch_bmm_with_only_the_import_and_after_a_guard_left():
    # With mpsimpact imported (and after a guard came and went) torch.bmm is torch's own: a pass that
    # tests `node.target is torch.bmm` finds the module's two bmm calls.
    out = run_python("""
        import torch
        import mpsimpact
        from mpsimpact.modes.guard import guard
        class M(torch.nn.Module):
            def forward(self, a, b):
                return torch.bmm(torch.bmm(a, b), b) + torch.matmul(a, b)
        def found():
            graph = torch.fx.symbolic_trace(M()).graph
            return sum(n.target is torch.bmm for n in graph.nodes), sum(n.target is torch.matmul for n in graph.nodes)
        print(found())
        with guard("raise"):
            pass
        print(found())
    """)
    assert out.split() == ["(2,", "1)", "(2,", "1)"]


@pytest.mark.ci  # fresh processes: CI runs it after the default selection (pytest -m ci)
def test_torch_export_of_sdpa_with_a_guard_installed_exits_0_with_the_plain_graph():
    # In its own process: an export that aborted the process (strict: `prim::device`) would show as a
    # non-zero exit here, not as a failed assertion.
    out = run_python("""
        import torch
        from mpsimpact.modes.guard import install_thread_guard, uninstall_thread_guard
        from test_transforms import Attention, GUARDS, call_targets
        q = torch.randn(1, 2, 4, 8)
        plain = {strict: call_targets(torch.export.export(Attention(), (q,), strict=strict).graph)
                 for strict in (False, True)}
        for name, arguments in GUARDS.items():
            install_thread_guard(**arguments, devices=("cpu",))
            try:
                for strict in (False, True):
                    exported = torch.export.export(Attention(), (q,), strict=strict)
                    same = call_targets(exported.graph) == plain[strict]
                    print(name, strict, same, torch.allclose(exported.module()(q), Attention()(q)))
            finally:
                uninstall_thread_guard()
    """, cwd="tests")
    rows = out.strip().splitlines()
    assert len(rows) == 8 and all(row.endswith("True True") for row in rows), out


def test_torch_compile_fullgraph_with_a_guard_installed_compiles_what_it_compiles_without(installed):
    from torch._dynamo.testing import CompileCounter

    module, x = LinearBmmMatmul(), torch.randn(2, 5, 8)
    counts = []
    for guarded in (False, True):
        torch._dynamo.reset()
        counter = CompileCounter()
        if not guarded:
            uninstall_thread_guard()
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                got = torch.compile(module, backend=counter, fullgraph=True)(x)
        finally:
            if not guarded:
                install_thread_guard(installed.mode, strict=installed.everywhere, devices=("cpu",))
        counts.append((counter.frame_count, counter.op_count))
        torch.testing.assert_close(got, module(x))
    assert counts[0] == counts[1] and counts[0][0] == 1
    steps_aside = [w for w in said if issubclass(w.category, MpsImpactWarning)]
    assert len(steps_aside) <= 1  # said at most once a process: here, or in an earlier test
    assert all("torch.compile traces with the strict guard stepped aside" in str(w.message) for w in steps_aside)


@pytest.mark.ci  # a whole run, 7 to 12 s: CI runs it after the default selection (pytest -m ci)
def test_strict_says_once_that_it_steps_aside_for_torch_compile():
    out = run_python("""
        import warnings, torch
        from mpsimpact.modes.guard import install_thread_guard
        install_thread_guard("raise", strict=True, devices=("cpu",))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for n in (3, 4, 5):  # three compilations
                torch._dynamo.reset()
                torch.compile(lambda x: (x @ x).sum(), backend="eager", fullgraph=True)(torch.randn(n, n))
        print(sum("stepped aside" in str(w.message) for w in said))
    """)
    assert out.strip() == "1"


def test_jit_trace_with_a_guard_installed_records_the_plain_graph_and_warns_as_without(installed):
    module, x = LinearBmmMatmul(), torch.randn(2, 5, 8)

    def trace():
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            traced = torch.jit.trace(module, x)
        return [n.kind() for n in traced.graph.nodes()], sorted(str(w.message)[:60] for w in said), traced

    kinds, said, traced = trace()
    uninstall_thread_guard()
    try:
        plain_kinds, plain_said, _ = trace()
    finally:
        install_thread_guard(installed.mode, strict=installed.everywhere, devices=("cpu",))
    assert kinds == plain_kinds and said == plain_said  # no TracerWarning from the guard's own arithmetic
    torch.testing.assert_close(traced(x), module(x))


def test_jit_script_with_a_guard_installed_gives_the_plain_values(installed):
    module, x = LinearBmmMatmul(), torch.randn(2, 5, 8)
    scripted = torch.jit.script(module)
    assert {"aten::bmm", "aten::matmul"} <= {n.kind() for n in scripted.graph.nodes()}
    assert "aten::linear" in {n.kind() for n in scripted.linear.graph.nodes()}
    torch.testing.assert_close(scripted(x), module(x))


def run_python(code: str, cwd=None) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
