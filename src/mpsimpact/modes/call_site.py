"""Whose code a frame is, by identity: the folders the installed packages' own modules were loaded from (found
from their import specs), never a word in a path, so a clone, a venv or a home folder named `mpsimpact` or
`torch` changes nothing. Where a call was asked for is the innermost frame outside the packages named."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import traceback
from collections.abc import Iterable

# The packages whose frames are never where a call was asked for: torch's and ours.
TORCH_AND_OURS = ("torch", "mpsimpact", "mpsimpact.scenarios")


_FOUND: dict[str, tuple[str, ...]] = {}


def _places(name: str) -> tuple[str, ...]:
    """Where the named package's code lies, resolved: its folders (each ending in a separator), or a single
    module's file (contextlib). A name that is not installed (or not importable yet) holds nothing."""
    # Kept once found; a package not found yet (remote code's transformers_modules) is looked for again.
    found = _FOUND.get(name)
    if found is not None:
        return found
    module = sys.modules.get(name)
    try:
        spec = getattr(module, "__spec__", None) or importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent that cannot be imported, a module without a spec
        spec = None
    if spec is None:
        return ()
    if spec.submodule_search_locations:
        found = tuple(os.path.join(os.path.realpath(folder), "") for folder in spec.submodule_search_locations)
    else:
        found = (os.path.realpath(spec.origin),) if spec.origin and os.path.isabs(spec.origin) else ()
    _FOUND[name] = found
    return found


@functools.lru_cache(maxsize=8192)
def _resolved(filename: str) -> str:
    return os.path.realpath(filename) if filename and not filename.startswith("<") else filename


def is_in_packages(filename: str, names: tuple[str, ...]) -> bool:
    """Whether the file `filename` (a frame's, as Python names it) is the code of one of the packages `names`."""
    path = _resolved(filename)
    return any(path == place or path.startswith(place) for name in names for place in _places(name))


def innermost_outside(names: tuple[str, ...], frames: Iterable[traceback.FrameSummary] | None = None
                      ) -> traceback.FrameSummary | None:
    """The innermost of `frames` (default: the caller's stack) whose code is none of the packages `names`."""
    stack = list(frames) if frames is not None else traceback.extract_stack()[:-1]
    return next((frame for frame in reversed(stack) if not is_in_packages(frame.filename, names)), None)
