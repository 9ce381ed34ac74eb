"""The scenario base class and registry: a scenario declares a model, data and default geometry;
the runner does the rest (device, emulation, guard, reports)."""

from __future__ import annotations

import abc
import difflib
import importlib
import pkgutil
from typing import Any, ClassVar

from mpsimpact.errors import UsageError

_REGISTRY: dict[str, type[Scenario]] = {}


class Scenario(abc.ABC):
    """One demo workload. Cheap constructor; heavy work (weights, data) in `load()`."""

    name: ClassVar[str]
    description: ClassVar[str]
    default_batch_size: ClassVar[int] = 2048
    default_max_length: ClassVar[int] = 512

    def __init__(self, **options: Any) -> None:
        self.options = options

    @abc.abstractmethod
    def load(self) -> None:
        """Loads weights and data; called once by the runner."""


def register(cls: type[Scenario]) -> type[Scenario]:
    """Class decorator: makes `cls` available under `cls.name` (= its file name = CLI word)."""
    _REGISTRY[cls.name] = cls
    return cls


def _import_scenarios() -> None:
    package = importlib.import_module("mpsimpact.scenarios")
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"mpsimpact.scenarios.{info.name}")


def available() -> dict[str, type[Scenario]]:
    """Every registered scenario, by name."""
    _import_scenarios()
    return dict(sorted(_REGISTRY.items()))


def get_scenario(name: str) -> type[Scenario]:
    """The scenario class called `name`, or a UsageError that suggests the closest name."""
    scenarios = available()
    if name in scenarios:
        return scenarios[name]
    close = difflib.get_close_matches(name, scenarios, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise UsageError(
        f"Unknown scenario '{name}'.{hint} Available: {', '.join(scenarios) or 'none'}.",
        scenario=name,
    )
