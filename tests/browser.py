"""Our HTML pages in a real headless Chromium: a copy of the page gets a script that, once loaded, records
whether every image decoded, whether anything is wider than the window, and every script error or
console error; Chromium's --dump-dom returns the record. Also a screenshot, to look at."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

BINARIES = ("chromium", "chromium-browser", "google-chrome")
PROBE = """<script>
(function () {
  var errors = [];
  window.addEventListener("error", function (e) { errors.push(String(e.message || e)); });
  var log = console.error; console.error = function () { errors.push([].join.call(arguments, " ")); log.apply(console, arguments); };
  window.addEventListener("load", function () {
    var width = document.documentElement.clientWidth, wide = [];
    document.querySelectorAll("body *").forEach(function (el) {
      var box = el.getBoundingClientRect();
      if (box.right > width + 1) wide.push(el.tagName + (el.className ? "." + el.className : ""));
    });
    var images = Array.prototype.map.call(document.images, function (img) {
      return {src: img.src.slice(0, 40), ok: img.complete && img.naturalWidth > 0};
    });
    var out = document.createElement("pre");
    out.id = "mpsimpact-probe";
    out.textContent = JSON.stringify({errors: errors, wide: wide, images: images, width: width,
                                      scrollWidth: document.documentElement.scrollWidth});
    document.body.appendChild(out);
  });
})();
</script>"""


def chromium() -> str | None:
    """The Chromium binary on PATH, or None."""
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    binary = chromium()
    assert binary is not None
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=5000"]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120)


def inspect_page(page: Path, width: int = 1280) -> dict:
    """{"errors", "wide", "images", "width", "scrollWidth"} of `page` rendered `width` pixels wide."""
    probe = page.with_name(f".probe-{page.name}")
    probe.write_text(page.read_text().replace("<head>", "<head>" + PROBE, 1))
    try:
        dom = _run([f"--window-size={width},900", "--dump-dom", probe.as_uri()]).stdout
    finally:
        probe.unlink()
    found = re.search(r'<pre id="mpsimpact-probe">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<"))


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 2400) -> Path:
    """A PNG of the page as Chromium shows it."""
    _run([f"--window-size={width},{height}", f"--screenshot={png}", page.as_uri()])
    return png
