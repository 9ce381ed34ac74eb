"""Op names are decided on in one module of modes/ only, the table (modes/op_table.py, issue 61): every other
module asks the table what an op is, and branches on what it answers (a family, a route, a split), never on
the op's name. The check reads the sources' syntax trees; planted violations show that it can fail."""

import ast
import pathlib
import textwrap

import pytest
import torch

import mpsimpact.modes
from mpsimpact.errors import OversizedOpError
from mpsimpact.modes.op_table import ENTRY_KINDS, OP_ENTRIES, op_entry
from tiny import tiny_bert, token_batch

MODES = pathlib.Path(mpsimpact.modes.__file__).parent
TABLE = "op_table.py"
# What a compared name may be called where it is a vocabulary of its own, not an op's name: a string that
# happens to spell an op ("cat" the family, "chunk" the guard mode, "dim" an argument) decides nothing by name.
VOCABULARY = {"family", "kind", "rule", "how", "mode", "path", "type", "phase", "layout", "device", "dtype",
              "outcome", "aspect", "view_rule", "output_rule", "unit", "argument"}
# Names under which code holds an op's name: a test of its form (`name.endswith("_")`) is a decision by name.
NAME_WORDS = {"name", "op", "base", "__name__", "op_name", "overload", "_name"}
_STRING_METHODS = {"split", "rsplit", "rstrip", "lstrip", "strip", "removeprefix", "removesuffix", "lower",
                   "partition", "replace"}


def is_op_name(text):
    """Whether a string names an aten op (any overload packet, in place or not) or an entry point kind."""
    return isinstance(text, str) and text.isidentifier() and (text in ENTRY_KINDS or hasattr(torch.ops.aten, text))


def subject(node):
    """The identifier a compared expression is known by: `family` for `entry.family`, `__name__` for
    `func.__name__.split(".")[0]`, `op_name` for `op_name(func)`; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return subject(node.value)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute):
            return subject(func.value) if func.attr in _STRING_METHODS else func.attr
        return subject(func)
    return None


def literal_strings(node):
    """The string constants of a literal (a string, or a tuple, list, set or frozenset of them)."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set"):
        return [s for arg in node.args for s in literal_strings(arg)]
    if isinstance(node, ast.Dict):
        return [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fromkeys":
        return literal_strings(node.args[0]) if node.args else []
    return []


def is_aten(node):
    """`aten.x`, `torch.ops.aten.x`: an attribute of torch's aten namespace."""
    value = node.value if isinstance(node, ast.Attribute) else None
    return (isinstance(value, ast.Name) and value.id == "aten") or (
        isinstance(value, ast.Attribute) and value.attr == "aten")


def op_name_tables(tree):
    """Module-level names bound to a collection that holds op names (a table of ops by name)."""
    tables = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if sum(map(is_op_name, literal_strings(node.value))) >= 1:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                tables |= {t.id for t in targets if isinstance(t, ast.Name)}
    return tables


def decisions_by_op_name(source, filename="<planted>"):
    """(line, what) for each decision by an op's name in `source`: a comparison or membership test of a name
    other than a VOCABULARY word with an op-name string (or a module-level table of them), a lookup in such a
    table, a test of a name's form, or an aten op used as a value (an identity check, a table key)."""
    tree = ast.parse(source, filename)
    tables = op_name_tables(tree)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            left = node.left
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, (ast.In, ast.NotIn)):
                    names = literal_strings(right) if not isinstance(left, ast.Constant) else []
                    table = isinstance(right, ast.Name) and right.id in tables
                    if (table or any(map(is_op_name, names))) and subject(left) not in VOCABULARY:
                        found.append((node.lineno, f"{ast.unparse(node)}"))
                else:
                    for a, b in ((left, right), (right, left)):
                        if any(map(is_op_name, literal_strings(a))) and isinstance(a, ast.Constant) \
                                and subject(b) not in VOCABULARY:
                            found.append((node.lineno, f"{ast.unparse(node)}"))
                left = right
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in tables:
            if subject(node.slice) not in VOCABULARY and not isinstance(node.slice, ast.Constant):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if node.func.attr == "get" and isinstance(owner, ast.Name) and owner.id in tables and node.args \
                    and subject(node.args[0]) not in VOCABULARY:
                found.append((node.lineno, ast.unparse(node)))
            if node.func.attr in ("endswith", "startswith") and subject(owner) in NAME_WORDS:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            if node.args and (is_aten(node.args[0]) or ast.unparse(node.args[0]) in ("aten", "torch.ops.aten")):
                found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Attribute) and is_aten(node) and id(node) not in called:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_no_module_of_modes_but_the_table_decides_by_an_op_name():
    modules = sorted(MODES.glob("*.py"))
    assert {p.name for p in modules} >= {TABLE, "guard_mode.py", "emulator.py", "tracer.py", "piecewise.py"}
    found = {p.name: decisions_by_op_name(p.read_text(), str(p)) for p in modules if p.name != TABLE}
    assert {name: where for name, where in found.items() if where} == {}


PLANTED = {
    "a name compared": """
        def on_other(self, func, args, kwargs):
            if op_name(func) == "embedding":
                return None
    """,
    "a name in a literal": """
        def split(func):
            name = func.__name__.split(".")[0]
            return name in ("sum", "mean")
    """,
    "a name in a module table": """
        _COMBINE = {"sum": "add", "amax": "max"}
        def combine(func):
            return _COMBINE[func.__name__.split(".")[0]]
    """,
    "an aten op's identity": """
        def adds(func):
            return func is torch.ops.aten.baddbmm.default
    """,
    "an aten op as a table key": """
        SHAPE_ONLY = {aten._grouped_mm.default: len}
    """,
    "an entry point's name": """
        def passes(self, name, args, kwargs):
            if name != "sdpa":
                return True
    """,
    "a name's form": """
        def fast(func):
            name = op_name(func)
            return name.endswith("_")
    """,
}


@pytest.mark.parametrize("how", sorted(PLANTED))
def test_a_planted_decision_by_name_is_found(how):
    assert len(decisions_by_op_name(textwrap.dedent(PLANTED[how]))) == 1


def test_a_planted_decision_in_a_real_module_is_found():
    source = (MODES / "guard_dispatch.py").read_text()
    planted = source.replace("    def on_other(self, func, args, kwargs):\n",
                             "    def on_other(self, func, args, kwargs):\n"
                             "        if op_name(func) in ('native_layer_norm', 'softmax'):\n"
                             "            return func(*args, **kwargs)\n", 1)
    assert planted != source and decisions_by_op_name(source) == []
    assert [what for _, what in decisions_by_op_name(planted)] == [
        "op_name(func) in ('native_layer_norm', 'softmax')"]


def test_vocabulary_that_spells_an_op_is_not_a_decision_by_name():
    source = """
        def act(self, record, entry, fault):
            if self.mode == "chunk" or record.family in ("bmm", "mm") or entry.family == "cat":
                return aten.bmm(record, fault)  # a call of an aten op decides nothing
    """
    assert decisions_by_op_name(textwrap.dedent(source)) == []


def test_the_table_answers_for_every_overload_of_its_ops():
    # One entry per overload, found by id, made once; its facts are the ones the name tables give.
    add = op_entry(torch.ops.aten.add.Tensor)
    assert OP_ENTRIES[id(torch.ops.aten.add.Tensor)] is add and op_entry(torch.ops.aten.add.Tensor) is add
    assert (add.family, add.sizing, add.split) == ("elementwise", "broadcast", "pointwise")
    assert op_entry(torch.ops.aten.baddbmm.default).operands == ("bmm", 1, 2)
    assert op_entry(torch.ops.aten.sum.dim_IntList).combine == op_entry(torch.ops.aten.sum.default).combine
    assert op_entry(torch.ops.aten.linear.default).bound_by is ENTRY_KINDS["linear"]
    assert op_entry(torch.ops.aten.view.default).hot == "no kernel"


# Strict's hot path (Note [Strict's hot path] in modes/guard_dispatch.py) answers only the calls the full route
# would run as they are: with it and without it (GuardMode.hot_path), a guard makes the same records, the same
# pieces and the same values; with it, fewer calls take the full route. 16 index bits: DIM_MAX 32,767.
def _mixed_ops():
    a, b = torch.ones(2**8 + 2), torch.arange(2**8, dtype=torch.float32)
    outer = a[:, None] * b[None, :]  # a broadcast past DIM_MAX (66,048 elements) from two small tensors
    normed = torch.nn.functional.layer_norm(outer.reshape(-1, 64), (64,))  # an op nobody sized, past DIM_MAX
    table = torch.randn(40, 1024)
    looked = torch.nn.functional.embedding(torch.arange(40).repeat(2), table)  # a lookup past DIM_MAX
    joined = torch.cat([normed.flatten(), looked.flatten(), torch.ones(2**15 + 8)])
    try:  # an op nobody sized (AFTER), small tensors in, 2**17 elements out: judged on what it made, stopped
        torch.ones(2**7, 2**6).repeat(4, 4)
        stopped = torch.tensor(False)
    except OversizedOpError:
        stopped = torch.tensor(True)
    return [outer.sum(), normed.softmax(-1).amax(), looked.mean(), joined.sum(), (joined * 0.5).sum(), stopped]


def _tiny_bert_step():
    model, ids = tiny_bert(), token_batch(6, 64)  # P: 6 * 4 * 64 * 64 = 98,304 elements, past LIMIT
    out = model(ids).last_hidden_state
    out.square().mean().backward()
    return [out.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]


def hot_and_full(work, monkeypatch):
    """{hot path on: (values, records, pieces, calls that took the full route), and off: the same}."""
    from mpsimpact.modes.base import MatmulMode
    from mpsimpact.modes.guard import guard
    from mpsimpact.modes.guard_mode import GuardMode

    route, full = MatmulMode._torch_dispatch, []

    def counted(self, func, *rest):
        full.append(func)
        return route(self, func, *rest)

    monkeypatch.setattr(MatmulMode, "_torch_dispatch", counted)
    runs = {}
    for hot in (False, True):
        monkeypatch.setattr(GuardMode, "hot_path", hot)
        full.clear()
        torch.manual_seed(0)
        with guard("chunk", index_bits=16, devices=("cpu",), strict=True, profile="2.9.1") as g:
            values = work()
        records = [(r.op, r.fault.rule, r.phase) for r in (*g.chunked, *g.stopped)]
        runs[hot] = (values, records, list(g.chunk_sizes), len(full))
    return runs


def same_decisions(runs):
    (values, records, sizes, _), (hot_values, hot_records, hot_sizes, _) = runs[False], runs[True]
    return bool(records) and hot_records == records and hot_sizes == sizes and all(
        torch.equal(x, y) for x, y in zip(hot_values, values, strict=True))


@pytest.mark.parametrize("work", [_mixed_ops, _tiny_bert_step], ids=["mixed ops", "tiny BERT, forward and backward"])
def test_strict_hot_path_decides_as_the_full_route(work, monkeypatch):
    runs = hot_and_full(work, monkeypatch)
    assert same_decisions(runs)
    assert 0 < runs[True][3] < runs[False][3]  # the judged calls took the full route; most others did not


@pytest.mark.parametrize("planted", ["every broadcast passes", "what an unsized op made is not looked at"])
def test_a_planted_hot_path_that_passes_too_much_is_caught(planted, monkeypatch):
    from mpsimpact.modes import guard_dispatch

    if planted == "every broadcast passes":
        monkeypatch.setattr(guard_dispatch, "broadcast_within", lambda args, kwargs, most: True)
    else:
        monkeypatch.setattr(guard_dispatch.DispatchJudge, "_made", lambda self, func, args, kwargs, out: out)
    assert not same_decisions(hot_and_full(_mixed_ops, monkeypatch))


# The emulator's hot path (Note [The emulator's hot path] in modes/emulator.py) likewise: with it and without it
# (EmulateMode.hot_path) the emulator makes the same records and returns the same values, on fewer full routes.
def _emulated_ops():
    # P (6 * 4, 64, 64) past 2**16 wraps in P V (its backward would raise: view-int-max), with gradients and under
    # no_grad (where composite ops reach the mode whole); the rest of BERT below every limit
    model, ids = tiny_bert(), token_batch(6, 64)
    with torch.no_grad():
        quiet = model(ids).last_hidden_state
    return [model(ids).last_hidden_state.detach(), quiet, torch.ones(2**7, 2**6).repeat(2, 1).sum()]


def emulated_hot_and_full(monkeypatch):
    from mpsimpact.modes.base import MatmulMode
    from mpsimpact.modes.emulator import EmulateMode, emulate

    route, full, runs = MatmulMode._torch_dispatch, [], {}
    monkeypatch.setattr(MatmulMode, "_torch_dispatch", lambda self, func, *rest: full.append(func) or route(
        self, func, *rest))
    for hot in (False, True):
        monkeypatch.setattr(EmulateMode, "hot_path", hot)
        full.clear()
        torch.manual_seed(0)
        with emulate(index_bits=16, profile="2.14.0") as emulator:
            values = _emulated_ops()
        runs[hot] = (values, [(r.op, r.fault.rule, r.phase) for r in emulator.records], len(full))
    return runs


def test_the_emulators_hot_path_decides_as_the_full_route(monkeypatch):
    runs = emulated_hot_and_full(monkeypatch)
    (values, records, full), (hot_values, hot_records, hot_full) = runs[False], runs[True]
    assert records and hot_records == records  # P V wraps, the sum past INT_MAX wraps, ...
    assert all(torch.equal(x, y) for x, y in zip(hot_values, values, strict=True))
    assert 0 < hot_full < full / 2  # most ops answered on the hot path


def test_a_planted_emulator_hot_path_that_passes_every_broadcast_is_caught(monkeypatch):
    from mpsimpact.errors import EmulatedMpsError
    from mpsimpact.modes import emulator as emulator_module
    from mpsimpact.modes.emulator import EmulateMode, emulate

    def outcome():  # a broadcast past DIM_MAX from two small tensors: 2.13.0's int32 kernel dies there
        a, b = torch.ones(2**8 + 2), torch.arange(2**8, dtype=torch.float32)
        with emulate(index_bits=16, profile="2.13.0"):
            try:
                return (a[:, None] * b[None, :]).shape
            except EmulatedMpsError:
                return "refused"

    assert outcome() == "refused"  # the hot path sends it to the full route
    monkeypatch.setattr(emulator_module, "broadcast_within", lambda args, kwargs, most: True)
    assert outcome() != "refused"  # planted: the comparison above would see it
    monkeypatch.setattr(EmulateMode, "hot_path", False)
    assert outcome() == "refused"
