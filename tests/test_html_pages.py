"""The run, compare and matrix pages in a real headless Chromium (marked `browser`, skipped with the reason
when Chromium is missing): every image decodes, nothing is wider than a 1280-pixel window, no script or
console error. Screenshots go to $MPSIMPACT_SCREENSHOTS when set, to be looked at."""

import os
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from browser import chromium, inspect_page, screenshot
from mpsimpact.cli import app

pytestmark = [pytest.mark.browser, pytest.mark.skipif(chromium() is None, reason="needs headless Chromium "
                                                      "(Debian package chromium)")]
runner = CliRunner()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    root = tmp_path_factory.mktemp("pages")
    env = {"MPSIMPACT_CACHE": str(root / "cache"), "COLUMNS": "100"}
    small = ["run", "sentiment", "--batch-size", "16", "--max-length", "256", "--index-bits", "23", "--device", "cpu",
             "--torch-profile", "2.14.0"]
    for name in ("before", "after"):
        done = runner.invoke(app, [*small, "--out", str(root / name)], env=env)
        assert done.exit_code == 0, done.output
    done = runner.invoke(app, ["compare", str(root / "before"), str(root / "after"), "--out", str(root / "compare")],
                         env=env)
    assert done.exit_code == 0, done.output
    done = runner.invoke(app, ["matrix", "sentiment", "--transformers", version("transformers"), "--batch-size", "4096",
                               "--out", str(root / "matrix")], env=env)
    assert done.exit_code == 0, done.output
    return {"run": root / "before" / "report.html", "compare": root / "compare" / "compare.html",
            "matrix": root / "matrix" / "matrix.html"}


@pytest.mark.parametrize(("page", "figures"), [("run", 3), ("compare", 0), ("matrix", 1)])
def test_a_page_renders_whole_in_chromium(pages, page, figures):
    seen = inspect_page(pages[page])
    assert seen["errors"] == []
    assert seen["wide"] == [] and seen["scrollWidth"] <= seen["width"], seen
    assert len(seen["images"]) >= figures and all(image["ok"] for image in seen["images"]), seen["images"]
    if os.environ.get("MPSIMPACT_SCREENSHOTS"):
        screenshot(pages[page], Path(os.environ["MPSIMPACT_SCREENSHOTS"]) / f"{page}.png")


def test_the_check_catches_a_broken_image_and_a_wide_table(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text('<!doctype html><html><head><meta charset="utf-8"></head><body>'
                    '<img src="data:image/png;base64,AAAA"><table><tr><td style="white-space:nowrap">'
                    + "x" * 600 + "</td></tr></table><script>undefinedName()</script></body></html>")
    seen = inspect_page(page)
    assert [image["ok"] for image in seen["images"]] == [False]
    assert "TD" in seen["wide"] and seen["errors"]
