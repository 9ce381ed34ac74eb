"""The console every command prints through: rich's, except that a plain sentence is wrapped by errors.wrapped:
a backquoted command in it is never cut across two lines (a reader copies it whole), nor a number from its unit,
wherever the terminal's width puts the break."""

from __future__ import annotations

from typing import Any

from rich.console import Console as RichConsole

from mpsimpact.errors import wrapped


class Console(RichConsole):
    """rich.console.Console whose `print` wraps a plain sentence itself (errors.wrapped), between words but never
    inside backquotes (a command longer than a line stays whole on its own line) nor between a number and its
    unit."""

    def print(self, *objects: Any, **kwargs: Any) -> None:  # noqa: A003 - rich's name
        text = objects[0] if len(objects) == 1 and isinstance(objects[0], str) else ""
        if text and not kwargs.get("soft_wrap") and ("[" not in text or kwargs.get("markup") is False):
            objects = ("\n".join(wrapped(line, self.width) for line in text.split("\n")),)
            kwargs["soft_wrap"] = True
        super().print(*objects, **kwargs)
