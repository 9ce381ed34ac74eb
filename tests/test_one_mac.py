"""One Mac (issue 57): the rule "a tensor at or past the largest buffer is refused" is written once in src/
(engine.mac_memory.buffer_refuses) and every room asks it; the bytes of a tensor are counted once
(engine.mac_memory.tensor_bytes)."""

import ast
import sys
from pathlib import Path

import pytest
import torch

from mpsimpact.engine.call import CallRecord
from mpsimpact.engine.faults import TensorSpec
from mpsimpact.engine.mac_memory import MacMemory, call_bytes, tensor_bytes
from mpsimpact.modes.tracer import UNDECIDED

SRC = Path(__file__).resolve().parents[1] / "src" / "mpsimpact"
ORDERS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _is_number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def buffer_comparisons(source: str) -> list[str]:
    """Every ordering (<, <=, >, >=, chained too) one of whose two sides names a buffer: an expression that says
    "buffer", or a name bound, in the same function, to one that does (`full = mac.largest_buffer`). A side that
    is a number is a read value checked for sense (`buffer <= 0`), not the rule."""
    tree = ast.parse(source)
    found = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in [tree, *functions]:
        said = set()  # names bound to a buffer's expression in this scope
        for node in ast.walk(scope):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AnnAssign, ast.NamedExpr)) else [])
            for target, value in ((t, node.value) for t in targets if node.value is not None):
                pairwise = isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(
                    target.elts) == len(value.elts)  # a, b = x, y
                pairs = zip(target.elts, value.elts) if pairwise else [(target, value)]
                said |= {t.id for t, v in pairs
                         if isinstance(t, ast.Name) and "buffer" in ast.unparse(v).lower()}

        def names_buffer(side: ast.AST) -> bool:
            return "buffer" in ast.unparse(side).lower() or any(
                isinstance(n, ast.Name) and n.id in said for n in ast.walk(side))

        for node in ast.walk(scope):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, sides, sides[1:]):
                if isinstance(op, ORDERS) and not (_is_number(left) or _is_number(right)) and (
                        names_buffer(left) or names_buffer(right)):
                    found.add((node.lineno, ast.unparse(node)))
    return [text for _, text in sorted(found)]


def test_the_buffer_rule_is_written_once_in_src():
    written = {str(path.relative_to(SRC)): found for path in sorted(SRC.rglob("*.py"))
               if (found := buffer_comparisons(path.read_text()))}
    assert written == {"engine/mac_memory.py": ["n_bytes >= buffer"]}


def test_the_search_finds_the_rules_forms_where_one_is_planted():
    planted = '''
def held(self, mac, cell, option, n, buffer):
    full, start = mac.largest_buffer, 0
    if start < n:  # bound beside a buffer, not to one
        pass
    if n >= full or option["largest_tensor_gib"] * GIB < mac.largest_buffer:
        return mac.buffer_at(20) <= n
    if (scaled := mac.buffer_at(8)) > n:
        return 0 < n < self._buffer
    return cell.largest_tensor_bytes() >= buffer or buffer <= 0 or n > 3
'''
    assert buffer_comparisons(planted) == [
        "n >= full", "option['largest_tensor_gib'] * GIB < mac.largest_buffer", "mac.buffer_at(20) <= n",
        "(scaled := mac.buffer_at(8)) > n", "0 < n < self._buffer", "cell.largest_tensor_bytes() >= buffer"]
    # ... and in src: the emulator's old form, planted back, is found.
    emulator = (SRC / "modes" / "emulator.py").read_text()
    old_form = "\n\ndef _old(self, sizes):\n    return max(n for _, n in sizes) >= self._buffer\n"
    assert buffer_comparisons(emulator + old_form) == ["max((n for _, n in sizes)) >= self._buffer"]


def test_a_tensors_bytes_are_counted_one_way_for_a_spec_a_tensor_and_a_call():
    # A view is allocated as its base: a slice of 4 of 8 float16 rows of 1024 holds the base's 16 KiB.
    base = torch.empty(8, 1024, dtype=torch.float16, device="meta")
    assert tensor_bytes(base[:4]) == 8 * 1024 * 2 and tensor_bytes(TensorSpec.of(base)) == 8 * 1024 * 2
    # A spec counts its storage extent; float_bytes recounts a floating one (a float32 trace judged in half).
    spec = TensorSpec((4, 1024), (1024, 1), 4096)  # rows 4..7 of a float32 (8, 1024): extent 8192
    assert (tensor_bytes(spec), tensor_bytes(spec, 2)) == (8192 * 4, 8192 * 2)
    # A bmm's largest tensor may be its output: (12, 512, 32) @ (12, 32, 512) makes 12 * 512**2 float32.
    call = CallRecord(0, "bmm", TensorSpec.contiguous((12, 512, 32)), TensorSpec.contiguous((12, 32, 512)),
                      UNDECIDED)
    assert call_bytes(call) == 12 * 512**2 * 4
    mac = MacMemory.of_size(8)  # a 4 GiB buffer: at 23 bits 4 GiB >> 9 = 8 MiB, and 12 MiB reaches it
    assert mac.refuses(call_bytes(call), 23) and not mac.refuses(call_bytes(call))


@pytest.fixture
def parsed(monkeypatch):
    """Every text engine.mac_memory.parse_mac_size reads, through whatever name it is bound to."""
    import mpsimpact.engine.mac_memory as mac_memory

    original, texts = mac_memory.parse_mac_size, []

    def counted(text):
        texts.append(text)
        return original(text)

    for module in list(sys.modules.values()):  # a module that bound the name by `from ... import` counts too
        if getattr(module, "parse_mac_size", None) is original:
            monkeypatch.setattr(module, "parse_mac_size", counted)
    return texts


# Every command that takes --memory, cheaply: its --memory read once, whatever else it runs through.
TAKE_MEMORY = {
    "plan": ["plan", "sentiment", "--torch-profile", "2.14.0", "--json"],
    "check": ["check", str(Path(__file__).parent / "data" / "bert-base" / "config.json"), "--json"],
    "sweep": ["sweep", "--device", "cpu", "--emulate", "--torch-profile", "2.13.0", "--index-bits", "16",
              "--dtypes", "fp32", "--layouts", "contiguous", "--out", "{out}"],
    "run": ["run", "sentiment", "--quick", "--guard", "off", "--out", "{out}"],
}


def test_every_command_that_takes_memory_is_one_that_is_counted():
    from typer.main import get_command

    from mpsimpact.cli import app

    takes = {name for name, command in get_command(app).commands.items()
             if any("--memory" in param.opts for param in command.params)}
    assert takes == set(TAKE_MEMORY)


@pytest.mark.parametrize("command", sorted(TAKE_MEMORY))
def test_a_mac_is_read_once_per_command(tmp_path, monkeypatch, parsed, command):
    from typer.testing import CliRunner

    from mpsimpact.cli import app

    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    args = [arg.format(out=tmp_path / "out") for arg in TAKE_MEMORY[command]]
    result = CliRunner().invoke(app, [*args, "--memory", "64GB"])
    assert result.exit_code == 0, result.output
    assert parsed == ["64GB"]
