"""Every kind of run by its report name: what reads a report of any kind (the console summary, compare)
finds the kind here."""

from __future__ import annotations

from mpsimpact.errors import UsageError
from mpsimpact.runs.classify_kind import ClassifyKind
from mpsimpact.runs.embed_kind import EmbedKind
from mpsimpact.runs.kind import RunKind
from mpsimpact.runs.train_kind import TrainKind

KINDS: dict[str, RunKind] = {kind.name: kind for kind in (ClassifyKind(), EmbedKind(), TrainKind())}


def kind_of(report: dict) -> RunKind:
    """The kind that wrote `report`, by its "kind" field (reports before the field: inference)."""
    name = report.get("kind", "inference")
    if name not in KINDS:
        raise UsageError(f"Report kind '{name}' is not one this mpsimpact knows ({', '.join(sorted(KINDS))}).")
    return KINDS[name]
