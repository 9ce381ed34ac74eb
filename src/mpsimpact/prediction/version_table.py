"""The version table: what one geometry does on every torch release, per attention implementation and
workload (inference, one training step), from shapes alone. The slide for "what changes if I upgrade?"."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from mpsimpact.config import ATTENTIONS, NEWER, WORKLOADS
from mpsimpact.engine.faults import MPS_INDEX_BITS
from mpsimpact.prediction.outcome import Prediction, predict, step_outcome
from mpsimpact.prediction.meta_model import trace_meta
from mpsimpact.engine.release import CONSERVATIVE, MEASURED_RELEASES, measured_profiles, profile_for
from mpsimpact.output.record import ABSENT, Record


@dataclasses.dataclass(frozen=True, eq=False)
class VersionRow(Record):
    """One row of the version table as files hold it (report.json's and plan.json's "versions"): a release range,
    an attention implementation and a workload (older reports: "phase"), and what that geometry does there."""

    release: str
    attention: str
    outcome: str
    workload: str = ABSENT
    phase: str = ABSENT
    first_corrupted_text: int | None = ABSENT
    corrupted_count: int | None = ABSENT
    message: str | None = ABSENT
    cannot_tell: bool = ABSENT
    note: str | None = ABSENT


def cell(forward: Prediction, whole: Prediction | None) -> dict[str, Any]:
    """One cell: the forward pass's outcome, and for a training step what the backward adds."""
    outcome, message = step_outcome(forward, whole, Prediction.describe, outputs="logits")
    return {"outcome": outcome, "first_corrupted_text": forward.first_corrupted_text,
            "corrupted_count": forward.corrupted_count if forward.first_corrupted_text is not None else None,
            "message": message}


def version_table(meta_for: Callable[[str], torch.nn.Module], batch: int, length: int, heads: int,
                  index_bits: int = MPS_INDEX_BITS) -> list[dict[str, Any]]:
    """Rows {release, attention, workload, outcome, first_corrupted_text, corrupted_count, message, note}:
    one per release range whose cells agree, and one for unmeasured newer releases.

    Args:
        meta_for: builds the model on meta with an attention implementation ("eager", "sdpa").
    """
    profiles = (*measured_profiles(), profile_for(CONSERVATIVE))
    traces = {(attention, workload): trace_meta(meta_for(attention), batch, length, backward=workload == "training",
                                             index_bits=index_bits, profile=profiles[-1])
              for attention in ATTENTIONS for workload in WORKLOADS}
    per_release = {}
    for profile in profiles:
        cells = {}
        for (attention, workload), plan in traces.items():
            decided = plan.under(profile)
            whole = predict(decided, batch, heads, "all") if workload == "training" else None
            cells[(attention, workload)] = cell(predict(decided, batch, heads, "forward"), whole)
        per_release[profile.release] = cells
    return _merge(per_release)


def _merge(per_release: dict[str, dict]) -> list[dict[str, Any]]:
    """Consecutive measured releases with equal cells become one row ("2.10.0-2.12.1")."""
    groups: list[list[str]] = []
    for release in MEASURED_RELEASES:
        if groups and per_release[groups[-1][-1]] == per_release[release]:
            groups[-1].append(release)
        else:
            groups.append([release])
    groups.append([CONSERVATIVE])
    rows = []
    for group in groups:
        label = (NEWER if group == [CONSERVATIVE] else group[0] if len(group) == 1
                 else f"{group[0]}-{group[-1]}")
        note = " ".join(sorted({n for release in group for n in profile_for(release).notes}))
        for (attention, workload), value in per_release[group[0]].items():
            if group == [CONSERVATIVE]:  # nobody measured them: said so, the worst measured release's outcome after
                value = value | {"cannot_tell": True, "message": f"{CANNOT_TELL}; judged as the worst measured "
                                                                 f"release would be: {value['message']}"}
            rows.append({"release": label, "attention": attention, "workload": workload, **value, "note": note})
    return rows


# How every table says what nobody measured (plan, check, run and compare say "cannot tell" too).
CANNOT_TELL = "cannot tell: nobody measured these releases on MPS (`mpsimpact sweep` on a Mac measures one)"
