"""mpsimpact's pytest plugin: a project's own test suite run as a Mac would run it. Every test inside the guard
(`--mps-guard raise|warn|chunk`, every op with `--mps-strict`), the emulator (`--mps-emulate`), or both, at MPS's
index width or a narrow one (`--mps-index-bits`), and a summary of every call site that would fault. Inactive unless
one of its options is given or a test is marked `mpsimpact`: it imports torch only then, so installing mpsimpact
changes no one's run."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

GUARD_CHOICES = ("raise", "warn", "chunk")
MARK_CHOICES = (*GUARD_CHOICES, "emulate", "off")
DEVICE_CHOICES = ("cpu", "cuda", "mps")
WORKER_KEY = "mpsimpact"  # what an xdist worker hands the controller (its sightings, as JSON)
# Frames that are not the user's: where a call was asked for is the innermost frame outside these.
_NOT_THE_USERS = ("/torch/", "/mpsimpact/", "/_pytest/", "/pluggy/", "/contextlib.py", "/unittest/")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mpsimpact", "mpsimpact: run the tests as PyTorch's MPS backend (a Mac) would")
    group.addoption("--mps-guard", choices=GUARD_CHOICES, default=None,
                    help="Every test inside mpsimpact.guard(MODE): raise fails a test whose call would fault on "
                         "MPS, warn warns once per site and never fails, chunk splits the call so it is correct.")
    group.addoption("--mps-strict", action="store_true", default=False,
                    help="The guard in strict mode: every aten op judged through its dispatch mode, also calls that "
                         "bypass torch's Python entry points (TorchScript, names bound before the guard).")
    group.addoption("--mps-emulate", action="store_true", default=False,
                    help="Every test under mpsimpact.emulate(): its outputs are what MPS would return.")
    group.addoption("--mps-profile", default=None, metavar="RELEASE",
                    help="The torch release whose MPS faults apply (2.12.1, 'conservative', or a profile.json from "
                         "`mpsimpact sweep`); default: as the mpsimpact commands decide, said in the header.")
    group.addoption("--mps-index-bits", type=int, default=None, metavar="N",
                    help="Scale every limit by 2^(32-N) (4..32; 32 is MPS), so small tests cross them as "
                         "full-size runs do.")
    group.addoption("--mps-devices", default=None, metavar="LIST",
                    help="Devices whose tensors the guard judges, comma-separated (cpu, cuda, mps); default mps, "
                         "and cpu and cuda too where there is no Apple GPU (so Linux CI sees the calls).")
    group.addoption("--mps-json", default=None, metavar="PATH",
                    help="Also write the summary (every call site that would fault) to this JSON file.")


@pytest.fixture
def mpsimpact_as_a_mac(request: pytest.FixtureRequest) -> Any:
    """Inside a test, the same as the marker for a block: `with mpsimpact_as_a_mac("chunk"): ...` (raise, warn,
    chunk or emulate), with the options' release, index width and devices; its calls join the summary."""
    run: MacRun = request.config.pluginmanager.get_plugin("mpsimpact-run")

    def as_a_mac(mode: str = "raise") -> Any:
        if mode not in MARK_CHOICES[:-1]:
            raise pytest.UsageError(f"mpsimpact_as_a_mac takes one of {', '.join(MARK_CHOICES[:-1])}; got {mode!r}.")
        guard_mode, emulated = (None, True) if mode == "emulate" else (mode, run.settings.emulate)
        return run.as_a_mac(request.node.nodeid, guard_mode, emulated)

    return as_a_mac


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mpsimpact(mode): run this test as MPS would whatever the options: raise, "
                                       "warn or chunk (the guard), emulate, or off (neither emulator nor guard)")
    config.pluginmanager.register(MacRun(Settings.of(config), config), "mpsimpact-run")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the options asked; `active`: any of them given."""

    guard: str | None = None
    strict: bool = False
    emulate: bool = False
    profile: str | None = None
    index_bits: int | None = None
    devices: tuple[str, ...] | None = None
    json_path: str | None = None

    @classmethod
    def of(cls, config: pytest.Config) -> Settings:
        """The options, checked (one line each, as pytest says a usage error)."""
        bits, devices = config.getoption("mps_index_bits"), config.getoption("mps_devices")
        if bits is not None and not 4 <= bits <= 32:
            raise pytest.UsageError(f"--mps-index-bits must be in 4..32 (32 is MPS), got {bits}.")
        if devices is not None:
            devices = tuple(d.strip() for d in devices.split(",") if d.strip())
            unknown = [d for d in devices if d not in DEVICE_CHOICES]
            if unknown or not devices:
                raise pytest.UsageError(f"--mps-devices takes {', '.join(DEVICE_CHOICES)}, comma-separated; got "
                                        f"{config.getoption('mps_devices')!r}.")
        if config.getoption("mps_strict") and not config.getoption("mps_guard"):
            raise pytest.UsageError("--mps-strict applies to the guard: give --mps-guard raise, warn or chunk too.")
        return cls(config.getoption("mps_guard"), config.getoption("mps_strict"), config.getoption("mps_emulate"),
                   config.getoption("mps_profile"), bits, devices, config.getoption("mps_json"))

    @property
    def active(self) -> bool:
        return bool(self.guard or self.emulate or self.profile or self.index_bits or self.devices or self.json_path)


@dataclasses.dataclass
class Sighting:
    """One call site that would fault on MPS: the op and its shapes, the rule, the release, the first wrong batch,
    the tests that reached it and what was done there."""

    site: str
    call: str
    kind: str
    rule: str
    release: str
    first_bad_batch: int | None
    tests: list[str] = dataclasses.field(default_factory=list)
    actions: list[str] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> tuple[Any, ...]:
        return self.site, self.call, self.kind, self.rule, self.release, self.first_bad_batch

    def merge(self, other: Sighting) -> None:
        self.tests += [t for t in other.tests if t not in self.tests]
        self.actions += [a for a in other.actions if a not in self.actions]

    def line(self) -> str:
        first = f", wrong from batch {self.first_bad_batch}" if self.first_bad_batch is not None else ""
        tests = ", ".join(self.tests[:3]) + (f" and {len(self.tests) - 3} more" if len(self.tests) > 3 else "")
        return (f"{self.site}: {self.call}: {self.kind} on MPS {self.release} (rule {self.rule}{first}); "
                f"{'; '.join(self.actions)}; reached by {tests}")


def user_site() -> str:
    """'path:line' of the innermost frame that is neither torch's, mpsimpact's nor pytest's: where the call was
    asked for."""
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename.replace(os.sep, "/") for part in _NOT_THE_USERS):
            return f"{_short(frame.filename)}:{frame.lineno}"
    return "?"


def _short(filename: str) -> str:
    try:
        return os.path.relpath(filename)
    except ValueError:  # another drive
        return filename


class _Sighted(list):
    """A mode's record list that notes, as each record is added, where in the user's code the call was made."""

    def __init__(self, note: Any, action: str) -> None:
        super().__init__()
        self._note, self._action = note, action

    def append(self, record: Any) -> None:
        super().append(record)
        self._note(record, self._action, user_site())


class MacRun:
    """The plugin's state for one pytest session (or one xdist worker): the settings, and every sighting."""

    def __init__(self, settings: Settings, config: pytest.Config) -> None:
        self.settings, self.config = settings, config
        self.sightings: dict[tuple[Any, ...], Sighting] = {}
        self._release: Any = None

    @property
    def release(self) -> Any:
        """The judged release (engine.release.JudgedRelease): --mps-profile's, else as the commands decide."""
        if self._release is None:
            from mpsimpact.engine.release import judge_release
            from mpsimpact.errors import UsageError

            try:
                self._release = judge_release(self.settings.profile)
            except (UsageError, ValueError) as error:
                raise pytest.UsageError(f"--mps-profile: {error}") from None
        return self._release

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        if not self.settings.active:
            return []
        s = self.settings
        what = [f"guard {s.guard}{' (strict)' if s.strict else ''}"] if s.guard else []
        what += ["EMULATED MPS (no Apple GPU used)" if s.emulate else "not emulated"]
        width = f"index width {s.index_bits} bits (limits scaled by 2^{32 - s.index_bits})" if s.index_bits else \
            "MPS's index width (32 bits)"
        return [f"mpsimpact: {', '.join(what)}; {width}; devices {', '.join(self.devices)}",
                f"mpsimpact: {self.release.sentence()}"]

    @property
    def devices(self) -> tuple[str, ...]:
        if self.settings.devices is not None:
            return self.settings.devices
        import torch

        return ("mps",) if torch.backends.mps.is_available() else DEVICE_CHOICES

    def mode_for(self, item: pytest.Item) -> tuple[str | None, bool] | None:
        """(guard mode or None, emulate) for a test; None where the plugin leaves it alone."""
        mark = item.get_closest_marker("mpsimpact")
        if mark is not None:
            mode = mark.args[0] if mark.args else mark.kwargs.get("mode", self.settings.guard or "raise")
            if mode not in MARK_CHOICES:
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.mpsimpact takes one of "
                                        f"{', '.join(MARK_CHOICES)}; got {mode!r}.")
            if mode == "off":
                return None
            return (None, True) if mode == "emulate" else (mode, self.settings.emulate)
        if not self.settings.active or not (self.settings.guard or self.settings.emulate):
            return None
        return self.settings.guard, self.settings.emulate

    @contextlib.contextmanager
    def as_a_mac(self, test: str, guard_mode: str | None, emulated: bool) -> Iterator[None]:
        """The emulator (outside) and the guard (inside) for one test, their records noted with their sites."""
        from mpsimpact.engine.faults import MPS_INDEX_BITS
        from mpsimpact.modes.emulator import emulate
        from mpsimpact.modes.guard import guard

        bits, profile = self.settings.index_bits or MPS_INDEX_BITS, self.release.profile

        def note(record: Any, action: str, site: str) -> None:
            self.note(test, record, action, site)

        with contextlib.ExitStack() as stack:
            if emulated:
                emulator = stack.enter_context(emulate(index_bits=bits, profile=profile))
                emulator.records = _Sighted(note, "emulated: MPS's values returned")
            if guard_mode:
                devices = None if emulated else self.devices
                mode = stack.enter_context(guard(guard_mode, index_bits=bits, profile=profile, devices=devices,
                                                 strict=self.settings.strict))
                mode.stopped = _Sighted(note, "guard raise: stopped, the test fails")
                mode.chunked = _Sighted(note, "guard chunk: split, correct")
                mode.warned = _Sighted(note, "guard warn: warned, ran as MPS would")
            yield

    def note(self, test: str, record: Any, action: str, site: str) -> None:
        fault = record.fault
        if fault.is_stop and action.startswith("emulated"):
            action = f"emulated: MPS {'aborts' if fault.kind == 'abort' else 'raises'} ({fault.message})"
        seen = Sighting(site, record.describe(), fault.kind, fault.rule, fault.release or self.release.profile.release,
                        fault.first_bad_batch, [test], [action])
        found = self.sightings.setdefault(seen.key, seen)
        if found is not seen:
            found.merge(seen)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        asked = self.mode_for(item)
        if asked is None:
            return (yield)
        before = {key: list(s.tests) for key, s in self.sightings.items()}
        try:
            with self.as_a_mac(item.nodeid, *asked):
                return (yield)
        finally:
            for key, sighting in self.sightings.items():
                if item.nodeid in sighting.tests and item.nodeid not in before.get(key, ()):
                    item.user_properties.append(("mpsimpact", sighting.line()))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: the controller collects
            workeroutput[WORKER_KEY] = json.dumps([dataclasses.asdict(s) for s in self.sightings.values()])
            return
        if self.settings.json_path:
            self.write_json(Path(self.settings.json_path))

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist: a worker's sightings, merged into the controller's."""
        for fields in json.loads(getattr(node, "workeroutput", {}).get(WORKER_KEY, "[]")):
            seen = Sighting(**fields)
            found = self.sightings.setdefault(seen.key, seen)
            if found is not seen:
                found.merge(seen)

    def write_json(self, path: Path) -> None:
        """The summary as JSON, written beside and renamed over (never half-written)."""
        data = {"release": self.release.to_json(), "settings": dataclasses.asdict(self.settings),
                "calls": [dataclasses.asdict(s) for s in self.sightings.values()]}
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(partial, path)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.settings.active and not self.sightings:
            return
        release = self.release.profile.label
        terminalreporter.section(f"mpsimpact: calls that would fault on MPS (torch {release})")
        if not self.sightings:
            terminalreporter.write_line("No call of any test crosses a limit.")
        for sighting in self.sightings.values():
            terminalreporter.write_line(sighting.line())
        if self.settings.json_path:
            terminalreporter.write_line(f"Written to {self.settings.json_path}")
