"""The plugin's usage errors, found before any test runs (pytest's exit 4, one line): the arguments of the
`mpsimpact` marker and of the `mpsimpact_as_a_mac` fixture (its literal calls, read from each test's source),
and the `--mps-json` file."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

from mpsimpact.engine.faults import MODE_INDEX_BITS_RANGE, MPS_INDEX_BITS

GUARD_CHOICES = ("raise", "warn", "chunk")
MARK_CHOICES = (*GUARD_CHOICES, "emulate", "off")  # off: neither emulator nor guard (for a test or a block)
FIXTURE = "mpsimpact_as_a_mac"
KEYWORDS = ("mode", "index_bits")


def index_bits_problem(bits: Any, name: str) -> str | None:
    """What is wrong with an index width, as a sentence, or None."""
    low, high = MODE_INDEX_BITS_RANGE
    if isinstance(bits, bool) or not isinstance(bits, int) or not low <= bits <= high:
        return f"{name} must be a whole number in {low}..{high} ({MPS_INDEX_BITS} is MPS), got {bits!r}."
    return None


def arguments_problem(args: tuple, kwargs: dict, what: str) -> str | None:
    """What is wrong with a marker's or the fixture's arguments (`what` names it in the sentence), or None: one
    mode of MARK_CHOICES, positional or `mode=`, and `index_bits=` in INDEX_BITS_RANGE; nothing else."""
    unknown = [name for name in kwargs if name not in KEYWORDS]
    if unknown:
        return (f"{what} takes a mode and index_bits=; got {', '.join(f'{n}=' for n in unknown)} "
                f"(modes: {', '.join(MARK_CHOICES)}).")
    if len(args) > 1 or args and "mode" in kwargs:
        given = [*args, *([kwargs["mode"]] if "mode" in kwargs else [])]
        return f"{what} takes one mode, got {len(given)}: {', '.join(map(repr, given))}."
    modes = [*args, *([kwargs["mode"]] if "mode" in kwargs else [])]
    if modes and modes[0] not in MARK_CHOICES:
        return f"{what} takes one of {', '.join(MARK_CHOICES)}; got {modes[0]!r}."
    if "index_bits" in kwargs:
        return index_bits_problem(kwargs["index_bits"], f"{what}'s index_bits")
    return None


def fixture_calls_problem(function: Callable[..., Any], where: str) -> str | None:
    """The first problem in the literal calls of the fixture in a test's source (`mpsimpact_as_a_mac("bogus")`),
    or None; calls whose arguments are not literals are checked when they run."""
    for args, kwargs, line in _literal_calls(function):
        problem = arguments_problem(args, kwargs, f"{FIXTURE}(...)")
        if problem is not None:
            return f"{where}, line {line}: {problem}"
    return None


@functools.lru_cache(maxsize=None)
def _literal_calls(function: Callable[..., Any]) -> tuple[tuple[tuple, dict, int], ...]:
    try:
        lines, first = inspect.getsourcelines(function)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):  # no source (a C function, a generated test): checked as it runs
        return ()
    return tuple(_literal(call, first) for call in ast.walk(tree) if _is_fixture_call(call)
                 and all(isinstance(a, ast.Constant) for a in (*call.args, *(k.value for k in call.keywords)))
                 and all(k.arg is not None for k in call.keywords))


def _is_fixture_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == FIXTURE


def _literal(call: ast.Call, first: int) -> tuple[tuple, dict, int]:
    args = tuple(a.value for a in call.args)  # type: ignore[attr-defined]
    return args, {k.arg: k.value.value for k in call.keywords}, first + call.lineno - 1  # type: ignore[attr-defined]


def first_problem(problems: Iterable[str | None]) -> str | None:
    return next((p for p in problems if p is not None), None)
