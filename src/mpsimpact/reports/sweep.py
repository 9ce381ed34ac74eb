"""`mpsimpact sweep`'s console and files: the plan before it starts, a progress line with the time left,
the summary table and the derived profile; sweep.jsonl, families.jsonl, summary.json, profile.json and the
outcome map, written into the sweep's folder; it receives what runs.sweep_run computed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mpsimpact.config import GIB, SweepConfig
from mpsimpact.output.files import atomic_write_bytes, atomic_write_text
from mpsimpact.output.page import fitted_table

PROGRESS_EVERY_S = 5.0  # a progress line at least this far apart (and for every cell that disagrees)
FILES = ("sweep.jsonl", "families.jsonl", "summary.json", "profile.json", "outcome_map.png")


class SweepConsole:
    """What runs.sweep_run.run_sweep shows and writes on the way: the console lines and the result files."""

    def __init__(self) -> None:
        from mpsimpact.output.console import Console

        self.console, self._last_line = Console(highlight=False), 0.0

    def plan(self, mode: str, judged: str, config: SweepConfig, counts, budget: int, partial: Path,
             buffer: tuple[int, str] | None = None) -> None:
        """What the sweep will cost, before it starts: the release judged (`judged`: the sentence every command
        leads with), cells (`counts`: all, to do, run, and the bytes the largest of those holds) and memory, and
        how to resume (the time comes with the first cell: `estimate`); `buffer`: on a Mac, the cells within the
        budget that reach its largest buffer, and that buffer in words."""
        cells, todo, fits, largest = counts
        over_buffer, words = buffer or (0, "")
        resumed = f", {cells - todo} done by an earlier run (resumed)" if todo < cells else ""
        self.console.print(judged, markup=False)
        self.console.print(f"{mode}, at a {config.index_bits}-bit index: {cells} cells{resumed}.", markup=False)
        self.console.print(f"To run: {fits} cells, the largest holding {largest / GIB:.3g} GiB; "
                           f"{todo - fits - over_buffer} cells need more than the {budget / GIB:.3g} GiB "
                           "budget (--max-memory) and are not run (unmeasured).")
        if buffer:
            self.console.print(f"{over_buffer} cells hold a tensor that reaches {words}: MPS refuses it "
                               "('Invalid buffer size'), so they are not run (unmeasured).")
        self.console.print(f"Killed or interrupted? Finished cells are kept in {partial}/: "
                           f"{_resume_hint(config, partial.parent / partial.name[1:].removesuffix('.partial'))}.")

    def estimate(self, name: str, took: float, total: float) -> None:
        """The first estimate of the whole sweep's time, once its first cell has run (`took` seconds)."""
        spent = f"{took:.2g} s" if took < 10 else _duration(took)
        self.console.print(f"The first cell ({name}) took {spent}: the sweep needs about "
                           f"{_duration(total)} in all (estimated from it and the other cells' sizes, refined as "
                           "cells finish).", markup=False)

    def cell(self, count: tuple[int, int], name: str, row: dict[str, Any], elapsed: float, left: float) -> None:
        """A progress line every few seconds, for every cell that disagrees, and for the last."""
        number, total = count
        if elapsed - self._last_line >= PROGRESS_EVERY_S or row["agree"] is False or number == total:
            verdict = {True: "agrees", False: "DISAGREES", None: row.get("message") or "not run"}[row["agree"]]
            self.console.print(f"[{number}/{total}] {name}: {row['observed']}, {verdict}; "
                               f"{_duration(elapsed)} elapsed, about {_duration(left)} left")
            self._last_line = elapsed

    def interrupted(self, kept: int, cells: int, partial: Path, config: SweepConfig, out: Path) -> None:
        self.console.print(f"Interrupted: {kept} of {cells} cells are kept in {partial}/; "
                           f"{_resume_hint(config, out)}.")

    def write(self, folder: Path, rows_and_families, derived: dict[str, Any], figure: bytes, summary: Any) -> None:
        """sweep.jsonl and families.jsonl (in grid order), profile.json, outcome_map.png and summary.json."""
        for name, items in zip(("sweep.jsonl", "families.jsonl"), rows_and_families):
            atomic_write_text(folder / name, "".join(json.dumps(r) + "\n" for r in items))
        atomic_write_text(folder / "profile.json", json.dumps(derived, indent=2) + "\n")
        atomic_write_bytes(folder / "outcome_map.png", figure)
        atomic_write_text(folder / "summary.json", json.dumps(summary.to_json(), indent=2) + "\n")  # a SweepSummary

    def summary(self, summary: dict[str, Any], out: Path, cached: Path) -> None:
        """The tables by observed class and by layout, the family cells, the files and the profile."""
        for key, by in (("by_class", "observed class"), ("by_layout", "layout")):
            rows = [[name, *counts] for name, counts in sorted(summary[key].items())]
            self.console.print(fitted_table(f"agreement with the fault model, by {by}",
                                            (by, "agree", "disagree", "skipped"), rows))
        disagree = summary["disagree"]
        verdict = "[green]every cell agrees[/]" if not disagree else f"[red]{disagree} cells disagree[/]"
        not_run = _not_run_words(summary["not_run"], summary["not_run_why"])
        self.console.print(f"{summary['mode']}: {summary['cells']} bmm cells, {verdict}{not_run}.")
        if summary.get("largest_buffer"):
            self.console.print(f"Cells were planned within {summary['largest_buffer']['words']}.")
        print_families(self.console, summary["families"])
        self.console.print(f"Written to {out}/ ({', '.join(FILES)}).", markup=False)
        print_profile(self.console, summary["derived_profile"], out, cached)


def _resume_hint(config: SweepConfig, out: Path) -> str:
    again = "run the same command again" + ("" if config.out else f" with --out {out}")
    return f"{again} to finish the sweep"


def _not_run_words(count: int, why: dict[str, int]) -> str:
    """", 3 not run (over --max-memory: unmeasured)", each reason counted where there are several; "" for
    none."""
    if not count:
        return ""
    reasons = next(iter(why)) if len(why) == 1 else ", ".join(f"{n} {words}" for words, n in why.items())
    return f", {count} not run ({reasons}: unmeasured)"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def print_families(console, families: dict[str, Any]) -> None:
    """The family cells: what each ran, what it decides, what it showed and the code it gives."""
    verdicts = {True: "agrees", False: "DISAGREES", None: "not run (unmeasured)"}
    rows = [[t["test"], t["decides"], t["observed"], t["code"] or "-", verdicts[agree]]
            for t, agree in zip(families["table"], families["agree"])]
    console.print(fitted_table("op-family cells (the study's tests of other ops, one shape each, scaled)",
                               ("cell", "decides", "observed", "code", "fault model"), rows))
    disagree, not_run = families["disagree"], families["not_run"]
    verdict = "[green]every one agrees[/]" if not disagree else f"[red]{disagree} disagree[/]"
    not_run_words = _not_run_words(not_run, families["not_run_why"])
    console.print(f"{families['cells']} family cells, {verdict}{not_run_words}.")


def print_profile(console, derived: dict[str, Any], out: Path, cached: Path) -> None:
    """What profile.json says, and how to use and share it (`cached`: where every command finds it)."""
    cells, release = derived["cells"], derived["release"]
    settings = cells["settings_agreeing"]
    decided = ("the bmm rules decided" if settings == 1 else
               f"{settings} settings of the bmm rules agree (calls they differ on are judged by the worst)"
               if settings else "no setting of the bmm rules agrees: bmm judged conservatively")
    families = (f" and {cells['family_cells'] - cells['family_cells_not_run']} family cells"
                if cells.get("family_cells") else "")
    console.print(f"profile.json (torch {release}): {decided}, from {cells['measured']} measured bmm cells{families}; "
                  f"judged conservatively: {', '.join(derived['unmeasured']) or 'nothing'}.")
    if derived["measured_on"]["emulated"]:
        console.print(f"Use it with --torch-profile {out}/profile.json (emulated: it reproduces the rules it "
                      "emulated; it measured no Mac).")
        return
    console.print(f"Use it with --torch-profile {out}/profile.json; for every command under torch {release} "
                  f"on this machine, copy it to {cached}; to share it, send the file.")
