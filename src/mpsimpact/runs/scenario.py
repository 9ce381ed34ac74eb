"""The scenario base class and registry: a scenario declares a model, data and default geometry;
the runner does the rest (device, emulation, guard, reports)."""

from __future__ import annotations

import abc
import difflib
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, ClassVar

from mpsimpact.errors import UsageError

if TYPE_CHECKING:
    import torch

_REGISTRY: dict[str, type[Scenario]] = {}


class Scenario(abc.ABC):
    """One demo workload. Cheap constructor; heavy work (weights, data) in `load()`.

    Everything the runner, the planner and the reports use is declared here: the name,
    description and default geometry; the kind of run (a `RunKind`, which runs the conditions and
    answers for the report); after `load()`, `model` (a classifier.LoadedModel-like object: module,
    tokenizer, config, label_names, name, max_positions, heads) and `data` (dataset.LabelledTexts);
    and, without weights, `load_config()` and `meta_module()` for the shape-only tracer.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    default_batch_size: ClassVar[int] = 2048
    default_max_length: ClassVar[int] = 512
    kind: ClassVar[Any]  # a runs.kind.RunKind (kinds register themselves there)

    def __init__(self, model: str | None = None, dataset: str | None = None, **options: Any) -> None:
        self.options = {"model": model, "dataset": dataset, **options}
        self.model_name, self.dataset_name = model, dataset  # --model and --dataset; None: the embedded ones
        self.model: Any = None
        self.data: Any = None

    @abc.abstractmethod
    def load(self) -> None:
        """Loads weights and data into `model` and `data`; called once by the runner."""

    def load_config(self) -> Any:
        """The model's config alone (no weights): enough to trace. `model_name`'s (a hub id in the offline
        cache, a folder or a config.json), or the embedded all-MiniLM-L6-v2's for None."""
        from mpsimpact.models.classifier import embedded_model_path
        from mpsimpact.prediction.meta_model import load_model_config

        return load_model_config(str(embedded_model_path()) if self.model_name is None else self.model_name)[0]

    @abc.abstractmethod
    def meta_module(self, config: Any | None = None, attention: str = "eager") -> torch.nn.Module:
        """The model built on `meta` from `config` (default: the loaded model's) with an attention
        implementation; called as `module(input_ids=...)` by the tracer, it makes exactly the
        bmm/mm calls the device pass makes."""


def register(cls: type[Scenario]) -> type[Scenario]:
    """Class decorator: makes `cls` available under `cls.name` (= its file name = CLI word)."""
    _REGISTRY[cls.name] = cls
    return cls


def available() -> dict[str, type[Scenario]]:
    """Every registered scenario, by name."""
    package = importlib.import_module("mpsimpact.scenarios")
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"mpsimpact.scenarios.{info.name}")
    return dict(sorted(_REGISTRY.items()))


def scenario_names() -> list[str]:
    """The scenarios' names without importing them (each module registers under its file's name), so that a
    typo is refused before torch is imported; and any scenario registered from elsewhere (a test's)."""
    package = importlib.import_module("mpsimpact.scenarios")
    files = {info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_")}
    return sorted(files | set(_REGISTRY))


def check_scenario_name(name: str) -> None:
    """Raises a UsageError that suggests the closest name when no scenario is called `name`."""
    names = scenario_names()
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise UsageError(f"Unknown scenario '{name}'.{hint} Available: {', '.join(names) or 'none'}.", scenario=name)


def get_scenario(name: str) -> type[Scenario]:
    """The scenario class called `name`, or a UsageError that suggests the closest name."""
    check_scenario_name(name)
    return available()[name]
