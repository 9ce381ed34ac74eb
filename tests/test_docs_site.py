"""The documentation site: its command reference is generated from the CLI (a help text or a config default
changed in the code changes its page), its API page names every public name, and (CI) it builds in strict mode
without the network, with every link of the README into docs/ landing on a page of the built site."""

from __future__ import annotations

import dataclasses
import html
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "docs" / "hooks" / "generated_pages.py"
# The five paths a newcomer takes from the README, each one click away.
PATHS = ("giving-the-talk.md", "checking-an-upgrade.md", "is-my-model-affected.md", "guard.md",
         "measuring-a-release.md")


def load_hook():
    spec = importlib.util.spec_from_file_location("generated_pages", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hook():
    return load_hook()


def cli_group():
    import typer.main

    from mpsimpact.cli import app

    return typer.main.get_command(app)


def option_of(group, word: str, flag: str):
    return next(param for param in group.commands[word].params if flag in getattr(param, "opts", ()))


def test_the_readme_is_a_front_door_to_every_page():
    # At most 300 lines; each of the five paths one click away; every link into docs/ names a file there (the CI
    # test below checks the built pages and anchors); every docs page is linked from the README or a path's page.
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    links = re.findall(r"\]\(docs/([\w/.-]+\.(?:md|png))(?:#([\w-]+))?\)", readme)
    assert {page for page, _ in links} >= set(PATHS)
    for page, _ in links:
        assert (ROOT / "docs" / page).is_file(), page
    pages = {path.name for path in (ROOT / "docs").glob("*.md")}
    reached = {page for page, _ in links}
    for page in PATHS:
        reached |= set(re.findall(r"\]\(([\w-]+\.md)", (ROOT / "docs" / page).read_text()))
    assert pages - reached <= {"index.md"}, pages - reached  # the site's home page is the README's stand-in


def test_every_command_and_every_visible_option_has_its_reference_entry(hook):
    group = cli_group()
    pages = hook.reference_pages(group)
    words = [word for word, command in group.commands.items() if not command.hidden]
    assert len(words) >= 9 and set(pages) == {"reference/index.md", *(f"reference/{word}.md" for word in words)}
    for word in words:
        page = pages[f"reference/{word}.md"]
        for param in group.commands[word].params:
            if param.param_type_name == "option" and not param.hidden:
                assert f"`{param.opts[0]}" in page, (word, param.opts)
        assert f"[`mpsimpact {word}`]({word}.md)" in pages["reference/index.md"]
    assert "--phase" not in pages["reference/check.md"]  # a hidden former name stays hidden


def test_an_options_help_changed_in_the_cli_changes_its_page(hook, monkeypatch):
    group = cli_group()
    guard = option_of(group, "run", "--guard")
    before = hook.reference_pages(group)["reference/run.md"]
    assert guard.help in before
    monkeypatch.setattr(guard, "help", "A help text planted by the test, with <angle> brackets | and a pipe.")
    after = hook.reference_pages(group)["reference/run.md"]
    row = next(line for line in after.splitlines() if line.startswith("| `--guard"))
    assert "A help text planted by the test, with &lt;angle&gt; brackets \\| and a pipe." in row
    assert after.replace(row, "") == before.replace(next(line for line in before.splitlines()
                                                          if line.startswith("| `--guard")), "")


def test_an_options_default_is_its_configs_as_help_shows_it(hook, monkeypatch):
    from mpsimpact.config import RunConfig

    group = cli_group()
    row = next(line for line in hook.reference_pages(group)["reference/run.md"].splitlines()
               if line.startswith("| `--threshold"))
    threshold = next(field for field in dataclasses.fields(RunConfig) if field.name == "threshold")
    assert f"| `{threshold.default}` |" in row
    monkeypatch.setattr(threshold, "default", 0.25)
    row = next(line for line in hook.reference_pages(cli_group())["reference/run.md"].splitlines()
               if line.startswith("| `--threshold"))
    assert "| `0.25` |" in row
    # What not giving an option means, in words (the option's own text where the config says None):
    assert "*the model's maximum*" in hook.reference_pages(group)["reference/check.md"]


def test_the_api_page_renders_every_public_name_from_where_it_is_defined(hook):
    import mpsimpact

    page = hook.api_page()
    targets = re.findall(r"^::: (\S+)$", page, re.MULTILINE)
    for name in mpsimpact.__all__:
        assert f"{mpsimpact._EXPORTS[name]}.{name}" in targets and f'heading: "mpsimpact.{name}"' in page
    for target in targets:  # each resolves to what it names
        module, _, name = target.rpartition(".")
        found = importlib.import_module(target) if name in {"attention", "blocked", "budget", "errors"} else \
            getattr(importlib.import_module(module), name)
        assert found is not None
    assert "members: [MpsImpactError, UsageError" in page  # the errors, found in mpsimpact.errors


def test_a_tables_escaped_pipe_in_code_reads_as_on_github(hook):
    markdown = "| `--device auto\\|mps` | a \\| b |\n```\n| `x\\|y` |\n```\ntext `p\\|q`\n"
    expected = "| `--device auto|mps` | a \\| b |\n```\n| `x\\|y` |\n```\ntext `p\\|q`\n"
    assert hook.unescaped_table_pipes(markdown) == expected


@pytest.mark.ci
def test_the_site_builds_strict_offline_and_the_readme_reaches_every_page(tmp_path):
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail('mkdocs is not installed: `pip install ".[docs]"` (the test extra includes it)')
    site = tmp_path / "site"
    dead = "http://127.0.0.1:9"  # any fetch fails at once: the build must not need one
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HTTP_PROXY": dead, "HTTPS_PROXY": dead, "http_proxy": dead,
           "https_proxy": dead, "NO_PROXY": "", "no_proxy": ""}
    done = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir",
                           str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(docs/([\w/-]+)\.md(?:#([\w-]+))?\)", readme)
    assert {f"{page}.md" for page, _ in links} >= set(PATHS)  # each path one click from the README
    for page, anchor in links:
        built = site / page / "index.html"
        assert built.is_file(), page
        assert not anchor or f'id="{anchor}"' in built.read_text(), (page, anchor)
    for word in ("run", "check", "compare", "sweep"):
        assert "--out" in (site / "reference" / word / "index.html").read_text()
    started = html.unescape(re.sub(r"<[^>]+>", "", (site / "getting-started" / "index.html").read_text()))
    assert "mpsimpact run sentiment --quick" in started and "pip install torch==2.13.0" in started
    assert "<code>--device auto|mps|cuda|cpu</code>" in (site / "giving-the-talk" / "index.html").read_text()
    api = (site / "reference" / "api" / "index.html").read_text()
    assert 'id="mpsimpact.modes.guard.guard"' in api and "OversizedOpError" in api
    resource = re.compile(r'<(?:link|script|img)[^>]+(?:href|src)="(https?://[^"]+)"')
    fetched = {match for path in site.rglob("*.html") for match in resource.findall(path.read_text())}
    assert not fetched  # a page read offline needs nothing from the network (no web fonts, no CDN)
