"""matrix environments kept honest: each is found or built under its lock file (shared while used,
exclusive while built), so a build never replaces an environment under a process probing it, and a
concurrent user waits with one line or gets a clear error; a damaged marker or a file where a folder
belongs is a rebuild or one clear error, never a traceback. flock locks belong to open files, so two
caches in one process contend exactly as two processes do."""

import json
import threading
import time

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.errors import OverlayError, UsageError
from mpsimpact.config import MatrixConfig
from mpsimpact.upgrade.matrix import build_matrix
from mpsimpact.upgrade.overlay import MARKER, OverlayCache
from said import messages, one_message

VERSION = "4.44.2"


class Builder:
    """Writes a transformers stub; can be held mid-build until `release` is set."""

    def __init__(self, hold=False):
        self.calls = []
        self.building = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def __call__(self, version, target):
        self.calls.append(version)
        self.building.set()
        assert self.release.wait(10)
        (target / "transformers").mkdir()
        (target / "transformers" / "__init__.py").write_text(f"__version__ = {version!r}\n")
        return {"installed": [f"transformers=={version}"], "reused": {}}


def make_stale(path):
    marker = json.loads((path / MARKER).read_text()) | {"reused": {"numpy": "0.0.1"}}  # numpy changed since
    (path / MARKER).write_text(json.dumps(marker))


def test_a_rebuild_waits_for_a_process_probing_the_environment_then_says_why_it_gave_up(tmp_path, capsys):
    OverlayCache(tmp_path, Builder()).ensure(VERSION)
    user = OverlayCache(tmp_path, Builder())
    rebuilder = Builder()
    with user.using(VERSION) as overlay:  # probing it now
        make_stale(overlay.path)  # so another process (other packages) wants to rebuild it
        with pytest.raises(OverlayError, match=r"another mpsimpact process held .*\.lock for more than 0 s; try again"):
            OverlayCache(tmp_path, rebuilder, lock_timeout=0.3).ensure(VERSION)
        assert (overlay.path / "transformers" / "__init__.py").is_file() and rebuilder.calls == []  # untouched
    assert one_message(capsys.readouterr().err, "warning") == (f"warning: transformers {VERSION}: waiting for another mpsimpact process building "
                                       f"or using {overlay.path} (up to 0 s).")


def test_a_waiting_rebuild_goes_ahead_when_the_user_is_done(tmp_path, capsys):
    OverlayCache(tmp_path, Builder()).ensure(VERSION)
    user, rebuilder = OverlayCache(tmp_path, Builder()), Builder()
    done = {}
    with user.using(VERSION) as overlay:
        make_stale(overlay.path)
        thread = threading.Thread(target=lambda: done.update(overlay=OverlayCache(tmp_path, rebuilder).ensure(VERSION)))
        thread.start()
        said, deadline = "", time.monotonic() + 30  # until the rebuild is really waiting (slow on a loaded machine)
        while "waiting for another mpsimpact process building or using" not in said and time.monotonic() < deadline:
            time.sleep(0.05)
            said += " ".join(messages(capsys.readouterr().err))
        assert "waiting for another mpsimpact process building or using" in said
        assert rebuilder.calls == []  # still waiting while the environment is used
    thread.join(10)
    assert rebuilder.calls == [VERSION] and done["overlay"].cached is False


def test_two_builds_of_one_release_build_it_once(tmp_path):
    first, second = Builder(hold=True), Builder()
    results = {}
    thread = threading.Thread(target=lambda: results.update(first=OverlayCache(tmp_path, first).ensure(VERSION)))
    thread.start()
    assert first.building.wait(10)
    waiter = threading.Thread(target=lambda: results.update(second=OverlayCache(tmp_path, second).ensure(VERSION)))
    waiter.start()
    time.sleep(0.5)
    first.release.set()
    thread.join(10)
    waiter.join(10)
    assert first.calls == [VERSION] and second.calls == []  # the second found the first's build
    assert (results["first"].cached, results["second"].cached) == (False, True)


@pytest.mark.parametrize("marker", ["[]", "null", '{"reused": []}', '{"transformers": "9.9.9"}', "{not json"])
def test_a_damaged_marker_means_rebuild_online_and_missing_offline(tmp_path, marker):
    builder = Builder()
    cache = OverlayCache(tmp_path, builder)
    path = cache.ensure(VERSION).path
    (path / MARKER).write_text(marker)
    assert cache.read_marker(VERSION) is None
    with pytest.raises(OverlayError, match=f"transformers {VERSION}: not in the cache at"):
        cache.ensure(VERSION, offline=True)
    assert cache.ensure(VERSION).cached is False and builder.calls == [VERSION, VERSION]


def test_a_file_where_an_environment_belongs_is_replaced(tmp_path):
    cache = OverlayCache(tmp_path, Builder())
    cache.path_for(VERSION).write_text("not an environment")
    overlay = cache.ensure(VERSION)
    assert (overlay.path / MARKER).is_file()


def test_an_envs_path_that_is_a_file_is_one_clear_error_before_any_work(tmp_path, monkeypatch):
    envs = tmp_path / "cache" / "envs"
    envs.parent.mkdir()
    envs.write_text("not a folder")
    message = f"The environment cache '{envs}' is a file, not a folder; remove it, or set MPSIMPACT_CACHE to another folder."
    with pytest.raises(UsageError, match=None) as error:
        build_matrix(MatrixConfig("sentiment", (VERSION,)), cache=OverlayCache(envs, Builder()))
    assert error.value.message == message
    with pytest.raises(OverlayError, match="is a file, not a folder"):
        OverlayCache(envs, Builder()).ensure(VERSION)
    import mpsimpact.upgrade.matrix as matrix

    monkeypatch.setattr(matrix, "probe_job", lambda config: pytest.fail("work started"))
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["matrix", "sentiment", "--transformers", VERSION, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and one_message(result.stderr) == f"error: {message}"
