"""SIGTERM and SIGHUP handled like Ctrl-C (output.signals.exit_cleanly_on_signals): exit 128 + the signal,
no partial report folder, claim or temporary cache file left, and a child process (the matrix probe)
ended with its parent. Each case runs a small driver in a subprocess that says "ready" at the moment
to interrupt, then waits to be signalled."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

DRIVER_HEAD = """
import os, sys, time
from pathlib import Path
from mpsimpact.output.signals import exit_cleanly_on_signals
def ready(what="ready"):
    print(what, flush=True)
    time.sleep(60)
"""


def drive(body, *args, signum=signal.SIGTERM, env=None):
    """Runs DRIVER_HEAD + body; signals it when it prints its first line; returns (returncode, first
    line, stderr)."""
    code = DRIVER_HEAD + textwrap.dedent(body)
    child = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=os.environ | (env or {}))
    try:
        line = child.stdout.readline().strip()
        assert line, child.stderr.read()
        child.send_signal(signum)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    return child.returncode, line, err


WHILE_THE_REPORT_IS_WRITTEN = """
from mpsimpact.output.files import claimed_out_dir, folder_written_atomically
with exit_cleanly_on_signals():
    with claimed_out_dir(sys.argv[1], "run") as folder, folder_written_atomically(folder) as partial:
        (partial / "report.json").write_text("{}")
        ready()
"""


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])  # 128 + 15, 128 + 1
def test_a_signal_while_the_report_is_written_leaves_nothing_and_exits_128_plus_n(tmp_path, signum, code):
    out = tmp_path / "out"
    returncode, line, err = drive(WHILE_THE_REPORT_IS_WRITTEN, out, signum=signum)
    assert line == "ready"
    assert returncode == code, err
    assert err == f"stopped by {signal.Signals(signum).name}; partial output removed.\n"
    assert os.listdir(tmp_path) == []  # no report, no .out.partial-PID/, no claimed folder


def test_a_signal_during_a_cache_write_leaves_no_temporary_file(tmp_path):
    body = """
    import mpsimpact.output.files as files
    files.os.fsync = lambda fd: ready()  # stopped in the middle of the atomic write
    with exit_cleanly_on_signals():
        files.atomic_write_bytes(Path(sys.argv[1]) / "entry.ref", b"x" * 1000)
    """
    returncode, line, err = drive(body, tmp_path / "cache")
    assert (line, returncode) == ("ready", 143), err
    assert os.listdir(tmp_path / "cache") == []  # the .entry.ref.PID.XXXX.partial file is gone


def test_without_the_handler_sigterm_leaves_the_partial_folder(tmp_path):
    """What the handler fixes: the default SIGTERM kills at once, and the partial folder stays."""
    body = """
    from mpsimpact.output.files import folder_written_atomically
    with folder_written_atomically(Path(sys.argv[1])) as partial:
        ready()
    """
    returncode, _, _ = drive(body, tmp_path / "out")
    assert returncode == -signal.SIGTERM
    assert [p.name for p in tmp_path.iterdir()][0].startswith(".out.partial-")


def is_running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is not running
        return stat.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from Linux's /proc")
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGKILL, -signal.SIGKILL)])
def test_a_signal_to_matrix_ends_its_probe_subprocess(tmp_path, signum, code):
    """probe_environment runs `python -m mpsimpact.upgrade.probe` with the overlay first on the path: a
    fake overlay's probe writes its pid and sleeps; SIGTERM to the parent must end it too, and so must
    SIGKILL, which no handler sees (the child asked the kernel to end it with its parent)."""
    if signum == signal.SIGKILL and not sys.platform.startswith("linux"):
        pytest.skip("a child ends with a SIGKILL-ed parent on Linux only (prctl PR_SET_PDEATHSIG)")
    fake = tmp_path / "overlay" / "mpsimpact" / "upgrade"
    fake.mkdir(parents=True)
    for folder in (fake.parent, fake):
        (folder / "__init__.py").write_text("")
    pid_file = tmp_path / "probe.pid"
    (fake / "probe.py").write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    body = """
    from mpsimpact.upgrade.overlay import probe_environment
    import threading
    pid_file = Path(sys.argv[2])
    def say_when_the_probe_runs():
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.05)
        print("probing", flush=True)
    threading.Thread(target=say_when_the_probe_runs, daemon=True).start()
    with exit_cleanly_on_signals():
        probe_environment(Path(sys.argv[1]), {})
    """
    returncode, line, err = drive(body, tmp_path / "overlay", pid_file, signum=signum)
    assert (line, returncode) == ("probing", code), err
    probe = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while is_running(probe) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_running(probe), "the probe outlived mpsimpact"


RUN = """
import mpsimpact.{module} as target
real = target.{name}
def interrupted(*args, **kwargs):
    ready()
target.{name} = interrupted
from mpsimpact.cli import app
with exit_cleanly_on_signals():
    app(["run", "sentiment", "--batch-size", "16", "--max-length", "256", "--index-bits", "23", "--out", sys.argv[1]],
        prog_name="mpsimpact")
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["runs.device_pass.device_pass", "reports.run.render_markdown"], ids=["mid-run", "writing"])
def test_sigterm_to_a_run_mid_run_and_while_writing(tmp_path, where):
    """`mpsimpact run` as the commands will run it (inside exit_cleanly_on_signals), stopped during a device
    pass or while the report folder is written: exit 143, nothing next to --out, nothing temporary in
    the cache (the reference entry itself may stay: it was complete)."""
    module, name = where.rsplit(".", 1)
    cache = tmp_path / "cache"
    returncode, line, err = drive(RUN.format(module=module, name=name), tmp_path / "out", env={"MPSIMPACT_CACHE": str(cache)})
    assert (line, returncode) == ("ready", 143), err
    assert sorted(os.listdir(tmp_path)) == ["cache"]
    leftovers = [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".ref")]
    assert leftovers == []
