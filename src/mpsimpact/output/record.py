"""The typed values our files hold (a run's report.json, a sweep's summary.json and rows, plan.json, check.json):
each a frozen dataclass whose fields are the file's, written (`to_json`) and read back (`from_json`) by the same
class. Reading checks each field's JSON type by its annotation, its closed set (a Literal), and the fields'
agreement (`problem`); anything else is damage, said in one line naming the field (`Damaged`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Literal

# The JSON type of a value, in words.
_WORDS = {str: "text", int: "a whole number", float: "a number", bool: "true or false", list: "a list",
          dict: "an object", type(None): "null"}


class _Absent:
    """A field the file does not hold (an optional one, or one an older writer did not write)."""

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False


ABSENT: Any = _Absent()


class Damaged(ValueError):
    """A value that is not what its field holds: the field's dotted name and why, in words."""


def shown(value: Any) -> str:
    """A value as a one-line message shows it: its JSON cut at 40 characters; a list or an object by its type."""
    if isinstance(value, (list, dict, Record)):
        return _WORDS[dict if isinstance(value, Record) else type(value)]
    return json.dumps(value)[:40]  # NaN and the infinities as JSON writes them


def field_type(cls: type, key: str) -> Any:
    """The type a Record class declares for the JSON key `key`."""
    return _keys(cls)[key][1]


def fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the type `hint` (shallowly: containers by their own type)."""
    try:
        _read(value, hint, "")
    except Damaged:
        return False
    return True


@dataclasses.dataclass(frozen=True, eq=False)
class Record(Mapping):
    """Base of the typed values: frozen dataclass fields in the file's order (ABSENT: the file does not hold it),
    read through `from_json` and written through `to_json`. A file's own key order, and keys this class does not
    know (a newer writer's), are kept, so a file read and written back is the same bytes. As a Mapping it reads
    like the JSON it holds (`report["geometry"]["batch_size"]`), nested values typed."""

    FINITE: ClassVar[bool] = True  # whether its numbers must be finite (NaN and infinities are damage)

    @classmethod
    def from_json(cls, data: Any, where: str = "") -> Any:
        """The value `data` (parsed JSON) holds; `where` leads the fields' names in messages ("conditions.1.").

        Raises:
            Damaged: a field of another type or outside its set, a required one missing, or fields that
                disagree (`problem`).
        """
        if not isinstance(data, dict):
            raise Damaged(f"{where.rstrip('.') or 'the file'} is {_WORDS.get(type(data), 'not JSON')}, not an object")
        known, values = _keys(cls), {}
        for key, (attr, hint, field) in known.items():
            if key in data:
                values[attr] = _read(data[key], hint, f"{where}{key}", cls.FINITE and field.metadata.get("finite", True))
            elif field.default is dataclasses.MISSING:
                raise Damaged(f"{where}{key} is missing")
        made = cls(**values)
        object.__setattr__(made, "_keys", tuple(data))
        object.__setattr__(made, "_rest", {k: v for k, v in data.items() if k not in known})
        problem = made.problem()
        if problem is not None:
            raise Damaged(f"{where}{problem}")
        return made

    @classmethod
    def of(cls, values: dict[str, Any]) -> Any:
        """The value a writer made (`values`: what the file will hold, before JSON), read as any reader reads the
        file: through JSON (a path or a numpy number as JSON writes it), then `from_json`. A writer's own fields that
        disagree raise Damaged: a bug, never a file written that its reader would refuse."""
        return cls.from_json(json.loads(json.dumps(values, default=str)))

    def problem(self) -> str | None:
        """What makes the fields disagree, in words that start with a field's name, or None."""
        return None

    def to_json(self) -> dict[str, Any]:
        """The JSON object: each field the value holds, in the file's (or the declaration's) order."""
        return {key: _write(self[key]) for key in self._order()}

    def _order(self) -> tuple[str, ...]:
        keys = getattr(self, "_keys", None)
        if keys is None:
            keys = tuple(key for key, (attr, _, _) in _keys(type(self)).items() if getattr(self, attr) is not ABSENT)
        return keys

    # The Mapping of the JSON it holds.
    def __getitem__(self, key: str) -> Any:
        rest = getattr(self, "_rest", {})
        if key in rest:
            return rest[key]
        known = _keys(type(self)).get(key)
        value = getattr(self, known[0]) if known is not None else ABSENT
        if value is ABSENT:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._order())

    def __len__(self) -> int:
        return len(self._order())


def key(name: str, **metadata: Any) -> Any:
    """A field whose JSON key is not a Python name ("class"): `class_: str = key("class")`."""
    return dataclasses.field(default=metadata.pop("default", ABSENT), metadata={"key": name, **metadata})


@functools.cache
def _keys(cls: type) -> dict[str, tuple[str, Any, dataclasses.Field]]:
    """JSON key -> (attribute, type, field) of a Record class, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.metadata.get("key", f.name): (f.name, hints[f.name], f) for f in dataclasses.fields(cls)}


def _read(value: Any, hint: Any, name: str, finite: bool = True) -> Any:
    """`value` checked against the type `hint` (nested Records read, lists and objects item by item)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Literal:
        if type(value) not in {type(a) for a in args}:  # another JSON type: said by type, as any field's
            raise Damaged(f"{name} is {_WORDS.get(type(value), 'not JSON')}, not {_WORDS[type(args[0])]}")
        if value not in args:
            raise Damaged(f"{name} is {shown(value)}, not one of {', '.join(map(str, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if _container(arg) is not None and isinstance(value, _container(arg)):
                return _read(value, arg, name, finite)  # a record, a list or an object: its contents' own word
            if _container(arg) is None and arg is not type(None) and fits(value, arg):
                return _read(value, arg, name, finite)
        if len(args) == 2 and type(None) in args:  # a number that is not finite, an unknown word: its own reason
            return _read(value, next(a for a in args if a is not type(None)), name, finite)
        raise Damaged(f"{name} is {_WORDS.get(type(value), 'not JSON')}, not {' or '.join(_word(a) for a in args)}")
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_json(value, f"{name}.")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise Damaged(f"{name} is {_WORDS.get(type(value), 'not JSON')}, not a list")
        if origin is tuple and len(args) != len(value):
            raise Damaged(f"{name} holds {len(value)} item{'s' if len(value) != 1 else ''}, not {len(args)}")
        items = args if origin is tuple else [args[0]] * len(value)
        return [_read(v, a, f"{name}.{i}", finite) for i, (a, v) in enumerate(zip(items, value))]
    if origin is dict:
        if not isinstance(value, dict):
            raise Damaged(f"{name} is {_WORDS.get(type(value), 'not JSON')}, not an object")
        return {k: _read(v, args[1], f"{name}.{k}", finite) for k, v in value.items()}
    return _read_plain(value, hint, name, finite)


def _read_plain(value: Any, hint: Any, name: str, finite: bool) -> Any:
    ok = (type(value) is hint or hint is float and type(value) is int) if hint is not type(None) else value is None
    if not ok:  # said by type: a value of the wrong type may be long, or empty
        raise Damaged(f"{name} is {_WORDS.get(type(value), 'not JSON')}, not {_word(hint)}")
    if hint is float and finite and not math.isfinite(value):
        raise Damaged(f"{name} is {shown(value)}, not a finite number")
    return value


def _container(hint: Any) -> type | None:
    """The JSON container a type is held in (dict for an object or a record, list for a list), or None."""
    origin = typing.get_origin(hint) or hint
    if origin is dict or isinstance(origin, type) and issubclass(origin, Record):
        return dict
    return list if origin in (list, tuple) else None


def _word(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    origin = typing.get_origin(hint) or hint
    return _WORDS.get(origin, "an object")


def _write(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list):
        return [_write(v) for v in value]
    if isinstance(value, dict):
        return {k: _write(v) for k, v in value.items()}
    return value
