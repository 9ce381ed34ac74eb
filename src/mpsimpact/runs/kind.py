"""The kind of run a scenario asks for (classify, train, embed): one object that runs the conditions
and answers for its report's columns, corrupted test, figures, extra files, markdown and console lines.
The runner, the report writer and the CLI ask the kind (runs.kinds finds it by name); none branches on it."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

from mpsimpact.config import DEFAULT_ATTENTION, HALF_THRESHOLD, RUN_ATTENTIONS
from mpsimpact.engine.faults import MPS_INDEX_BITS, STOP_KINDS
from mpsimpact.errors import UsageError
from mpsimpact.engine.release import torch_words
from mpsimpact.output.page import (
    EMULATED_LABEL, STATUS_WORDS, Footnotes, fitted_table, format_cell, guard_cell, without_rule_names,
)

# report.json's schema: what readers (compare, CI scripts, notebooks) may rely on. 2 adds "columns"
# (the conditions table's keys and titles); every schema-1 field keeps its name, place and meaning.
SCHEMA_VERSION = 2
# The `run` options (RunConfig fields) that some kinds read and others do not: each kind names those it reads
# (RunKind.reads); given to a kind that does not read it, one is refused in one line saying why (RunKind.check).
KIND_OPTIONS = ("steps", "lr", "threshold", "reference_device", "dataset")
# compare's titles for report.json's columns, as the run's console and reports title them (its "wrong" column
# counts what report.json calls corrupted_count; "first wrong" its first_corrupted_index).
COMPARED_TITLES = {"corrupted_count": "wrong", "first_corrupted_index": "first wrong"}
# The columns a kind that judges one device pass per condition (classify, embed) leads with.
PASS_COLUMNS = (("guard", "guard"), ("status", "status"), ("corrupted_count", "corrupted"),
                ("corrupted_fraction", "fraction"), ("first_corrupted_index", "first corrupted"),
                ("predicted_first_corrupted_index", "predicted first"))


class RunKind(abc.ABC):
    """What varies between kinds of run. Subclasses set the class fields and implement `run`."""

    name: ClassVar[str]  # the report's "kind" field
    backward: ClassVar[bool] = False  # whether the plan traces (and memory is checked for) a backward pass
    columns: ClassVar[tuple[tuple[str, str], ...]]  # (condition key, title) of the conditions table
    files: ClassVar[tuple[str, ...]]  # what a run folder holds, for the console's last line
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    attentions: ClassVar[tuple[str, ...]] = RUN_ATTENTIONS
    counts: ClassVar[tuple[str, ...]] = ("corrupted_count",)  # a condition's counts of at most the batch
    fractions: ClassVar[tuple[str, ...]] = ("corrupted_fraction",)  # a condition's numbers between 0 and 1
    # Condition fields that say what a run cost or predicted rather than what it did: compare leaves them out.
    uncompared: ClassVar[tuple[str, ...]] = ("guard", "wall_s", "corrupted_fraction",
                                             "predicted_first_corrupted_index")
    position_files: ClassVar[tuple[str, ...]] = ()  # files of each condition's corrupted positions, first found read
    # How the console writes a condition's numbers (report.md keeps format_cell's).
    console_formats: ClassVar[dict[str, str]] = {"wall_s": "{:.1f}s", "corrupted_fraction": "{:.1%}"}
    console_header: ClassVar[tuple[str, ...]]  # the console table's column titles

    # Of KIND_OPTIONS, those this kind reads, and why it does not read each other one (words after "it").
    reads: ClassVar[frozenset[str]] = frozenset()
    not_read: ClassVar[dict[str, str]] = {}

    def check(self, config: Any, given: Any = None) -> None:
        """Refuses, before anything is loaded, the options this kind does not support: an option of
        KIND_OPTIONS it does not read (`given`: the config's fields the command line gave; None: those that
        differ from the config's defaults), an attention or a dtype it does not run, and a --threshold below
        what half precision is judged at (config.HALF_THRESHOLD: the run would judge at that floor instead)."""
        defaults = {field.name: field.default for field in dataclasses.fields(config)}
        asked = {name for name in KIND_OPTIONS
                 if (name in given if given is not None else getattr(config, name) != defaults[name])}
        for name in KIND_OPTIONS:
            if name in asked and name not in self.reads:
                flag = "--" + name.replace("_", "-")
                why = self.not_read.get(name, "its kind of run does not read it")
                raise UsageError(f"run {config.scenario} does not use {flag}: {why}; drop {flag}.", option=flag)
        if config.attention not in self.attentions or config.dtype not in self.dtypes:
            raise UsageError(f"run {config.scenario} supports --attention {' or '.join(self.attentions)} and "
                             f"--dtype {' or '.join(self.dtypes)} only; `{config.plan_command('--versions')}` "
                             "predicts sdpa.")
        if "threshold" in asked and config.dtype != "float32" and config.threshold < HALF_THRESHOLD:
            raise UsageError(f"--threshold {config.threshold:g} is below the {HALF_THRESHOLD:g} a {config.dtype} run "
                             "is judged at (kernel-order rounding keeps clean texts below it, not below less): give "
                             f"--threshold {HALF_THRESHOLD:g} or more, or drop it.", option="--threshold")

    @abc.abstractmethod
    def run(self, config: Any, scenario: Any, model: Any, geometry: Any, sections: dict,
            progress) -> tuple[dict, dict]:
        """Every condition against the reference (`sections`: each attention's fault plan and prediction,
        outcome.PredictionSection); returns (report body with "conditions", "repeated_texts", "tokens" and
        "reference"; arrays for figures and files)."""

    def figures(self, report: dict, arrays: dict) -> dict[str, bytes]:
        """PNG figures by file name."""
        return {}

    def extra_files(self, report: dict, arrays: dict) -> dict[str, bytes]:
        """Files beside report.json/.md/.html and the figures, by name."""
        return {}

    def markdown_lines(self, report: dict) -> list[str]:
        """Kind-specific bullet lines ("- ...") for report.md and report.html, after the conditions'."""
        return []

    def condition_lines(self, condition: dict) -> list[str]:
        """Kind-specific bullet lines about one condition, before its message's."""
        return []

    def corrupted_parts(self, condition: dict) -> list[str]:
        """What a completed condition got wrong, counted ("683 texts"); empty when nothing."""
        count = condition.get("corrupted_count") or 0
        return [f"{count} texts"] if count else []

    def is_corrupted(self, condition: dict) -> bool:
        """Whether a completed condition got anything wrong (the kind's corrupted test)."""
        return bool(self.corrupted_parts(condition))

    def headline(self, report: dict, plain: bool = False) -> str:
        """The run in one plain sentence for a slide: was the damage silent, and how much of it (led by
        the emulated label when no Apple GPU was used). `plain` (the console, report.md, report.html): a
        stop in words and without the rules' names, which the condition's own line below keeps."""
        sentence = self._headline(report, plain)
        return f"{EMULATED_LABEL}. {sentence}" if report["geometry"].get("emulated") else sentence

    def _headline(self, report: dict, plain: bool = False) -> str:
        off = next((c for c in report["conditions"] if c["guard"] == "off"), None)
        if off is None:
            return "No unguarded condition ran: see the guarded conditions below."
        release = report.get("release") or {}
        unmeasured = release.get("measured") is False
        if off["status"] != "completed":
            stopped = self._not_completed(off, release.get("release") or report["geometry"].get("profile"), plain,
                                          report.get("mac"))
            return self._wrong_before(off, report["geometry"]["batch_size"], stopped)
        if not self.is_corrupted(off):
            return "Clean: without a guard every output matches the reference (nothing crossed a limit)."
        if off.get("non_finite_count"):
            return f"Not silent: {off['non_finite_count']} outputs came back NaN or infinite."
        what, then = self.damage(report, off)
        said = f"{what}, no error, no warning, no NaN" + (f"; {then}" if then else "")
        if unmeasured:  # the values are the worst a measured release gives: a guess, and said to be one
            return (f"Cannot tell: nobody measured torch {release['release']} on MPS. If it behaves as the "
                    f"worst measured release does: {said}. `mpsimpact sweep` on a Mac measures it.")
        return f"Silent: {said}."

    @staticmethod
    def _wrong_before(off: dict, batch: int, stopped: str) -> str:
        """A stop's headline, led by the outputs already silently wrong before it (a training step's logits
        before its backward raises): every wrong output counted."""
        wrong = off.get("corrupted_count") or 0
        if not wrong or not stopped.startswith("Not silent: "):
            return stopped
        then = stopped.removeprefix("Not silent: ")
        then = then if then[1:2].isupper() else f"{then[0].lower()}{then[1:]}"  # "MPS raises" stays as it is
        return (f"Silent, then stopped: {wrong} of {batch} outputs came back wrong with no error, no warning; "
                f"then {then}")

    def _not_completed(self, off: dict, release: str, plain: bool, mac: dict | None = None) -> str:
        """Without a guard the run did not complete: a crash (which op; the process would die), MPS's own
        error, the Mac's refusal of a tensor past its largest buffer, or values nobody can tell (never "not
        silent" for what nobody measured)."""
        where = off.get("where")
        message = without_rule_names(str(off.get("message"))) if plain else off.get("message")
        if off.get("buffer_refused"):
            on = f"{mac['label']} (largest buffer {mac['largest_buffer_gib']:g} GiB)" if mac else "this Mac"
            return (f"Not silent: on {on} MPS cannot allocate {where} and stops with '{off['buffer_refused']}' "
                    "before any wrong value; no guard changes that.")
        if where is None:  # a report from before "where": the message, as it was
            return f"Not silent: without a guard the run did not complete ({status_words(off)}: {message})."
        if off.get("unmeasured"):
            return (f"Cannot tell: nobody measured torch {release} on MPS at {where}, so nobody can tell what "
                    "it does there; `mpsimpact sweep` on a Mac measures it.")
        if off["status"] == "not_emulated":
            return (f"Silent on MPS, but not shown: torch {release} returns wrong values at {where}, which "
                    "nobody characterised, so the emulator does not invent them.")
        if stop_kind(off) == "abort" or off["status"] == "skipped_predicted_abort":
            return f"Not silent: the process would die at {where}: torch {release} aborts there, no result at all."
        stop = off.get("stop")
        if plain and stop and stop.get("by") == "mps" and stop.get("torch_text"):  # torch's text, not the call's
            phase = " in backward" if stop.get("phase") == "backward" and "backward" not in where else ""
            return f"Not silent: MPS raises an error at {where}{phase}, {torch_words(stop['torch_text'])}."
        return f"Not silent: MPS raises an error at {where} ({message})."

    def figure_line(self, report: dict) -> str:
        """The headline's verdict in a figure's few words: "guard off: 6 of 16 outputs wrong, no error",
        "guard off: the process would die", "guard off: cannot tell (nobody measured torch 2.15.0)"."""
        off = next((c for c in report["conditions"] if c["guard"] == "off"), None)
        release = report.get("release") or {}
        if off is None:
            return "no unguarded condition"
        if off.get("unmeasured") or (release.get("measured") is False and off["status"] == "completed"):
            return f"guard off: cannot tell (nobody measured torch {release.get('release', '?')} on MPS)"
        if off["status"] == "not_emulated":
            return "guard off: wrong on MPS, not shown (values nobody characterised)"
        if off["status"] != "completed":
            dies = stop_kind(off) == "abort" or off["status"] == "skipped_predicted_abort"
            return "guard off: the process would die" + (f" at {off['where']}" if off.get("where") else "") \
                if dies else "guard off: MPS raises an error"
        what = self.damage(report, off)[0]
        return f"guard off, silent: {what}" if self.is_corrupted(off) else "guard off: clean"

    def damage(self, report: dict, off: dict) -> tuple[str, str]:
        """What went wrong without a guard ("N of M outputs came back wrong"), and what it did to the task
        ("K predictions changed class"; "" for nothing more): the kind's words."""
        return f"{off.get('corrupted_count')} of {report['geometry']['batch_size']} outputs came back wrong", ""

    def console_table(self, report: dict, footnotes: Footnotes, verbose: bool = False):
        """The console's conditions table (output.page.FittedTable): the kind's header, one `console_row`
        per condition, a condition's message as a footnote of its status."""
        g = report["geometry"]
        title = f"{report['config']['scenario']}: batch {g['batch_size']}, max length {g['max_length']}"
        rows = [self.console_row(c, footnotes, verbose) for c in report["conditions"]]
        return fitted_table(self.console_title(report, title), self.console_header, rows, justify="right")

    def console_title(self, report: dict, title: str) -> str:
        """The console table's title, from the common one (scenario, batch, length)."""
        return title

    @abc.abstractmethod
    def console_row(self, condition: dict, footnotes: Footnotes, verbose: bool) -> list[str]:
        """One condition's cells under `console_header`."""

    def console_lines(self, report: dict, verbose: bool = False) -> list[str]:
        """Lines printed under the table and its footnotes (before the notes)."""
        return []

    def guard_lines(self, report: dict) -> list[str]:
        """One plain line per guarded condition: what the guard did ("guard raise: stopped before any wrong value,
        at ..."; "guard chunk: 0 wrong, every output matches the reference")."""
        return [self.guard_line(c) for c in report["conditions"] if c["guard"] != "off"]

    def guard_line(self, condition: dict) -> str:
        c = condition
        name = f"guard {c['guard']}" + (f" ({c['attention']} attention)" if c.get("attention", "eager") != "eager"
                                        else "")
        where = f", at {c['where']}" if c.get("where") else ""
        if c["status"] == "stopped_by_guard":
            return f"{name}: stopped before any wrong value{where}."
        if c.get("buffer_refused"):
            return f"{name}: cannot help: MPS refuses the allocation ('{c['buffer_refused']}'){where}."
        if c["status"] != "completed":
            return f"{name}: did not complete ({status_words(c)}){where}."
        wrong = self.corrupted_parts(c)
        return f"{name}: {', '.join(wrong)} wrong." if wrong else f"{name}: 0 wrong, every output matches the reference."

    def console_cell(self, condition: dict, key: str) -> str:
        """One cell of the console's conditions table, in the kind's format for that key."""
        value = condition.get(key, "eager" if key == "attention" else None)
        form = self.console_formats.get(key)
        return form.format(value) if form and value is not None else format_cell(value)

    def table_columns(self, run: dict) -> tuple[tuple[str, str], ...]:
        """The conditions table's (key, title) pairs, as report.json records them (schema 2); for a
        schema-1 report and a report being made, the kind's, led by the attention when it varies."""
        if "columns" in run:
            return tuple((key, title) for key, title in run["columns"])
        if any("attention" in c for c in run["conditions"]):  # --attention sdpa or both
            return (("attention", "attention"), *self.columns)
        return self.columns

    def compared_columns(self, run: dict) -> list[tuple[str, str]]:
        """The conditions table's (key, title) pairs that compare puts old beside new, titled in the console's words
        ("wrong", "first wrong": COMPARED_TITLES) where report.json's columns name them otherwise."""
        return [(key, COMPARED_TITLES.get(key, title)) for key, title in self.table_columns(run)
                if key not in self.uncompared]

    def corrupted_positions(self, run: dict, files: Any) -> tuple[str | None, dict[str, frozenset[int]]]:
        """Each condition's exact corrupted positions by its condition_key, from the first of `position_files`
        the folder holds, and that file's name ((None, {}) for none). `files` reads the folder's files within
        bounds and words their damage (upgrade.folders.FolderFiles)."""
        name = next((name for name in self.position_files if files.has(name)), None)
        return name, {} if name is None else self.read_positions(name, run, files)

    def read_positions(self, name: str, run: dict, files: Any) -> dict[str, frozenset[int]]:
        """samples.jsonl's positions (the one-pass kinds write it alike: a line per text and condition)."""
        texts: dict[str, set[int]] = {}
        corrupted: dict[str, set[int]] = {}
        for number, sample in enumerate(files.rows(name), 1):
            if not (isinstance(sample, dict) and isinstance(sample.get("guard"), str)
                    and type(sample.get("position")) is int and sample["position"] >= 0
                    and type(sample.get("corrupted")) is bool):
                raise UsageError(f"'{files.path / name}' is not an mpsimpact samples file (line {number} has no "
                                 "guard, position or corrupted flag).")
            key, position = condition_key(sample.get("attention"), sample["guard"]), sample["position"]
            if position in texts.setdefault(key, set()):
                raise files.damaged(name, f"line {number} repeats position {position} of guard {key}")
            texts[key].add(position)
            corrupted.setdefault(key, set()).update([position] if sample["corrupted"] else [])
        if not texts:
            raise files.damaged(name, "it holds no texts")
        batch, statuses = run["geometry"]["batch_size"], {condition_key(c.get("attention"), c["guard"]): c["status"]
                                                           for c in run["conditions"]}
        for key, seen in texts.items():  # a line per text of each completed condition: none cut, none added
            if statuses.get(key) == "completed" and seen != set(range(batch)):
                raise files.damaged(name, f"guard {key} holds {len(seen)} of the batch's {batch} texts")
        return {key: frozenset(found) for key, found in corrupted.items()}


def condition_key(attention: str | None, guard_mode: str) -> str:
    """A condition's one name, in arrays, figures, samples and comparisons: the guard alone for eager attention
    (as always; None: eager), else "sdpa-raise"."""
    return guard_mode if not attention or attention == DEFAULT_ATTENTION else f"{attention}-{guard_mode}"


def stopped_in(condition: dict) -> str:
    """" in backward" for a condition that stopped in a training step's backward pass; "" where none says."""
    return f" in {condition['phase']}" if condition.get("phase") else ""


def pass_cells(condition: dict, footnotes: Footnotes, verbose: bool = False) -> list[str]:
    """The console cells a one-pass kind (classify, embed) leads with: guard, status, wrong (fraction),
    first wrong (the plan's prediction)."""
    c, done = condition, condition["status"] == "completed"
    first, predicted = c.get("first_corrupted_index"), c.get("predicted_first_corrupted_index")
    return [guard_cell(c), status_cell(c, footnotes, verbose),
            f"{c['corrupted_count']} ({c['corrupted_fraction']:.1%})" if done else "-",
            f"{'none' if first is None else first} ({'none' if predicted is None else predicted})" if done else "-"]


def stop_kind(condition: dict) -> str | None:
    """How MPS stopped an unguarded condition, "error" or "abort", from the emulated stop (the emulator
    raises where MPS aborts); None when nothing recorded says."""
    kinds = [call["fault"]["kind"] for call in condition.get("altered_calls") or []]
    return next((kind for kind in reversed(kinds) if kind in STOP_KINDS), None)


def status_words(condition: dict) -> str:
    """A condition's status in plain words ("abort" for an emulated abort, "stopped by the guard")."""
    status = condition["status"]
    if status == "error" and stop_kind(condition) == "abort":
        return "abort"
    return STATUS_WORDS.get(status, status.replace("_", " "))


def status_cell(condition: dict, footnotes: Footnotes, verbose: bool = False) -> str:
    """The status cell: its words, and what stopped it as a footnote: in plain words, counted in texts, where the
    condition recorded its stop (`stop_words`), else its message without the rules' names; `verbose`: the message
    whole (the call, its rows, the rule)."""
    words, message = status_words(condition), condition.get("message")
    if condition["status"] != "completed":
        words += stopped_in(condition)
    if not message:
        return words
    text = f"{condition['status']}: {message}" if verbose else stop_words(condition) or without_rule_names(message)
    return f"{words} {footnotes.mark(f'guard {guard_cell(condition)}: {text}')}"


# What the guard saw the call would do on MPS, by fault kind ({unit}: the caller's "text", "sample").
_WOULD = {"wrong_all": "return wrong values for every {unit}", "truncated": "return a truncated result (mostly zeros)",
          "wrong_other": "return wrong values in a pattern nobody characterised", "abort": "kill the process"}


def stop_words(condition: dict[str, Any], unit: str = "text") -> str | None:
    """A stopped condition in plain words, counted in `unit`s (the first wrong one, the safe chunk), with the index
    width where it is narrowed; None where the condition recorded no stop (its message, then)."""
    stop, where = condition.get("stop"), condition.get("where") or "a call"
    if not stop:
        return None
    phase = " in backward" if stop.get("phase") == "backward" and "backward" not in where else ""
    if stop["by"] == "mps" and stop["kind"] not in STOP_KINDS:  # values the emulator will not invent
        if stop.get("unmeasured"):
            return (f"nobody measured torch {stop.get('release')} on MPS at {where}{phase}, so nobody can tell what "
                    "it returns there; the emulator does not invent it.")
        return (f"MPS returns wrong values at {where}{phase} in a pattern nobody characterised; the emulator does not "
                "invent them.")
    if stop["by"] == "mps":
        if stop["kind"] == "abort":
            return f"the process would die at {where}{phase}: {stop['torch_text']}."
        return f"MPS raises an error at {where}{phase}, {torch_words(stop['torch_text'])}."
    release = f" (torch {stop['release']})" if stop.get("release") else ""
    if stop.get("unmeasured"):
        would = "run where nobody measured MPS (judged as possibly wrong)"
    elif stop["kind"] == "wrong_tail" and stop.get("first_wrong_sample") is not None:
        would = f"return wrong values from {unit} {stop['first_wrong_sample']} on"
    elif stop["kind"] == "error":
        would = f"raise an error, {torch_words(stop['torch_text'])}"
    else:
        would = _WOULD.get(stop["kind"], "return wrong values").format(unit=unit)
    bits = stop.get("index_bits", MPS_INDEX_BITS)
    narrowed = (f" (at this run's {bits}-bit index, every limit divided by 2^{MPS_INDEX_BITS - bits})"
                if bits != MPS_INDEX_BITS else "")
    return f"stopped {where}{phase} before it ran: on MPS{release} it would {would}{narrowed}. {_advice(stop, unit)}"


def _advice(stop: dict[str, Any], unit: str) -> str:
    # A smaller batch runs the call whole ("whole_samples") with more than a piece of the guard's split holds.
    for count, words in ((stop.get("whole_samples"), "run this call correctly"),
                         (stop.get("safe_samples"), "are safe")):
        if count:
            return (f"At most {count} {unit}{'s' if count > 1 else ''} at once {words}: lower the batch size to "
                    f"{count}, or use guard mode 'chunk'.")
    if stop.get("safe_rows") is not None and (stop.get("rows_per_sample") or 1) > 1:
        return f"Not one whole {unit} is safe at once: shorten the {unit}s, or use guard mode 'chunk'."
    return "Guard mode 'chunk' splits it into pieces below the limits; or lower the batch size."
