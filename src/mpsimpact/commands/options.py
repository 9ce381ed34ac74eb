"""The options several commands share, each declared once with one help text, and the one way a command
turns the options it was given into its config. Defaults live in the config dataclasses: an option not
given stays None and the config's default applies; `--help` shows that default (shows_config_defaults).
A number is declared as text (`number`) and read by its config's Check, by the one rule for what a person
types (Note [Numbers typed by a user] in bounds); every command refuses an option given twice, two options
that say one thing, and an empty value, before anything else (`CheckedCommand`)."""

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperCommand

# click's usage error (a missing argument, an option no command has, an extra argument), wherever typer takes click
# from: the base of typer.BadParameter.
CLICK_USAGE_ERROR = typer.BadParameter.__mro__[1]
THE_SCENARIOS = "the scenario's"
WHOLE, DECIMAL = "INTEGER", "FLOAT"  # how --help names a number option's value
# flag -> (help, what not giving it means where the config's default is None)
SHARED = {
    "--batch-size": ("Texts (samples) in the one batch.", f"{THE_SCENARIOS}, 2048"),
    "--max-length": ("Tokens per text: the padding/truncation length.", f"{THE_SCENARIOS}, 512"),
    "--model": ("A sequence-classification model: hub id or local path.", THE_SCENARIOS),
    "--device": ("auto (mps, else cuda, else cpu), mps, cuda or cpu.", None),
    "--emulate/--no-emulate": ("Emulate MPS's faults.", "on unless the device is mps"),
    "--index-bits": ("Index width of the fault rules; 32 is MPS. Smaller widths show the fault on small "
                     "batches.", None),
    "--torch-profile": ("The torch release whose MPS faults are emulated, guarded and planned, e.g. 2.12.1, "
                        "'conservative', or a profile.json written by `mpsimpact sweep`.",
                        "on a Mac the installed torch's; elsewhere 2.14.0, the published demo's"),
    "--memory": ("A Mac's unified memory (e.g. 16GB), or auto on a Mac: a tensor that reaches its largest "
                 "buffer (about half of it) stops with MPS's 'Invalid buffer size', as on that Mac.",
                 "no Mac: the index rules alone"),
}
NUMBERS = frozenset({"--batch-size", "--max-length", "--index-bits"})  # the SHARED options that take a number
# An option kept working under a former name, hidden: it and its new name are one option (given both: refused).
FORMER_NAMES = {"phase": "workload"}


def option(flag: str, text: str, absent: str | None = None, metavar: str | None = None) -> Any:
    """An option that is None when not given, so that the config's default applies; `absent` says what
    not giving it means, shown as the default where the config's default is None ("--a/--no-a": a pair)."""
    return typer.Option(None, flag, help=text, show_default=absent or True, metavar=metavar)


def number(flag: str, text: str, absent: str | None = None, whole: bool = True) -> Any:
    """An option that takes a number (`whole`: a whole number), declared as text (annotate it `str | None`):
    its config's Check reads it (`config_from`), by the rule every number a person types is read by."""
    return option(flag, text, absent, WHOLE if whole else DECIMAL)


def shared(flag: str) -> Any:
    """The option `flag` of SHARED, the same in every command that takes it."""
    return number(flag, *SHARED[flag]) if flag in NUMBERS else option(flag, *SHARED[flag])


def scenario() -> Any:
    return typer.Argument(..., help="Scenario name (see `mpsimpact list`).")


def out(writes: str, absent: str | None = None, fresh: bool = True) -> Any:
    """--out: `writes` says what goes there ("Write the reports"); `fresh`: it must not hold files."""
    rule = "; it must not exist or be empty" if fresh else ""
    return option("--out", f"{writes} to this folder{rule}.", absent)


def as_json() -> Any:
    return typer.Option(False, "--json", help="Print the result as one JSON object.")


def verbose() -> Any:
    # A plain flag shows no "[default: ...]" (as --json, --quick): its help says it is off unless given. No
    # "-v": a short name widens every --help table by a column, and run's then cuts its --out default at 80.
    return typer.Option(False, "--verbose", help="Also print the internals: every message in full, the "
                        "fault rules' names, the layouts. Off unless given.")


def check_output(as_json: bool, verbose: bool) -> None:
    """Refuses --verbose beside --json: it adds the internals to the console's tables, which --json replaces."""
    from mpsimpact.errors import UsageError

    if as_json and verbose:
        raise UsageError("--verbose adds the internals to the console's tables, and --json prints the whole result "
                         "as JSON instead (the internals included); give one of them.", option="--verbose")


def print_result(data: Any, as_json: bool, print_tables: Callable[[], None]) -> None:
    """--json: `data` as one JSON object; else the tables."""
    if as_json:  # a typed value (output.record.Record) as the file it writes
        typer.echo(json.dumps(data.to_json() if hasattr(data, "to_json") else data, indent=2, default=str))
    else:
        print_tables()


def check_environment() -> None:
    """Every environment variable mpsimpact reads (variables.py, and the cache's: engine.release.cache_root),
    checked before a command does any work: a bad one is one line naming it, its value and what is accepted."""
    from mpsimpact.engine.release import cache_root
    from mpsimpact.variables import check_variables

    check_variables()
    cache_root()


def config_from(config: type, **given: Any) -> Any:
    """The command's config from its options, by keyword; an option not given (None) keeps the config's
    default, a number's text is read by its field's Check (`Check.read`). Validated here, and its scenario's
    name checked, before the command imports torch or anything heavy (a typo answers at once); the library
    call validates it again."""
    from mpsimpact.runs.scenario import check_scenario_name

    checks = {field.name: field.metadata.get("check") for field in dataclasses.fields(config)}
    made = config(**{name: value if checks.get(name) is None else checks[name].read(value)
                     for name, value in given.items() if value is not None})
    if getattr(made, "scenario", None) is not None:
        check_scenario_name(made.scenario)
    made.validate()
    return made


class CheckedCommand(TyperCommand):
    """A command that refuses, as click reads its command line and before it converts a value or runs: an
    option given twice (the last would silently win: `--memory 16GB --memory 64GB`), two options that set one
    (`--emulate --no-emulate`, an option and its former name: FORMER_NAMES), and an empty value (`--out ''`,
    `--batch-size=`, an empty argument). Each is one line (a UsageError; the CLI exits 2)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            if not ctx.resilient_parsing:
                opts, _, order = self.make_parser(ctx).parse_args(args=list(args))  # click's own reading, a copy
                if not any(param.name == "help" for param in order):  # --help answers whatever else is given
                    refuse_repeats(order, args)
                    refuse_empty(opts, self.get_params(ctx), ctx.command_path)
            return super().parse_args(ctx, args)
        except CLICK_USAGE_ERROR as error:  # some leave out the command they were made in
            error.ctx = error.ctx or ctx
            raise


def refuse_repeats(order: list[Any], args: list[str]) -> None:
    """Raises UsageError where click read one option (or an option and its former name) more than once:
    `order` is each option as click read it, once per time given."""
    from mpsimpact.errors import UsageError

    given: dict[str, list[Any]] = {}
    for param in order:
        if param.param_type_name == "option" and not param.multiple:
            given.setdefault(FORMER_NAMES.get(param.name, param.name), []).append(param)
    for params in given.values():
        if len(params) < 2:
            continue
        names = list(dict.fromkeys(_names_given(params, args))) or [params[0].opts[0]]
        if len(names) == 1:
            raise UsageError(f"{names[0]} is given {len(params)} times; give it once (mpsimpact does not "
                             "let one value silently win over another).", option=names[0])
        raise UsageError(f"{' and '.join(names)} are both given, and they set one option; give one of them.",
                         option=names[0])


def _names_given(params: list[Any], args: list[str]) -> list[str]:
    """The option names (`--emulate`, `--no-emulate`) among `args` that name one of `params`, in order."""
    names = [name for param in {id(p): p for p in params}.values() for name in (*param.opts, *param.secondary_opts)]
    return [name for token in args for name in names if token == name or token.startswith(f"{name}=")]


def refuse_empty(opts: dict[str, Any], params: list[Any], command: str) -> None:
    """Raises UsageError where an option or an argument was given an empty (or blank) value."""
    from mpsimpact.errors import UsageError

    for param in params:
        value = opts.get(param.name)
        if not isinstance(value, str) or value.strip():
            continue
        if param.param_type_name == "argument":
            raise UsageError(f"The {param.name} argument is empty ({value!r}); give one (`{command} --help` says "
                             "what it takes).")
        flag = param.opts[0]
        raise UsageError(f"{flag} is given an empty value ({value!r}); give a value, or leave {flag} out.",
                         option=flag)


def shows_config_defaults(config: type) -> type[TyperCommand]:
    """The command class for a command whose options default to the fields of its config dataclass: its
    --help shows each field's default."""

    class ShowsConfigDefaults(CheckedCommand):
        def show_config_defaults(self) -> None:
            """Each option's shown default becomes its config field's (the site's reference pages read them
            here too: docs/hooks/generated_pages.py)."""
            fields = {field.name: field.default for field in dataclasses.fields(config)}
            for param in self.params:
                default = fields.get(param.name)
                if param.param_type_name != "option" or default is None or default is dataclasses.MISSING:
                    continue  # an argument, not a field, or an absence the option itself describes
                param.default = ", ".join(default) if isinstance(default, tuple) else default
                param.show_default = True

        def format_help(self, ctx: Any, formatter: Any) -> None:
            self.show_config_defaults()
            super().format_help(ctx, formatter)

    return ShowsConfigDefaults
