"""`mpsimpact matrix`: the transformers side of an upgrade check. Each transformers release runs the probe
(matrix_probe) in an overlay environment (overlay) over the installed torch; a row says which attention a
model gets, which calls reach MPS with which layout, their outcome per torch release group, and whether
the guard still stops and splits them."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from mpsimpact.config import ATTENTIONS, EMBEDDED_MODEL, NEWER, MatrixConfig
from mpsimpact.engine.call import PRODUCTS
from mpsimpact.engine.release import FaultProfile, JudgedRelease, family_of, judge_release
from mpsimpact.errors import UsageError
from mpsimpact.output.record import ABSENT, Record
from mpsimpact.upgrade.probe import TINY_RUN, WITH_WEIGHTS
from mpsimpact.upgrade.overlay import OverlayCache, OverlayError, probe_environment
from mpsimpact.variables import is_offline

SCHEMA_VERSION = 1
# The tiny emulated run's release: the last where both eager's P V wraps and fused SDPA is wrong, so
# the guard has something to stop and split on either attention path.
EMULATED_PROFILE = "2.12.1"

Progress = Callable[[str, str], None]  # (transformers version, stage: building, probing, done, failed)
Prober = Callable[[Path, dict[str, Any]], dict[str, Any]]


def profile_columns(*profiles: FaultProfile) -> list[dict[str, str]]:
    """One torch profile per release group, oldest first, the conservative one for newer releases, and each
    of `profiles` (resolved once, by the command) unless one of those, in its own column (`column_of`)."""
    from mpsimpact.engine.release import CONSERVATIVE, group_representatives

    columns = [{"profile": p.release, "group": p.group} for p in group_representatives()]
    columns.append({"profile": CONSERVATIVE, "group": NEWER})
    for asked in profiles:
        if asked.ref not in {c["profile"] for c in columns}:
            columns.append({"profile": asked.ref, "group": column_of(asked)})
    return columns


def probe_job(config: MatrixConfig, release: JudgedRelease | None = None) -> dict[str, Any]:
    """What every environment's probe is asked: the model's config source, task and geometry, and the profiles
    of the matrix's columns, as strings (`release`: the command's judged release; None: judged here)."""
    from mpsimpact.models.classifier import embedded_model_path
    from mpsimpact.prediction.meta_model import usable_positions
    from mpsimpact.runs.scenario import get_scenario

    scenario_cls = get_scenario(config.scenario)
    batch = config.batch_size or scenario_cls.default_batch_size
    length = config.max_length or scenario_cls.default_max_length
    model_config = scenario_cls(model=config.model).load_config()  # fails early on a bad --model
    if length > usable_positions(model_config):
        raise UsageError(f"--max-length {length} exceeds the model's {usable_positions(model_config)} positions.")
    release = release or judge_release(config.torch_profile)
    return {
        "model": config.model or str(embedded_model_path()),
        "task": "sequence-classification" if config.model else "base",
        "batch_size": batch, "max_length": length,
        "profiles": [c["profile"] for c in profile_columns(release.profile, release.installed)],
        "emulated_profile": EMULATED_PROFILE,
    }


@dataclasses.dataclass(frozen=True, eq=False)
class MatrixRow(Record):
    """One release of transformers: its environment, and what the probe found there (or why it could not)."""

    transformers: str
    status: Literal["probed", "missing", "failed"]
    timing: dict[str, Any] = ABSENT
    overlay: dict[str, Any] = ABSENT
    probe: dict[str, Any] = ABSENT
    findings: dict[str, Any] = ABSENT
    cells: dict[str, Any] = ABSENT
    reason: str = ABSENT

    def problem(self) -> str | None:
        return "status is probed, but it has no findings" if self.status == "probed" and not self.findings else None


@dataclasses.dataclass(frozen=True, eq=False)
class MatrixReport(Record):
    """What `matrix` concludes (matrix.json): the release judged, the job probed, and a row per transformers
    release; made by `build_matrix`, written by reports.matrix."""

    schema: int
    kind: Literal["matrix"]
    rows: list[MatrixRow]
    all_ok: bool
    release: dict[str, Any] = ABSENT
    config: dict[str, Any] = ABSENT
    model: str = ABSENT
    job: dict[str, Any] = ABSENT
    offline: bool = ABSENT
    cache: str = ABSENT
    emulated: dict[str, Any] = ABSENT
    environment: dict[str, Any] = ABSENT
    columns: list[dict[str, Any]] = ABSENT
    wall_s: float = ABSENT


def build_matrix(config: MatrixConfig, *, cache: OverlayCache | None = None, prober: Prober = probe_environment,
                 progress: Progress | None = None) -> MatrixReport:
    """Builds (or finds) each release's environment, probes it, and assembles matrix.json's content."""
    from mpsimpact.runs.environment import collect_environment

    config.validate()
    started = time.perf_counter()
    cache = cache or OverlayCache()
    cache.check_root()
    release = judge_release(config.torch_profile)  # once, here: the columns, the job and the sentence take it
    job = probe_job(config, release)
    offline = config.offline or is_offline()  # the package index (HF_HUB_OFFLINE is about models)
    progress = progress or (lambda *_: None)
    rows = [environment_row(version, job, cache, prober, offline, progress) for version in config.transformers]
    compare_op_paths(rows)
    return MatrixReport.of({
        "release": release.to_json() | {"on_a_mac": None if release.is_installed else (
            f"On a Mac, the installed torch {release.installed.label}: its column ({column_of(release.installed)}) "
            f"below says what each release of transformers does there; --torch-profile "
            f"{release.installed.release} judges it.")},
        "schema": SCHEMA_VERSION, "kind": "matrix",
        "config": dataclasses.asdict(config) | {"batch_size": job["batch_size"], "max_length": job["max_length"]},
        "model": config.model or EMBEDDED_MODEL, "job": job, "offline": offline, "cache": str(cache.root),
        "emulated": {"profile": EMULATED_PROFILE, **TINY_RUN},
        "environment": collect_environment(), "columns": profile_columns(release.profile, release.installed),
        "rows": rows,
        "all_ok": all(r["status"] == "probed" and r["findings"]["guard_ok"] for r in rows),
        "wall_s": round(time.perf_counter() - started, 1),
    })


def column_of(profile: FaultProfile) -> str:
    """The matrix column (release group) a profile falls in."""
    from mpsimpact.engine.release import STUDY

    return profile.group if profile.source == STUDY else f"{profile.release} (file)"


def environment_row(version: str, job: dict[str, Any], cache: OverlayCache, prober: Prober, offline: bool,
                    progress: Progress) -> dict[str, Any]:
    """One release: its environment (built or cached), the probe's result and the findings, or why not."""
    row: dict[str, Any] = {"transformers": version, "timing": {}}
    try:
        progress(version, "building")
        with cache.using(version, offline=offline) as overlay:  # nobody rebuilds it while it is probed
            marker = overlay.marker
            row["cached"] = overlay.cached
            row["overlay"] = {"path": str(overlay.path), "installed": marker.get("installed", []),
                              "first_build_s": marker.get("build_s")}
            row["timing"]["build_s"] = overlay.build_s
            progress(version, "probing")
            started = time.perf_counter()
            result = prober(overlay.path, job)
            row["timing"]["probe_s"] = round(time.perf_counter() - started, 2)
        check_probe(result, version)
        row |= {"status": "probed", "probe": result, "findings": findings(result), "cells": cells(result)}
        progress(version, "done")
    except OverlayError as error:
        missing = error.fields.get("stage") == "missing"
        row |= {"status": "missing" if missing else "failed", "reason": error.message}
        progress(version, "failed")
    return row


def check_probe(result: dict[str, Any], version: str) -> None:
    """The probe ran the asked transformers over the running torch, or the row says otherwise."""
    import torch

    got = result["versions"]["transformers"]
    if got != version:
        raise OverlayError(f"the environment imports transformers {got}, not {version}", stage="probe")
    if Path(result["paths"]["torch"]).resolve() != Path(torch.__file__).resolve():
        where = result["paths"]["torch"]
        raise OverlayError(f"the environment imports torch from {where}, not the running one", stage="probe")


def _operand(spec: dict[str, Any]) -> str:
    return f"[{','.join(map(str, spec['shape']))}] ({spec['layout']})"


def _attention_ops(path: list[dict[str, Any]]) -> list[str]:
    """The op path's attention calls (bmm and SDPA, not the linear layers), as one line each: a product as its
    operands ("bmm[..] @ [..]"), any other op (a scale, a division) on its input ("div on [..]")."""
    def drawn(e: dict[str, Any]) -> str:
        if family_of(e["op"]) in PRODUCTS:
            return f"{e['op']}{_operand(e['a'])} @ {_operand(e['b'])}"
        return f"{e['op']} on {_operand(e['a'])}"

    return [f"{drawn(e)}{' in sdpa' if e['within_sdpa'] else ''} x{e['count']}"
            for e in path if e["op"] not in ("mm", "addmm")]


def findings(result: dict[str, Any]) -> dict[str, Any]:
    """What a reader wants from one release: default attention, what output_attentions runs, where eager
    goes wrong, the attention calls per implementation, and whether the guard held."""
    impls = result["implementations"]
    with_weights = impls[WITH_WEIGHTS]
    eager = impls["eager"].get("outcomes", {})
    firsts = {o["first_corrupted_text"] for o in eager.values() if o["outcome"] == "wrong"}  # not where stopped
    runs = result["emulated"]["runs"]
    return {
        "default_attention": result["default_attention"],
        "output_attentions_runs": with_weights.get("runs", with_weights.get("error")),
        "eager_first_corrupted_text": firsts.pop() if len(firsts) == 1 else None,
        "attention_ops": {name: _attention_ops(impl.get("op_path", [])) for name, impl in impls.items()},
        "guard_ok": all(run["guard_ok"] for run in runs.values()),
        "guard": {label: {"attention": run["attention"],
                          **{mode: run[mode]["status"] for mode in ("off", "raise", "chunk")}}
                  for label, run in runs.items()},
    }


def cells(result: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{attention: {profile: {outcome, message, first_corrupted_text}}} for the heatmap and tables."""
    keep = ("outcome", "message", "first_corrupted_text")
    return {name: {profile: {k: o[k] for k in keep}  # none where the implementation failed (its "error")
                   for profile, o in result["implementations"][name].get("outcomes", {}).items()}
            for name in ATTENTIONS}


def compare_op_paths(rows: list[dict[str, Any]]) -> None:
    """Marks, per attention implementation, whether a release's attention calls equal the first probed
    release's (the layouts that reach MPS are what changes the faults)."""
    probed = [r for r in rows if r["status"] == "probed"]
    for row in probed:
        ops, base = row["findings"]["attention_ops"], probed[0]["findings"]["attention_ops"]
        row["findings"]["same_ops_as"] = {name: probed[0]["transformers"] if ops[name] == base[name] else None
                                          for name in ops}
