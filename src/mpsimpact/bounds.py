"""Bounds on what mpsimpact reads from users and from disk, written once: JSON nesting depth and no NaN
(`parse_json`), the length of one text (`MAX_TEXT_CHARS`, the same for every dataset format). A leaf:
the engine reads profile files through it too."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_JSON_DEPTH = 64  # what we read is 2 to 6 levels deep; Python's own reader dies near 1000
MAX_TEXT_CHARS = 100_000  # one text of a dataset, in characters (a model reads at most a few thousand tokens)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, escapes and all
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str, stop_above: int = MAX_JSON_DEPTH) -> int:
    """How deeply JSON `text` nests lists and objects (brackets inside strings do not count); counting
    stops at the first level past `stop_above`, so a hostile file costs no more than a fair one."""
    depth = deepest = 0
    for bracket in _BRACKET.finditer(_STRING.sub('""', text)):
        depth += 1 if bracket.group() in "[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > stop_above:
                break
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_json(text: str | bytes, *, allow_nan: bool = False) -> Any:
    """`json.loads` with bounds: at most MAX_JSON_DEPTH levels of lists and objects, and no NaN or Infinity
    unless `allow_nan` (a run's per-text errors are infinite where a device returned NaN; whoever reads
    such a file checks the numbers it uses).

    Raises:
        ValueError: one line saying what is off (a json.JSONDecodeError for malformed JSON).
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep (lists or objects)")
    try:
        return json.loads(text, parse_constant=None if allow_nan else _no_constant)
    except RecursionError:  # unreachable below the depth bound; kept so that no input can end in a traceback
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep (lists or objects)") from None


def text_problem(text: str) -> str | None:
    """What makes `text` unusable as a model's input, in words that follow "the text is", or None: longer
    than MAX_TEXT_CHARS, or holding a lone surrogate (not Unicode text: tokenizers fail on it)."""
    if len(text) > MAX_TEXT_CHARS:
        return f"{len(text):,} characters long, more than the {MAX_TEXT_CHARS:,} a text may have"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        return f"not valid Unicode (a lone surrogate \\u{code:04x} at character {error.start + 1})"
    return None
