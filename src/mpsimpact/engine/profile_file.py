"""The profile.json format: a release profile measured by `mpsimpact sweep` (runs.profile_fit derives it),
read back here, validated field by field, into the fields of an engine.release.FaultProfile."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpsimpact.bounds import FileProblemError, parse_json, read_file_bytes, read_release, shown_path
from mpsimpact.errors import UsageError

PROFILE_KIND = "mpsimpact-fault-profile"
PROFILE_SCHEMA = 1
# What a profile's measurement may cover; an aspect it did not measure (null in "rules") is judged per call
# as the conservative profile judges it.
ASPECTS = ("bmm", "mm", "sdpa", "families")
# The fields of the bmm rules (Note [MPS 32-bit index faults]) that a sweep's cells decide, and their values.
BMM_FIELDS = ("output_rule", "view_rule", "slice_extent", "input_wrap", "view_message", "limit_message")
BMM_CHOICES = {"output_rule": ("strides-ignored", "fp32-wrong", "correct"),
               "view_rule": ("raise", "abort", "truncate", "none")}
# The codes of engine.release.ONE_DIMENSION_ROWS and MULTI_DIMENSION_ROWS.
FAMILY_CODES = ("ok", "abort", "error", "wrong", "wrap", "unmeasured", "sum-64-bit", "masked-fill-numel",
                "int32-kernel", "int32-offsets")
# Bounds on a profile.json: a sweep writes about 11 kB and a few notes of a few hundred characters.
MAX_PROFILE_BYTES = 1 << 20
MAX_NOTES, MAX_NOTE_CHARS = 100, 2000


def is_release_name(value: Any) -> bool:
    """Whether `value` names a release as a sweep writes it ("2.15.0", "2.15.0rc1"; bounds.read_release)."""
    try:
        return isinstance(value, str) and str(read_release(value)) == value and value.count(".") >= 2
    except ValueError:
        return False


class ProfileFileError(UsageError, ValueError):
    """A profile file that cannot be used: missing, unreadable, not a profile, or a field wrong; the message
    is one line naming the file (and the field). A usage error, and a ValueError as a bad release string is."""

    def __init__(self, message: str, path: Path, field: str | None = None) -> None:
        super().__init__(message, path=str(path), field=field)
        self.path, self.field = str(path), field


class _Reader:
    """Reads one parsed profile.json; every complaint is one ProfileFileError naming the file and field."""

    def __init__(self, path: Path, data: Any) -> None:
        self.path, self.data = path, data

    def bad(self, field: str, expected: str, got: Any) -> ProfileFileError:
        message = (f"Profile '{self.path}': '{field}' must be {expected}, got {_shown(got)}; derive it "
                   "again with `mpsimpact sweep`, or correct that field.")
        return ProfileFileError(message, self.path, field)

    def get(self, field: str, check: Callable[[Any], bool], expected: str) -> Any:
        """The value at a dotted path ("rules.bmm[0].view_rule" is read by its caller), checked."""
        value: Any = self.data
        for key in field.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if not check(value):
            raise self.bad(field, expected, value)
        return value


def _shown(value: Any, room: int = 80) -> str:
    """A field's value as JSON, cut past `room` characters (a list of 10,000 notes in one line)."""
    text = json.dumps(value)
    return text if len(text) <= room else f"{text[:room]}… ({len(text):,} characters)"


def read_profile_fields(path: Path, families: frozenset[str]) -> dict[str, Any]:
    """The FaultProfile fields a profile.json holds (`families`: the family names a file may use); the file
    is read only when it is a regular file of at most MAX_PROFILE_BYTES (see Note [Only regular files]).

    Raises:
        ProfileFileError: unreadable, not a profile, a newer schema, or a field of the wrong type or value.
    """
    try:
        text = read_file_bytes(path, MAX_PROFILE_BYTES, "a profile").decode("utf-8")
    except FileProblemError as error:
        raise ProfileFileError(f"Profile '{shown_path(path)}' {error}; pass a profile.json written by "
                               "`mpsimpact sweep`.", path) from None
    except UnicodeDecodeError as error:
        raise ProfileFileError(f"Cannot read the profile '{path}': not UTF-8 ({error.reason} at byte "
                               f"{error.start}); pass a profile.json written by `mpsimpact sweep`.",
                               path) from None
    try:
        data = parse_json(text)  # no NaN or Infinity in a profile, nor nesting past MAX_JSON_DEPTH
    except ValueError as error:
        raise ProfileFileError(f"Cannot read the profile '{path}': {error}; pass a profile.json written by "
                               "`mpsimpact sweep`.", path) from None
    return profile_fields(data, path, families)


def profile_fields(data: Any, path: Path, families: frozenset[str]) -> dict[str, Any]:
    """The FaultProfile fields of a parsed profile.json (from `path`, which errors name)."""
    if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
        raise ProfileFileError(f"'{path}' is not an mpsimpact profile (its 'kind' is not '{PROFILE_KIND}'); "
                               "pass a profile.json written by `mpsimpact sweep`.", path)
    read = _Reader(path, data)
    version = read.get("schema_version", lambda v: isinstance(v, int) and v >= 1, "a whole number >= 1")
    if version > PROFILE_SCHEMA:
        raise ProfileFileError(f"Profile '{path}' has schema_version {version}, newer than this mpsimpact "
                               f"reads ({PROFILE_SCHEMA}); upgrade mpsimpact to use it.", path)
    release = read.get("release", is_release_name, "a release such as 2.15.0")
    measured_on = read.get("measured_on", lambda v: isinstance(v, dict), "an object")
    emulated = read.get("measured_on.emulated", lambda v: isinstance(v, bool), "true or false")
    rules = read.get("rules", lambda v: isinstance(v, dict) and set(ASPECTS) <= set(v),
                     f"an object with the keys {', '.join(ASPECTS)}")
    fields = (_bmm_fields(read) | _flags(read, "mm", ("mm_aborts",))
              | _flags(read, "sdpa", ("sdpa_fused", "sdpa_fused_wrong")) | _family_fields(read, families))
    unmeasured = tuple(a for a in ASPECTS if rules[a] is None or rules[a] == [])
    read.get("unmeasured", lambda v: v == list(unmeasured),
             f"{json.dumps(list(unmeasured))} (its null rules)")
    notes = read.get("notes", _are_notes, f"a list of at most {MAX_NOTES} texts of at most {MAX_NOTE_CHARS:,} "
                     "characters each")
    on_mac = measured_on.get("device") == "mps" and not emulated
    return fields | {
        "release": release, "group": release, "measured": on_mac, "source": str(path),
        "measured_on": describe_measurement(measured_on), "unmeasured": unmeasured,
        "notes": tuple(notes or ()),
    }


def _are_notes(value: Any) -> bool:
    return value is None or (isinstance(value, list) and len(value) <= MAX_NOTES
                             and all(isinstance(note, str) and len(note) <= MAX_NOTE_CHARS for note in value))


def _bmm_fields(read: _Reader) -> dict[str, Any]:
    """The first setting of "rules.bmm" as fields, the others (if any) as `alternatives`."""
    settings = read.get("rules.bmm", lambda v: v is None or isinstance(v, list), "a list of settings or null")
    checked = []
    for i, setting in enumerate(settings or ()):
        where = f"rules.bmm[{i}]"
        if not isinstance(setting, dict) or set(setting) != set(BMM_FIELDS):
            raise read.bad(where, f"an object with the keys {', '.join(BMM_FIELDS)}", setting)
        for name in BMM_FIELDS:
            value = setting[name]
            if name in BMM_CHOICES and value not in BMM_CHOICES[name]:
                raise read.bad(f"{where}.{name}", "one of " + ", ".join(BMM_CHOICES[name]), value)
            if name in ("slice_extent", "input_wrap") and not isinstance(value, bool):
                raise read.bad(f"{where}.{name}", "true or false", value)
            if name.endswith("message") and not isinstance(value, str):
                raise read.bad(f"{where}.{name}", "a text", value)
        checked.append(tuple((name, setting[name]) for name in BMM_FIELDS))
    if not checked:
        return {}
    return dict(checked[0]) | {"alternatives": tuple(checked) if len(checked) > 1 else ()}


def _flags(read: _Reader, aspect: str, names: tuple[str, ...]) -> dict[str, bool]:
    value = read.get(f"rules.{aspect}", lambda v: v is None or (
        isinstance(v, dict) and set(v) == set(names) and all(isinstance(x, bool) for x in v.values())),
        f"null or an object of true/false values for {', '.join(names)}")
    return dict(value or {})


def _family_fields(read: _Reader, families: frozenset[str]) -> dict[str, Any]:
    """"rules.families": {family: [code with a dimension past INT_MAX, code multi-dimensional]}."""
    value = read.get("rules.families", lambda v: v is None or isinstance(v, dict), "null or an object")
    if value is None:
        return {}
    rows = []
    for family, codes in sorted(value.items()):
        if family not in families:
            raise read.bad(f"rules.families.{family}", "a family of engine.release.OP_FAMILIES", family)
        if not (isinstance(codes, list) and len(codes) == 2 and all(c in FAMILY_CODES for c in codes)):
            raise read.bad(f"rules.families.{family}", "two codes of " + ", ".join(FAMILY_CODES), codes)
        rows.append((family, codes[0], codes[1]))
    return {"families": tuple(rows)}


def describe_measurement(measured_on: dict[str, Any]) -> str:
    """"torch 2.15.0, macOS 15.1 arm64 (Apple M2 Ultra), mps, 2026-11-20", and for an emulated sweep
    "emulating 2.5.1 on cpu (no Mac)"."""
    torch, machine, date = (measured_on.get(k) for k in ("torch", "machine", "date"))
    device = measured_on.get("device")
    where = (f"emulating {measured_on.get('emulated_release')} on {device} (no Mac)" if measured_on.get("emulated")
             else str(device))
    return ", ".join(str(part) for part in (f"torch {torch}", machine, where, date) if part)
