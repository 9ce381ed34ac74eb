"""The guard's scope, said and enforced: a guard covers the thread that installed or entered it (torch's
dispatch modes are per thread), install_thread_guard/uninstall_thread_guard say so, uninstalling from
another thread is a clear error that leaves the guard intact, and the API refuses index widths the CLI
refuses, in the same words."""

import threading
import warnings

import pytest
import torch
from typer.testing import CliRunner

import mpsimpact
from mpsimpact.cli import app
from mpsimpact.errors import OversizedOpError, UsageError
from mpsimpact.modes.emulator import emulate
from mpsimpact.modes.guard import guard, install_thread_guard, uninstall_thread_guard
from said import one_message

BITS = 20


def wrapping_bmm():
    # a (200, 64, 128): 1,638,400 > 2**20 elements, contiguous: wraps from batch 2**20 / 8192 = 128.
    return torch.randn(200, 64, 128), torch.randn(200, 128, 2)


def outcome(fn):
    try:
        fn()
    except OversizedOpError:
        return "stopped"
    return "ran"


def in_thread(fn):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            box["error"] = error

    thread = threading.Thread(target=target, name="worker")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_thread_guard_covers_its_own_thread_only():
    a, b = wrapping_bmm()
    installed = install_thread_guard("raise", index_bits=BITS, devices=("cpu",))
    try:
        assert outcome(lambda: torch.bmm(a, b)) == "stopped"
        assert in_thread(lambda: outcome(lambda: torch.bmm(a, b))) == "ran"  # as documented: per thread

        def guarded_worker():
            install_thread_guard("raise", index_bits=BITS, devices=("cpu",))
            try:
                return outcome(lambda: torch.bmm(a, b))
            finally:
                uninstall_thread_guard()

        assert in_thread(guarded_worker) == "stopped"
        assert installed.stopped and outcome(lambda: torch.bmm(a, b)) == "stopped"  # the worker's left ours alone
    finally:
        uninstall_thread_guard()
    assert outcome(lambda: torch.bmm(a, b)) == "ran"


def test_a_thread_started_inside_a_guard_block_is_not_guarded():
    a, b = wrapping_bmm()
    with guard("raise", index_bits=BITS, devices=("cpu",)):
        assert in_thread(lambda: outcome(lambda: torch.bmm(a, b))) == "ran"
        assert outcome(lambda: torch.bmm(a, b)) == "stopped"


def test_uninstall_from_another_thread_is_a_clear_error_and_the_guard_stays_usable():
    a, b = wrapping_bmm()
    install_thread_guard("raise", index_bits=BITS, devices=("cpu",))
    try:
        with pytest.raises(UsageError) as error:
            in_thread(uninstall_thread_guard)
        assert error.value.message == (
            "uninstall_thread_guard() removes the guard installed on the calling thread; this thread has none, the "
            "guard is on thread 'MainThread'. Call uninstall_thread_guard() on that thread.")
        assert outcome(lambda: torch.bmm(a, b)) == "stopped"  # still on, and still ours to remove
    finally:
        uninstall_thread_guard()
    assert outcome(lambda: torch.bmm(a, b)) == "ran"
    uninstall_thread_guard()  # none anywhere: nothing to do
    in_thread(uninstall_thread_guard)


def test_the_old_names_still_work_and_say_the_new_ones():
    a, b = wrapping_bmm()
    with pytest.warns(DeprecationWarning, match="install_thread_guard"):
        mpsimpact.install_guard("raise", index_bits=BITS, devices=("cpu",))
    try:
        assert outcome(lambda: torch.bmm(a, b)) == "stopped"
    finally:
        with pytest.warns(DeprecationWarning, match="uninstall_thread_guard"):
            mpsimpact.uninstall_guard()
    assert mpsimpact.install_thread_guard is install_thread_guard and "install_thread_guard" in mpsimpact.__all__


@pytest.mark.parametrize("bits", [3, 33, 40, 0, "16", 16.0, True])
def test_index_bits_outside_4_to_32_are_refused_by_guard_and_emulate(bits):
    message = f"index_bits must be in 4..32 (32 is MPS), got {bits!r}."
    for make in (lambda: guard(index_bits=bits), lambda: emulate(index_bits=bits)):
        with pytest.raises(UsageError) as error, make():
            pass
        assert error.value.message == message
    with pytest.raises(UsageError, match="index_bits must be in 4..32"):
        install_thread_guard("raise", index_bits=bits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with emulate(index_bits=32), guard(index_bits=4):  # the ends of the range are fine
            pass


def test_the_api_says_what_the_cli_says():
    result = CliRunner().invoke(app, ["plan", "sentiment", "--index-bits", "40"])
    assert result.exit_code == 2
    with pytest.raises(UsageError) as error, emulate(index_bits=40):
        pass
    assert one_message(result.stderr) == "error: " + error.value.message.replace("index_bits", "--index-bits") \
        .replace("4..32", "8..32")  # the same words; the modes also take the narrow widths a test needs


def test_one_index_width_range():
    from mpsimpact.config import INDEX_BITS_RANGE as used_by_the_cli
    from mpsimpact.engine.faults import INDEX_BITS_RANGE, MODE_INDEX_BITS_RANGE

    assert INDEX_BITS_RANGE == used_by_the_cli == (8, 32) and MODE_INDEX_BITS_RANGE == (4, 32)
