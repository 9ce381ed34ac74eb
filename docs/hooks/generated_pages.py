"""The site's generated pages (an mkdocs hook: mkdocs.yml `hooks:`): a reference page for every command and
option, read from the CLI itself (mpsimpact.cli:app, through click), and the library's API page, one entry per
public name of `mpsimpact` (rendered from its docstrings by mkdocstrings). They are made at every build and never
committed, so they cannot drift from the code; tests/test_docs_site.py changes an option's help and sees its page
change. Also: a table's escaped pipe inside a code span reads as GitHub shows it (on_page_markdown)."""

from __future__ import annotations

import html
import re
from typing import Any

REFERENCE = "reference"  # the generated pages' folder in the site
GENERATED_NOTE = ("<!-- Generated at build time from {source} by docs/hooks/generated_pages.py: edit {what}, not "
                  "this page. -->")
# Where each command is told as a story (a page of docs/); a command not named here has its reference page only.
STORY = {
    "run": ("giving-the-talk.md", "Giving the talk"),
    "plan": ("is-my-model-affected.md", "Is my model affected?"),
    "check": ("is-my-model-affected.md", "Is my model affected?"),
    "sweep": ("measuring-a-release.md", "Measuring a release"),
    "compare": ("checking-an-upgrade.md", "Checking an upgrade"),
    "matrix": ("checking-an-upgrade.md", "Checking an upgrade"),
    "train-head": ("giving-the-talk.md", "Giving the talk"),
}
# The library beyond the names `mpsimpact` exports: the attention face, the memory budget, the errors (each
# exception class of mpsimpact.errors, found there: see api_page), with the members people call.
LIBRARY_MODULES = (
    ("mpsimpact.attention", "The attention face: `mps_safe_eager`",
     ("NAME", "register", "mps_safe_eager_attention")),
    ("mpsimpact.attention.blocked", "The demo's attention for a small Mac: `blocked_eager`",
     ("NAME", "register", "use_blocks", "remove_blocks")),
    ("mpsimpact.modes.budget", "The memory budget of an attention piece", ("set_memory_budget", "memory_budget")),
    ("mpsimpact.errors", "The errors", None),
)
# An exported class whose methods are a dispatch mode's hooks (torch calls them), not calls for people.
HOOKS_ONLY = frozenset({"EmulateMode"})


def escaped(text: str) -> str:
    """`text` safe in a Markdown table cell: HTML's special characters escaped outside code spans (an option's
    default such as outputs/<scenario>-<time>/ is text, not a tag), pipes escaped everywhere."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(part if part.startswith("`") else html.escape(part, quote=False) for part in parts).replace(
        "|", "\\|")


def shown_default(param: Any) -> str:
    """What `--help` shows as the option's default (click's rule), as Markdown; '' where it shows none."""
    if isinstance(param.show_default, str):
        return f"*{escaped(param.show_default)}*"  # what not giving it means, in words
    if not param.show_default or param.default is None:
        return ""
    if getattr(param, "is_bool_flag", False):
        if param.secondary_opts:
            return f"`{(param.opts if param.default else param.secondary_opts)[0]}`"
        return "on" if param.default else "off"
    default = param.default
    return f"`{', '.join(map(str, default)) if isinstance(default, (list, tuple)) else default}`"


def command_page(word: str, command: Any, context: Any) -> str:
    """The reference page of one command: its usage, its help, each argument and each option with its default."""
    import click

    getattr(command, "show_config_defaults", lambda: None)()  # the defaults --help shows (commands.options)
    ctx = click.Context(command, info_name=word, parent=context)
    usage = command.get_usage(ctx).removeprefix("Usage:").strip()
    lines = [f"# mpsimpact {word}", "", GENERATED_NOTE.format(source=f"`mpsimpact {word} --help`",
                                                             what=f"the command's help in mpsimpact.commands"), "",
             "```text", usage, "```", "", escaped_paragraphs(command.help or ""), ""]
    params = [param for param in command.get_params(ctx) if not getattr(param, "hidden", False)]
    arguments = [param for param in params if param.param_type_name == "argument"]
    if arguments:
        lines += ["## Arguments", "", "| argument | what it is |", "|---|---|"]
        lines += [f"| `{param.name.upper()}` | {escaped(getattr(param, 'help', None) or '')}"
                  f"{' (required)' if param.required else ''} |" for param in arguments]
        lines.append("")
    lines += ["## Options", "", "| option | default | what it does |", "|---|---|---|"]
    for param in params:
        if param.param_type_name != "option":
            continue
        names, _ = param.get_help_record(ctx)
        lines.append(f"| `{names}` | {shown_default(param)} | {escaped(param.help or '')} |")
    story = STORY.get(word)
    if story:
        lines += ["", f"How it is used, with examples: [{story[1]}](../{story[0]})."]
    return "\n".join(lines) + "\n"


def escaped_paragraphs(text: str) -> str:
    """A command's help, paragraph by paragraph, escaped as a table cell is (without the pipes)."""
    return "\n\n".join(escaped(paragraph).replace("\\|", "|") for paragraph in text.split("\n\n") if paragraph)


def index_page(group: Any) -> str:
    """The reference's first page: every command with its one-line help, linked to its page."""
    lines = ["# Command reference", "", GENERATED_NOTE.format(source="`mpsimpact --help`", what="the CLI"), "",
             escaped_paragraphs(group.help or ""), "",
             "Every command and every option, as `mpsimpact COMMAND --help` prints them. A command refuses bad "
             "input in one line on stderr and exits with code 2 before any work.", "",
             "| command | what it does |", "|---|---|"]
    for word, command in group.commands.items():
        if not command.hidden:
            first = (command.help or "").split("\n\n")[0]  # the help's first paragraph
            lines.append(f"| [`mpsimpact {word}`]({page_name(word)}) | {escaped(first)} |")
    return "\n".join(lines) + "\n"


def page_name(word: str) -> str:
    return f"{word}.md"


def reference_pages(group: Any = None) -> dict[str, str]:
    """Every generated page of the command reference, by its path in the site: `reference/index.md` and one
    `reference/WORD.md` per command. `group` is the CLI as click sees it (default: mpsimpact.cli:app's)."""
    import click
    import typer.main

    if group is None:
        from mpsimpact.cli import app

        group = typer.main.get_command(app)
    context = click.Context(group, info_name="mpsimpact")
    pages = {f"{REFERENCE}/index.md": index_page(group)}
    for word, command in group.commands.items():
        if not command.hidden:
            pages[f"{REFERENCE}/{page_name(word)}"] = command_page(word, command, context)
    return pages


def api_page() -> str:
    """The library's API: each name `mpsimpact` exports (`mpsimpact.__all__`, from the module that defines it),
    then the attention face, the errors and the budget, rendered by mkdocstrings from their docstrings."""
    import mpsimpact

    lines = ["# Library API", "", GENERATED_NOTE.format(source="`mpsimpact.__all__` and the docstrings",
                                                        what="the docstrings"), "",
             "What `import mpsimpact` gives (each name is imported when first used), then the attention "
             "implementations, the memory budget and the errors. How they fit together: "
             "[The library](../library.md) and [The guard](../guard.md).", "", "## `mpsimpact`", ""]
    for name in mpsimpact.__all__:
        lines += [f"::: {mpsimpact._EXPORTS[name]}.{name}", "    options:", "      show_root_heading: true",
                  f'      heading: "mpsimpact.{name}"', f'      toc_label: "mpsimpact.{name}"',
                  "      heading_level: 3",
                  *(["      members: false"] if name in HOOKS_ONLY else []), ""]
    for module, title, members in LIBRARY_MODULES:
        members = members or exception_classes(module)
        lines += [f"## {title}", "", f"::: {module}", *OPTIONS, "      heading_level: 3",
                  f"      members: [{', '.join(members)}]", ""]
    return "\n".join(lines)


OPTIONS = ("    options:", "      show_root_heading: false", "      show_root_toc_entry: false")


def exception_classes(module: str) -> list[str]:
    """The public exception classes `module` defines, in its order."""
    import importlib

    found = vars(importlib.import_module(module))
    return [name for name, value in found.items() if isinstance(value, type) and issubclass(value, BaseException)
            and value.__module__ == module and not name.startswith("_")]


def generated_pages() -> dict[str, str]:
    """Every page this hook adds to the site, by its path there."""
    return {**reference_pages(), f"{REFERENCE}/api.md": api_page()}


def on_files(files: Any, config: Any) -> Any:
    """mkdocs' hook: the generated pages join the site's files (in memory: nothing is written to docs/)."""
    from mkdocs.structure.files import File

    for path, text in generated_pages().items():
        files.append(File.generated(config, path, content=text))
    return files


def on_config(config: Any) -> Any:
    """mkdocs' hook: the command pages join the navigation's "Reference" section, after its index, in the CLI's
    order (so a new command needs no edit of mkdocs.yml)."""
    words = [path.removeprefix(f"{REFERENCE}/").removesuffix(".md") for path in reference_pages()
             if not path.endswith("/index.md")]
    for entry in config.nav or []:
        if isinstance(entry, dict) and "Reference" in entry:
            entry["Reference"][1:1] = [{f"mpsimpact {word}": f"{REFERENCE}/{page_name(word)}"} for word in words]
    return config


def unescaped_table_pipes(markdown: str) -> str:
    """A table row's `\\|` inside a code span as GitHub renders it, a plain `|` (GitHub needs the escape to keep
    the cell whole; Python-Markdown keeps a code span's pipes in their cell and would show the backslash)."""
    lines, fenced = [], False
    for line in markdown.split("\n"):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and line.startswith("|"):
            line = re.sub(r"`[^`]*`", lambda span: span[0].replace("\\|", "|"), line)
        lines.append(line)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs' hook: every page's Markdown before it is rendered (see unescaped_table_pipes)."""
    return unescaped_table_pipes(markdown)
