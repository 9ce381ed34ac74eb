"""A release profile derived from a sweep's rows (profile.json, engine.profile_file's format): every setting of
the bmm rules that agrees with each measured cell (`Cell.judge`), the first failures as the study's table gives
them, each failure's text, and what it did not measure (judged conservatively). Cells not run decide nothing."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from mpsimpact.engine.faults import TensorSpec, classify_bmm
from mpsimpact.engine.profile_file import ASPECTS, BMM_CHOICES, BMM_FIELDS, PROFILE_KIND, PROFILE_SCHEMA
from mpsimpact.engine.release import (
    INT_MAX_MESSAGE, INT_MAX_MESSAGE_TYPO, MASKED_FILL_MESSAGE, MULTI_DIMENSION_ROWS, ONE_DIMENSION_ROWS,
    SUM_64_BIT_MESSAGE, FaultProfile, bmm_failure_texts, release_name,
)
from mpsimpact.runs.family_cells import TESTS_BY_NAME
from mpsimpact.output.page import cell_name
from mpsimpact.runs.cell import is_measured, not_run_counts
from mpsimpact.runs.sweep import Cell

NOT_MEASURED_NOTE = (
    "The sweep measures bmm around every threshold, and each op family once above 2**index_bits elements "
    "(the study's first-pass tests, scaled): a family's row between 2**(index_bits - 1) and 2**index_bits "
    "elements, the 1-D softmax, copy and random rows, multi-dimensional indexing, a 2-D mm whose output "
    "passes 2**index_bits, SDPA with gradients and every backward product are not measured: they follow "
    "the measured row or stay 'unmeasured' (conservative), as in the study's table.")
BMM_ONLY_NOTE = ("These rows hold bmm cells only (a sweep without family cells): 2-D mm/addmm/Linear, fused "
                 "SDPA and the op families past INT_MAX are judged as the conservative profile judges them.")
_UNEXPLAINED_SHOWN = 20


def failure_text(row: dict[str, Any]) -> str | None:
    """The text MPS printed for a cell that raised or aborted: a text the study knows when the observed
    message holds one (an emulated message wraps it), else the message itself; None if none."""
    message = row.get("message")
    if row["observed"] not in ("error", "abort", "crash") or not message:
        return None
    return next((text for text in bmm_failure_texts() if text in message), message)


def candidate_settings(texts: Iterable[str]) -> list[dict[str, Any]]:
    """Every setting of the bmm fields worth trying; the messages are the observed error texts (or, when no
    cell raised, the study's spellings). Fields a view rule ignores keep one value, so that two settings
    always differ in something a call can show."""
    observed = sorted(set(texts))
    raise_texts = observed or [INT_MAX_MESSAGE, INT_MAX_MESSAGE_TYPO]
    settings = []
    for output_rule, view_rule, input_wrap in itertools.product(
            BMM_CHOICES["output_rule"], BMM_CHOICES["view_rule"], (True, False)):
        base = {"output_rule": output_rule, "view_rule": view_rule, "input_wrap": input_wrap,
                "view_message": INT_MAX_MESSAGE, "limit_message": "", "slice_extent": False}
        extents = (False, True) if view_rule in ("raise", "abort") else (False,)
        if view_rule == "raise":
            texts = [("view_message", t) for t in raise_texts]
        else:
            texts = [("limit_message", t) for t in (observed or [""] if view_rule == "abort" else [""])]
        for extent, (field, text) in itertools.product(extents, texts):
            settings.append(base | {"slice_extent": extent, field: text})
    return settings


def disagreeing(rows: list[tuple[dict[str, Any], TensorSpec, TensorSpec]], setting: dict[str, Any],
                release: str) -> list[dict[str, Any]]:
    """The measured rows (each with its cell's operand specs) a setting's predictions disagree with."""
    profile = FaultProfile(release, release, True, **setting)
    return [row for row, a, b in rows if not Cell.judge(
        row | {"expected": classify_bmm(a, b, index_bits=row["index_bits"], profile=profile).to_json()})]


def fit_bmm(rows: list[dict[str, Any]], release: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(every setting that agrees with every measured row, in BMM_FIELDS order; the rows the closest
    setting disagrees with when none agrees)."""
    measured = [(row, *Cell(**row["cell"]).specs()) for row in rows if is_measured(row)]  # specs once, not per setting
    if not measured:
        return [], []
    texts = (text for row, _, _ in measured if row["observed"] == "error" and (text := failure_text(row)))
    scored = [(setting, disagreeing(measured, setting, release)) for setting in candidate_settings(texts)]
    fitting = [{name: setting[name] for name in BMM_FIELDS} for setting, bad in scored if not bad]
    closest = min(scored, key=lambda pair: len(pair[1]))[1] if not fitting else []
    return fitting, closest


def first_failures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per series (M x K x N), dtype and layout, as the study's table: the batch from which each observed
    kind holds (ok before the first), over the measured batches; the batches not measured, apart."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        cell = row["cell"]
        key = (f"{cell['m']}x{cell['k']}x{cell['n']}", cell["dtype"], cell["layout"])
        groups.setdefault(key, []).append(row)
    table = []
    for (series, dtype, layout), found in sorted(groups.items()):
        found.sort(key=lambda r: r["cell"]["batch"])
        transitions, previous = [], ("ok", None)
        for row in filter(is_measured, found):
            kind = "abort" if row["observed"] == "crash" else row["observed"]
            now = (kind, row.get("first_bad_batch") if kind == "wrong_tail" else None)
            if now != previous:
                step = {"batch": row["cell"]["batch"], "kind": kind}
                transitions.append(step | ({"first_bad_batch": now[1]} if now[1] is not None else {}))
            previous = now
        unmeasured = [r["cell"]["batch"] for r in found if not is_measured(r)]
        table.append({"series": series, "dtype": dtype, "layout": layout, "transitions": transitions,
                      "batches": [r["cell"]["batch"] for r in found], "unmeasured_batches": unmeasured})
    return table


def failure_texts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each distinct text MPS printed, with its kind and how many cells printed it."""
    counts = Counter(("abort" if row["observed"] == "crash" else row["observed"], text)
                     for row in rows if (text := failure_text(row)) is not None)
    return [{"kind": kind, "text": text, "cells": n} for (kind, text), n in sorted(counts.items())]


# The families a profile's rules hold, as the study's tables hold them (engine.release): a family without a
# cell for a dimension keeps "unmeasured" there.
FAMILY_NAMES = tuple(sorted(ONE_DIMENSION_ROWS.keys() | MULTI_DIMENSION_ROWS.keys()))
# A family's own error texts (engine.release), each its own code; any other error is the INT_MAX one.
_OWN_ERRORS = ((SUM_64_BIT_MESSAGE.split(" (")[0], "sum-64-bit"),
               (MASKED_FILL_MESSAGE.split(" of more")[0], "masked-fill-numel"))


def family_code(row: dict[str, Any]) -> str:
    """The engine.profile_file.FAMILY_CODES code a measured family cell gives its row: what it observed above
    2**index_bits elements, in the words of Note [Op families past INT_MAX] (an abort of a multi-dimensional
    tensor is "int32-kernel", measured above LIMIT only; wrong values of a multi-dimensional cat are
    "int32-offsets"; an emulated call nobody measured stays "unmeasured")."""
    test, seen = TESTS_BY_NAME[row["cell"]["test"]], row["observed"]
    if seen == "error":
        return next((code for text, code in _OWN_ERRORS if text in (row.get("message") or "")), "error")
    if seen in ("abort", "crash"):
        return "abort" if test.one_d else "int32-kernel"
    if seen == "wrong_other" and "unmeasured:" in (row.get("rule") or ""):
        return "unmeasured"
    if seen in ("wrong", "wrong_other"):
        return "int32-offsets" if test.family == "cat" and not test.one_d else "wrong"
    return seen  # ok, wrap


def fit_families(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rules of the aspects the family cells measured: {"families": {family: [1-D code, multi code]},
    "mm": {"mm_aborts": ...}, "sdpa": {...}}, each None when its cells were not measured (or, for mm and
    sdpa, showed something the rules cannot say)."""
    measured = [row for row in rows if is_measured(row)]
    codes = {name: ["unmeasured", "unmeasured"] for name in FAMILY_NAMES}
    found: dict[str, Any] = {"families": None, "mm": None, "sdpa": None}
    for row in measured:
        test, seen = TESTS_BY_NAME[row["cell"]["test"]], row["observed"]
        if test.aspect == "families":
            codes[test.family][0 if test.one_d else 1] = family_code(row)
            found["families"] = codes
        elif test.aspect == "mm" and seen in ("ok", "abort", "crash"):
            found["mm"] = {"mm_aborts": seen != "ok"}
        elif test.aspect == "sdpa":
            found["sdpa"] = _sdpa_rules(row)
    return found


def _sdpa_rules(row: dict[str, Any]) -> dict[str, bool] | None:
    """MPS's own SDPA op (the fused path) and whether it is wrong above 2**index_bits score elements; None
    for a fused call that stopped (the rules have no word for it)."""
    if row.get("sdpa_path") != "fused":
        return {"sdpa_fused": False, "sdpa_fused_wrong": False}  # the math path: the bmm rules decide
    if row["observed"] == "ok":
        return {"sdpa_fused": True, "sdpa_fused_wrong": False}
    if row["observed"] in ("wrong", "wrong_other") and "unmeasured:" not in (row.get("rule") or ""):
        return {"sdpa_fused": True, "sdpa_fused_wrong": True}
    return None


def family_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per family cell: what it ran, what it decides, what it observed and the code that gives (None for a
    cell not run: its rule stays unmeasured)."""
    table = []
    for row in rows:
        test = TESTS_BY_NAME[row["cell"]["test"]]
        code = family_code(row) if test.aspect == "families" and is_measured(row) else None
        table.append({"test": test.name, "runs": test.text, "decides": test.slot, "observed": row["observed"],
                      "code": code, "message": row.get("message"), "max_rel_error": row.get("max_rel_error")})
    return table


def profile_release(emulated: bool, emulated_release: str, torch_version: str) -> str:
    """The release a sweep measured: the one it emulated, or the installed torch's ("2.15.0"; a pre-release or a
    development build named as such: engine.release.release_name)."""
    for candidate in ((emulated_release, torch_version) if emulated else (torch_version,)):
        name = release_name(candidate)
        if name is not None:
            return name
    return "0.0.0"


def derive_profile(rows: list[dict[str, Any]], *, device: str, emulated: bool, emulated_release: str,
                   torch_version: str, machine: str, index_bits: int, max_memory: int | None = None,
                   mpsimpact_version: str = "", family_rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """profile.json's content from a sweep's rows (see the module docstring).

    Args:
        rows: the sweep's rows, measured or not (a row not measured decides nothing).
        device, emulated, emulated_release: where the cells ran, and the release whose rules an
            emulated sweep applied (its FaultProfile.release).
        torch_version, machine: what it was measured on (runs.device.machine_name: macOS and chip).
        index_bits, max_memory: the sweep's index width and memory budget in bytes (None: not limited).
        family_rows: the rows of its family cells (runs.family_cells); None or empty: mm, sdpa and the
            families stay null (judged conservatively).
    """
    release = profile_release(emulated, emulated_release, torch_version)
    control = not emulated and device != "mps"
    # A control device computes every cell right, which would read as a release that fixed everything.
    settings, unexplained = ([], []) if control else fit_bmm(rows, release)
    skipped = [row for row in rows if not is_measured(row)]
    family_rows = family_rows or []
    others = dict.fromkeys(("mm", "sdpa", "families")) if control else fit_families(family_rows)
    family_skipped = [row for row in family_rows if not is_measured(row)]
    notes = [NOT_MEASURED_NOTE if family_rows else BMM_ONLY_NOTE]
    if control:
        notes.append(f"A control run on {device} (no emulation) measures nothing of MPS: every rule is "
                     "judged conservatively.")
    if skipped:
        why = " or ".join(not_run_counts(skipped))
        notes.append(f"{len(skipped)} of {len(rows)} cells were not run ({why}) and decide "
                     "nothing: where the settings they would have chosen between differ, calls are judged by "
                     "the worst of them.")
    if family_skipped:
        names, why = ", ".join(row["name"] for row in family_skipped), " or ".join(not_run_counts(family_skipped))
        notes.append(f"Family cells not run ({why}): {names}; what they decide is "
                     "'unmeasured' (conservative).")
    if not settings and not control and len(skipped) < len(rows):
        notes.append("No setting of the bmm rules agrees with every measured cell (see cells.unexplained): "
                     "bmm is judged conservatively. Report the cells upstream and to mpsimpact.")
    rules: dict[str, Any] = {aspect: None for aspect in ASPECTS} | others | {"bmm": settings or None}
    return {
        "kind": PROFILE_KIND, "schema_version": PROFILE_SCHEMA, "release": release,
        "measured_on": {
            "torch": torch_version, "machine": machine, "device": device, "emulated": emulated,
            "emulated_release": emulated_release if emulated else None, "index_bits": index_bits,
            "date": time.strftime("%Y-%m-%d"), "max_memory_bytes": max_memory, "mpsimpact": mpsimpact_version,
        },
        "rules": rules,
        "unmeasured": [aspect for aspect in ASPECTS if not rules[aspect]],
        "cells": {"total": len(rows), "measured": len(rows) - len(skipped), "not_run": len(skipped),
                  "family_cells": len(family_rows), "family_cells_not_run": len(family_skipped),
                  "settings_agreeing": len(settings),
                  "unexplained": [f"{cell_name(row['cell'])}: observed {row['observed']}"
                                  for row in unexplained[:_UNEXPLAINED_SHOWN]]},
        "table": first_failures(rows),
        "family_cells": family_table(family_rows),
        "failure_texts": failure_texts(rows + family_rows),
        "notes": notes,
    }

