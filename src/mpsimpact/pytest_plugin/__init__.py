"""mpsimpact's pytest plugin: a project's own test suite run as a Mac would run it. Every test, and the fixtures it
uses, inside the guard (`--mps-guard raise|warn|chunk`, every op with `--mps-strict`), the emulator
(`--mps-emulate`), or both (the emulator outside the guard), at MPS's index width or a narrow one
(`--mps-index-bits`), and a summary of every call site that would fault. Inactive unless one of its options is given
or a test is marked `mpsimpact`: it imports torch only then, so installing mpsimpact changes no one's run."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mpsimpact.pytest_plugin.block import DEVICE_CHOICES, Block, Settings
from mpsimpact.pytest_plugin.sighting import (
    EMULATED, GUESSED, WARNED, WARNED_PLAIN, Sighting, SightingsFile, columns, short_path, wrapped_lines,
)
from mpsimpact.pytest_plugin.usage import FIXTURE, GUARD_CHOICES, arguments_problem, first_problem, fixture_calls_problem

WORKER_KEY = "mpsimpact"  # what an xdist worker hands the controller (its sightings, as JSON)
USAGE_KEY = "mpsimpact-usage"  # and a usage error it found while collecting
# Code that is not the user's, by the packages' own folders (modes/call_site.py): where a call was asked for is
# the innermost frame outside these.
NOT_THE_USERS = ("torch", "mpsimpact", "mpsimpact.scenarios", "_pytest", "pytest", "pluggy", "xdist", "execnet",
                 "contextlib", "unittest")
# Fixtures that are pytest's own or ours: no tensor work of the user's to judge.
_NOT_USER_FIXTURES = ("_pytest", "pytest", "xdist", "mpsimpact")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mpsimpact", "mpsimpact: run the tests as PyTorch's MPS backend (a Mac) would")
    group.addoption("--mps-guard", choices=GUARD_CHOICES, default=None,
                    help="Every test (and its fixtures) inside mpsimpact.guard(MODE): raise fails a test whose call "
                         "would fault on MPS, warn warns once per site and never fails, chunk splits the call so it "
                         "is correct.")
    group.addoption("--mps-strict", action="store_true", default=False,
                    help="The guard in strict mode: every aten op judged through its dispatch mode, also calls that "
                         "bypass torch's Python entry points (TorchScript, names bound before the guard).")
    group.addoption("--mps-emulate", action="store_true", default=False,
                    help="Every test (and its fixtures) under mpsimpact.emulate(): its outputs are what MPS would "
                         "return; with --mps-guard, the guard runs inside the emulator.")
    group.addoption("--mps-profile", default=None, metavar="RELEASE",
                    help="The torch release whose MPS faults apply (2.12.1, 'conservative', or a profile.json from "
                         "`mpsimpact sweep`); default: as the mpsimpact commands decide, said in the header.")
    group.addoption("--mps-index-bits", default=None, metavar="N",
                    help="Scale every limit by 2^(32-N) (4..32; 32 is MPS), so small tests cross them as "
                         "full-size runs do.")
    group.addoption("--mps-devices", default=None, metavar="LIST",
                    help="Devices whose tensors the guard judges, comma-separated (cpu, cuda, mps); default mps, "
                         "and cpu and cuda too where there is no Apple GPU (so Linux CI sees the calls).")
    group.addoption("--mps-json", default=None, metavar="PATH",
                    help="Also write the summary (every call site that would fault) to this JSON file (a new file, "
                         "or over a regular file, in an existing folder).")


@pytest.fixture
def mpsimpact_as_a_mac(request: pytest.FixtureRequest) -> Any:
    """Inside a test, the same as the marker for a block: `with mpsimpact_as_a_mac("chunk"): ...` (raise, warn,
    chunk, emulate, or off: neither, e.g. around a comparison of large results), with the options' release,
    devices and index width (or `index_bits=`); its calls join the summary. The options' emulator and guard step
    aside for the block and come back after it."""
    run: MacRun = request.config.pluginmanager.get_plugin("mpsimpact-run")

    def as_a_mac(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        problem = arguments_problem(args, kwargs, f"{FIXTURE}(...)")
        if problem is not None:  # a literal call was refused before any test ran; this one was computed
            pytest.exit(f"{request.node.nodeid}: {problem}", returncode=pytest.ExitCode.USAGE_ERROR)
        mode = kwargs.get("mode", args[0] if args else "raise")
        guard_mode = None if mode in ("emulate", "off") else mode
        emulated = mode == "emulate" or mode != "off" and run.settings.emulate
        return run.as_a_mac(request.node.nodeid, guard_mode, emulated, kwargs.get("index_bits"))

    return as_a_mac


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "mpsimpact(mode, index_bits=N): run this test as MPS would whatever the "
                                       "options: raise, warn or chunk (the guard), emulate, or off (neither "
                                       "emulator nor guard)")
    run = MacRun(Settings.of(config), config)
    if run.settings.profile is not None:
        run.release  # noqa: B018 - a bad --mps-profile is a usage error before any test runs
    config.pluginmanager.register(run, "mpsimpact-run")


class MacRun:
    """The plugin's state for one pytest session (or one xdist worker): the settings, the blocks entered (the
    innermost last), and every sighting."""

    def __init__(self, settings: Settings, config: pytest.Config) -> None:
        self.settings, self.config = settings, config
        self.sightings: dict[tuple[Any, ...], Sighting] = {}
        self.blocks: list[Block] = []
        self.usage: str | None = None  # a usage error a worker found (xdist: the controller says it)
        self.refused = False  # a usage error found while collecting: no summary, nothing written
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

    def width(self) -> int | None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        tw = getattr(reporter, "_tw", None)
        return columns(bool(getattr(reporter, "isatty", False)), getattr(tw, "fullwidth", 80))

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        if not self.settings.active:
            return []
        s, width = self.settings, self.width()
        what = [f"guard {s.guard}{' (strict)' if s.strict else ''}"] if s.guard else []
        what += ["EMULATED MPS (no Apple GPU used; the emulator outside the guard)" if s.emulate and s.guard else
                 "EMULATED MPS (no Apple GPU used)" if s.emulate else "not emulated"]
        bits = f"index width {s.index_bits} bits (every limit divided by 2^{32 - s.index_bits})" \
            if s.index_bits else "MPS's index width (32 bits)"
        lines = [f"mpsimpact: {', '.join(what)}; {bits}; devices {', '.join(self.devices)}.",
                 f"mpsimpact: {self.release.sentence('--mps-profile')}"]
        return [part for line in lines for part in wrapped_lines(line, width)]

    @property
    def devices(self) -> tuple[str, ...]:
        if self.settings.devices is not None:
            return self.settings.devices
        import torch

        return ("mps",) if torch.backends.mps.is_available() else DEVICE_CHOICES

    def mode_for(self, item: pytest.Item) -> tuple[str | None, bool, int | None] | None:
        """(guard mode or None, emulate, index bits or None) for a test; None where the plugin leaves it alone."""
        mark = item.get_closest_marker("mpsimpact")
        if mark is not None:
            mode = mark.kwargs.get("mode", mark.args[0] if mark.args else self.settings.guard or "raise")
            bits = mark.kwargs.get("index_bits")
            if mode == "off":
                return None
            return (None, True, bits) if mode == "emulate" else (mode, self.settings.emulate, bits)
        if not (self.settings.guard or self.settings.emulate):
            return None
        return self.settings.guard, self.settings.emulate, None

    def mode_for_fixture(self, fixturedef: Any, request: Any) -> tuple[tuple[str | None, bool, int | None], str] | None:
        """(mode, who) for a fixture's setup and teardown: a function-scoped fixture as its test; a wider one
        under the options once (it serves tests of any mark), its sightings named after it."""
        module = getattr(getattr(fixturedef, "func", None), "__module__", "") or ""
        if module.split(".")[0] in _NOT_USER_FIXTURES:
            return None
        if fixturedef.scope == "function":
            asked = self.mode_for(request.node) if isinstance(request.node, pytest.Item) else None
            return (asked, request.node.nodeid) if asked is not None else None
        if not (self.settings.guard or self.settings.emulate):
            return None
        return (self.settings.guard, self.settings.emulate, None), f"fixture {fixturedef.argname} ({fixturedef.scope} scope)"

    @contextlib.contextmanager
    def as_a_mac(self, who: str, guard_mode: str | None, emulated: bool, bits: int | None = None) -> Iterator[None]:
        """The emulator (outside) and the guard (inside) for `who` (a test, a fixture), their records noted with
        their sites. Inside another block of the plugin's, that one steps aside for this one and comes back
        after it (the emulator is never entered inside a guard)."""
        outer = self.blocks[-1] if self.blocks and self.blocks[-1].can_step_aside() else None
        if outer is not None:  # else this block goes inside it (the emulator's own error says where it cannot)
            outer.leave()
        block = Block(self, who, guard_mode, emulated, bits or self.settings.index_bits)
        self.blocks.append(block)
        try:
            block.enter()
            try:
                yield
            finally:
                block.leave()
        finally:
            self.blocks.pop()
            if outer is not None:
                outer.enter()

    def note(self, who: str, record: Any, action: str, per: int, said: str, bits: int) -> None:
        from mpsimpact.modes.call_site import innermost_outside

        fault = record.fault
        frame = innermost_outside(NOT_THE_USERS)
        site = f"{short_path(frame.filename)}:{frame.lineno}" if frame is not None else "(no line of yours)"
        if fault.nobody_measured and action in (EMULATED["returned"], WARNED, WARNED_PLAIN):
            action += GUESSED
        batch, release = fault.first_bad_batch, fault.release or self.release.profile.release
        self.add(Sighting(site, record.describe(), fault.kind, fault.rule, release, batch, [who], [action], per, bits,
                          said, None if batch is None else batch // per))

    def add(self, seen: Sighting) -> None:
        """A sighting, merged into the one of its site and fault where there is one."""
        found = self.sightings.setdefault(seen.key, seen)
        if found is not seen:
            found.merge(seen)

    # The phases: setup (the fixtures, below), call and teardown judged alike.
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        asked = self.mode_for(item)
        if asked is None:
            return (yield)
        with self.as_a_mac(item.nodeid, *asked):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Any:
        """A fixture's setup under its mode, and its teardown too: the finalizers run last first, so the one
        added before the fixture's own leaves the block its teardown ran in, and the one added after enters it."""
        found = None if self.blocks else self.mode_for_fixture(fixturedef, request)
        if found is None:  # a fixture asked for inside a block already runs in that block
            return (yield)
        asked, who = found
        teardown = contextlib.ExitStack()
        fixturedef.addfinalizer(teardown.close)
        with self.as_a_mac(who, *asked):
            result = yield
        fixturedef.addfinalizer(lambda: teardown.enter_context(self.as_a_mac(who, *asked)))
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: Any) -> Any:
        """A failed test's report gains a section: each site it reached, what was done, and what to do."""
        if call.when == "teardown":  # every phase's sightings are in by now; a report copies the properties
            item.user_properties += [("mpsimpact", s.line()) for s in self.sightings.values() if item.nodeid in s.tests]
        report = yield
        if report.failed:
            mine = [s for s in self.sightings.values() if item.nodeid in s.tests]
            if mine:
                width = self.width()
                text = "\n".join(line for s in mine for line in wrapped_lines(s.section(), width, 2))
                report.sections.append(("mpsimpact: calls that would fault on MPS", text))
        return report

    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        """The markers' and the fixture's literal arguments, checked before any test runs."""
        problem = first_problem(self._usage_problem(item) for item in items)
        if problem is None:
            return
        if getattr(config, "workerinput", None) is None:
            self.refused = True  # pytest says it; nothing is written
            raise pytest.UsageError(problem)
        # An xdist worker: no test runs, and the controller says it (a worker's UsageError is its INTERNALERROR).
        config.workeroutput[USAGE_KEY] = problem
        config.hook.pytest_deselected(items=list(items))
        items.clear()

    def _usage_problem(self, item: pytest.Item) -> str | None:
        mark = item.get_closest_marker("mpsimpact")
        if mark is not None:
            problem = arguments_problem(mark.args, mark.kwargs, "@pytest.mark.mpsimpact(...)")
            if problem is not None:
                return f"{item.nodeid}: {problem}"
        function = getattr(item, "function", None)
        if FIXTURE in getattr(item, "fixturenames", ()) and function is not None:
            return fixture_calls_problem(function, item.nodeid)
        return None

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: the controller collects
            workeroutput[WORKER_KEY] = json.dumps([s.to_json() for s in self.sightings.values()])
            return
        if self.refused:
            return
        if self.usage is not None:
            import sys

            print(f"ERROR: {self.usage}", file=sys.stderr)
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
            return
        if self.settings.json_path:
            self.write_json(Path(self.settings.json_path))

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist: a worker's sightings, merged into the controller's (and a usage error it found)."""
        output = getattr(node, "workeroutput", {})
        self.usage = self.usage or output.get(USAGE_KEY)
        for fields in json.loads(output.get(WORKER_KEY, "[]")):
            self.add(Sighting.from_json(fields))

    def write_json(self, path: Path) -> None:
        """The summary as JSON, written beside and renamed over (never half-written)."""
        from mpsimpact.output.files import atomic_write_text

        data = SightingsFile.of({"release": self.release.to_json(), "settings": self.settings.to_json(),
                                 "calls": [s.to_json() for s in self.sightings.values()]})
        atomic_write_text(path, json.dumps(data.to_json(), indent=2) + "\n")

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.refused or self.usage is not None or not self.settings.active and not self.sightings:
            return
        width = self.width()
        terminalreporter.section(f"mpsimpact: calls that would fault on MPS (torch {self.release.profile.label})")
        if not self.sightings:
            terminalreporter.write_line("No call of any test crosses a limit.")
        for sighting in self.sightings.values():
            for line in wrapped_lines(sighting.line(), width):
                terminalreporter.write_line(line)
        if self.settings.json_path:
            terminalreporter.write_line(f"Written to {self.settings.json_path}")

