"""`mpsimpact matrix`: the probe's JSON contract on the installed transformers, the overlay cache with
a fake builder (marker written last, interrupted builds not reused, failures as rows, offline), the
uv builder's choice of packages, the CLI's bad inputs, and one real overlay built from the package
index (marked `network`, skipped with the reason when the index cannot be reached)."""

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from mpsimpact.upgrade import overlay
from mpsimpact.upgrade import probe as matrix_probe
from mpsimpact.cli import app
from mpsimpact.config import MatrixConfig
from mpsimpact.upgrade.matrix import build_matrix, probe_job
from mpsimpact.upgrade.overlay import (
    MARKER,
    OverlayCache,
    OverlayError,
    UvBuilder,
    probe_environment,
)
from said import one_message

runner = CliRunner()
# all-MiniLM-L6-v2 at 4096 x 512: P is (4096 * 12, 512, 512); it wraps from batch-head
# ceil(2**32 / 512**2) = 16384, text 16384 // 12 = 1365 (head 4), so 4096 - 1365 = 2731 texts are wrong.
FIRST_WRONG, WRONG = 1365, 2731
INSTALLED = transformers.__version__


@pytest.fixture(scope="module")
def job():
    return probe_job(MatrixConfig("sentiment", batch_size=4096, max_length=512))


@pytest.fixture(scope="module")
def probed(job):
    return matrix_probe.probe(job)


def test_probe_reports_attention_calls_outcomes_and_the_guard_on_the_installed_transformers(probed):
    assert probed["schema"] == matrix_probe.PROBE_SCHEMA
    assert probed["versions"]["transformers"] == INSTALLED and probed["paths"]["torch"] == torch.__file__
    assert probed["default_attention"] == "sdpa"  # BERT's default since 4.41
    eager = probed["implementations"]["eager"]
    assert eager["gets"] == "eager" and eager["runs"] == "eager"
    p_v = [e for e in eager["op_path"] if e["op"] == "bmm" and e["a"]["shape"] == [4096 * 12, 512, 512]]
    assert p_v == [{"op": "bmm", "module": "encoder.layer.*.attention.self", "a": {"shape": [49152, 512, 512], "layout": "contiguous"},
                    "b": {"shape": [49152, 512, 32], "layout": "contiguous"}, "within_sdpa": False, "count": 6}]
    assert eager["outcomes"]["2.13.0"]["outcome"] == "abort"  # the scale of the scores (inferred SIGSEGV)
    for profile, outcome in eager["outcomes"].items():
        if profile in ("2.13.0", "conservative"):  # the scale on the 6.4e9 scores aborts first (inferred)
            assert (outcome["outcome"], outcome["first_corrupted_text"]) == ("abort", None), profile
            continue
        assert (outcome["first_corrupted_text"], outcome["first_corrupted_head"], outcome["corrupted_count"]) == (FIRST_WRONG, 4, WRONG), profile
    sdpa = probed["implementations"]["sdpa"]["outcomes"]
    # Fused SDPA: wrong above 2**32 score elements up to 2.12.1, correct from 2.13.0; 2.4.1 runs its math path.
    # On 2.13.0 the FFN's GELU on 4096 * 512 * 1536 = 3,221,225,472 elements (between 2**31 and 2**32) is a
    # case nobody measured: unmeasured, not clean.
    assert [sdpa[p]["outcome"] for p in ("2.4.1", "2.12.1", "2.13.0", "2.14.0")] == [
        "wrong", "wrong_other", "unmeasured", "clean"]
    # transformers 4.41 .. 4.57 fall back to eager for output_attentions=True; 5.x keeps SDPA.
    expected = "eager" if int(INSTALLED.split(".")[0]) < 5 else "sdpa"
    assert probed["implementations"]["default, output_attentions"]["runs"] == expected
    json.dumps(probed)  # the contract is JSON


def test_probe_tiny_emulated_run_faults_stops_and_splits(probed):
    runs = probed["emulated"]["runs"]
    assert runs["default"]["attention"] == "sdpa" and runs["eager"]["attention"] == "eager"
    eager = runs["eager"]
    # P (24 * 4, 32, 32) wraps from batch-head ceil(2**16 / 32**2) = 64: texts 16 .. 23 are wrong.
    assert (eager["off"]["status"], eager["off"]["first_corrupted_text"], eager["off"]["corrupted_count"]) == ("corrupted", 16, 8)
    assert runs["default"]["off"]["status"] == "not_emulated"  # fused SDPA on 2.12.1: wrong, values never invented
    for run in runs.values():
        assert run["raise"]["status"] == "stopped" and "OversizedOpError" in run["raise"]["message"]
        assert run["chunk"]["status"] == "equal" and run["chunk"]["chunked_calls"] == 2 and run["chunk"]["emulator_records"] == 0
        assert run["guard_ok"] is True


def test_probe_subprocess_puts_the_overlay_first_and_reports_import_errors(tmp_path, job):
    broken = tmp_path / "overlay" / "transformers"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    with pytest.raises(OverlayError, match=r"^ImportError: broken on purpose$"):
        probe_environment(tmp_path / "overlay", job)


class FakeBuilder:
    """Writes a transformers package stub; fails or is interrupted when asked."""

    def __init__(self, fail=None):
        self.calls = []
        self.fail = fail

    def __call__(self, version, target):
        self.calls.append(version)
        (target / "transformers").mkdir()
        (target / "transformers" / "__init__.py").write_text(f"__version__ = {version!r}\n")
        if self.fail is not None:
            raise self.fail
        return {"installed": [f"transformers=={version}"], "reused": {}}


def test_a_built_overlay_is_marked_last_and_reused_from_the_cache(tmp_path):
    builder = FakeBuilder()
    cache = OverlayCache(tmp_path, builder)
    first = cache.ensure("4.57.6")
    second = cache.ensure("4.57.6", offline=True)
    assert builder.calls == ["4.57.6"]
    assert (first.cached, second.cached) == (False, True) and first.path == second.path
    marker = json.loads((first.path / MARKER).read_text())
    assert marker["installed"] == ["transformers==4.57.6"] and marker["python"] == overlay.python_tag()
    assert [p.name for p in tmp_path.iterdir() if p.suffix != ".lock"] == [first.path.name]  # no partial folder left


@pytest.mark.parametrize("interruption", [KeyboardInterrupt(), OverlayError("disk full")])
def test_an_interrupted_build_is_not_reused(tmp_path, interruption):
    cache = OverlayCache(tmp_path, FakeBuilder(fail=interruption))
    with pytest.raises(type(interruption)):
        cache.ensure("4.44.2")
    assert [p for p in tmp_path.iterdir() if p.suffix != ".lock"] == [] and cache.read_marker("4.44.2") is None
    builder = FakeBuilder()
    assert OverlayCache(tmp_path, builder).ensure("4.44.2").cached is False and builder.calls == ["4.44.2"]


def test_a_folder_without_marker_or_left_by_a_killed_build_is_rebuilt(tmp_path):
    cache = OverlayCache(tmp_path, FakeBuilder())
    final = cache.path_for("4.44.2")
    (final / "transformers").mkdir(parents=True)  # files, but the marker was never written
    dead = tmp_path / f".{final.name}.partial-999999999"  # a pid that does not run
    dead.mkdir()
    assert cache.read_marker("4.44.2") is None
    assert cache.ensure("4.44.2").cached is False
    assert not dead.exists() and (final / MARKER).is_file()


def test_a_stale_overlay_is_rebuilt_online_and_reported_offline(tmp_path):
    builder = FakeBuilder()
    cache = OverlayCache(tmp_path, builder)
    path = cache.ensure("4.44.2").path
    marker = json.loads((path / MARKER).read_text()) | {"reused": {"numpy": "0.0.1"}}
    (path / MARKER).write_text(json.dumps(marker))
    with pytest.raises(OverlayError, match=r"stale \(numpy 0\.0\.1 is now .* in the running environment\)"):
        cache.ensure("4.44.2", offline=True)
    assert cache.ensure("4.44.2").cached is False and builder.calls == ["4.44.2", "4.44.2"]


def fake_prober(result):
    def probe(path, job):
        version = (Path(path) / "transformers" / "__init__.py").read_text().split("'")[1]
        return json.loads(json.dumps(result)) | {"versions": result["versions"] | {"transformers": version}}

    return probe


def test_a_failing_install_is_a_row_with_the_reason_and_the_rest_are_probed(tmp_path, probed):
    reason = "No solution found when resolving dependencies: Because there is no version of transformers==4.99.1 (...)"

    class PartlyFailing(FakeBuilder):
        def __call__(self, version, target):
            if version == "4.99.1":
                raise OverlayError(reason)
            return super().__call__(version, target)

    config = MatrixConfig("sentiment", ("4.57.6", "4.99.1"), batch_size=4096, max_length=512)
    report = build_matrix(config, cache=OverlayCache(tmp_path, PartlyFailing()), prober=fake_prober(probed))
    ok, failed = report["rows"]
    assert ok["status"] == "probed" and ok["findings"]["eager_first_corrupted_text"] == FIRST_WRONG and ok["findings"]["guard_ok"]
    assert set(ok["timing"]) == {"build_s", "probe_s"}
    assert (failed["status"], failed["reason"]) == ("failed", reason) and report["all_ok"] is False
    assert report["config"]["transformers"] == ["4.57.6", "4.99.1"] and report["config"]["batch_size"] == 4096


def test_offline_uses_only_cached_environments_and_names_the_missing(tmp_path, probed, monkeypatch):
    cache = OverlayCache(tmp_path, FakeBuilder())
    cache.ensure("4.57.6")
    monkeypatch.setenv("UV_OFFLINE", "1")  # the package-index switch makes --offline automatic
    report = build_matrix(MatrixConfig("sentiment", ("4.57.6", "4.44.2"), batch_size=4096), cache=cache, prober=fake_prober(probed))
    cached, missing = report["rows"]
    assert report["offline"] is True and cached["status"] == "probed" and cached["cached"] is True
    assert missing["status"] == "missing" and "transformers 4.44.2: not in the cache" in missing["reason"]


def test_uv_builder_installs_only_what_differs_from_the_running_interpreter_and_never_torch(tmp_path, monkeypatch):
    running = overlay.installed_distributions()
    commands = []

    def fake_uv(command, timeout):
        commands.append(command)
        if command[2] == "compile":  # the output file holds the running versions as preferences
            preferences = Path(command[command.index("-o") + 1])
            assert f"numpy=={running['numpy']}" in preferences.read_text().splitlines()
            preferences.write_text(f"transformers==4.44.2\ntokenizers==0.0.1\nnumpy=={running['numpy']}\ntorch==9.9.9\n")
        return ""

    monkeypatch.setattr(overlay, "_run", fake_uv)
    details = UvBuilder()("4.44.2", tmp_path)
    assert details == {"installed": ["transformers==4.44.2", "tokenizers==0.0.1"], "reused": {"numpy": running["numpy"]},
                       "excluded": ["torch==9.9.9"]}
    install = commands[-1]
    assert install[2:4] == ["install", "--target"] and "--no-deps" in install and install[-2:] == ["transformers==4.44.2", "tokenizers==0.0.1"]


def test_the_running_transformers_needs_no_install(tmp_path, monkeypatch):
    monkeypatch.setattr(overlay, "_run", lambda *a: pytest.fail("no uv call expected"))
    assert UvBuilder()(INSTALLED, tmp_path) == {"installed": [], "reused": {"transformers": INSTALLED}, "excluded": []}


def invoke(args, env=None):
    result = runner.invoke(app, args, env={"COLUMNS": "200", **(env or {})})
    return result, result.stderr if result.stderr_bytes else result.output


@pytest.mark.parametrize("args, message", [
    (["--transformers", "4.44.2,,5.24.0"], "--transformers: '' is not a release; give a comma-separated list of transformers releases"),
    (["--transformers", "latest"], "--transformers: 'latest' is not a release"),
    (["--transformers", "4.44.2,4.44.2"], "--transformers: 4.44.2 given twice"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0."),
    (["--max-length", "600"], "--max-length 600 exceeds the model's 512 positions."),
])
def test_bad_inputs_exit_2_with_one_line(args, message, tmp_path):
    result, err = invoke(["matrix", "sentiment", *args, "--out", str(tmp_path / "out")], env={"MPSIMPACT_CACHE": str(tmp_path)})
    assert result.exit_code == 2, err
    assert one_message(err).startswith(f"error: {message}"), err


def test_unknown_scenario_and_a_used_folder_exit_2(tmp_path):
    result, err = invoke(["matrix", "sentimnet"])
    assert result.exit_code == 2 and "Unknown scenario 'sentimnet'. Did you mean 'sentiment'?" in err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    result, err = invoke(["matrix", "sentiment", "--out", str(tmp_path / "used")])
    assert result.exit_code == 2 and "already exists and is not empty" in err


@pytest.mark.ci  # fresh processes: CI runs it after the default selection (pytest -m ci)
def test_cli_probes_the_running_transformers_and_writes_the_folder(tmp_path):
    out = tmp_path / "out"
    result, text = invoke(["matrix", "sentiment", "--transformers", INSTALLED, "--batch-size", "4096", "--out", str(out)],
                          env={"MPSIMPACT_CACHE": str(tmp_path / "cache")})
    assert result.exit_code == 0, text
    assert sorted(p.name for p in out.iterdir()) == ["matrix.html", "matrix.json", "matrix.md", "matrix.png"]
    report = json.loads((out / "matrix.json").read_text())
    row = report["rows"][0]
    assert row["findings"]["eager_first_corrupted_text"] == FIRST_WRONG and row["findings"]["guard_ok"] is True
    assert row["overlay"]["installed"] == [] and row["timing"]["probe_s"] > 0
    assert report["config"]["transformers"] == [INSTALLED] and "data:image/png;base64," in (out / "matrix.html").read_text()
    assert f"| {INSTALLED} | built (0 packages differ) |" in (out / "matrix.md").read_text()


def test_cli_offline_names_the_missing_environment_and_exits_1(tmp_path):
    out = tmp_path / "out"
    result, _ = invoke(["matrix", "sentiment", "--transformers", "4.44.2", "--offline", "--out", str(out)],
                       env={"MPSIMPACT_CACHE": str(tmp_path / "cache")})
    assert result.exit_code == 1
    assert re.search(r"transformers 4\.44\.2: missing: transformers 4\.44\.2: not in the cache", result.output.replace("\n", " "))
    assert json.loads((out / "matrix.json").read_text())["rows"][0]["status"] == "missing"


NETWORK_ERROR = re.compile(r"Request failed|Failed to fetch|connect|dns|timed out|unreachable|took longer", re.IGNORECASE)


@pytest.mark.network
def test_a_real_overlay_for_transformers_4_57_is_built_cached_and_probed(job, monkeypatch):
    monkeypatch.setenv("UV_HTTP_TIMEOUT", "20")
    try:
        overlay.uv_executable()
    except OverlayError as error:
        pytest.skip(str(error))
    # Kept across runs on this machine, so a second run reuses it.
    cache = OverlayCache(Path(tempfile.gettempdir()) / "mpsimpact-test-overlays")
    try:
        built = cache.ensure("4.57.6")
    except OverlayError as error:
        if NETWORK_ERROR.search(error.message):
            pytest.skip(f"the package index cannot be reached: {error.message}")
        raise
    assert not (built.path / "torch").exists() and "transformers==4.57.6" in built.marker["installed"]
    assert cache.ensure("4.57.6", offline=True).cached is True
    result = probe_environment(built.path, job)
    assert result["versions"]["transformers"] == "4.57.6"
    assert os.path.samefile(result["paths"]["torch"], torch.__file__)
    assert result["default_attention"] == "sdpa" and result["implementations"]["default, output_attentions"]["runs"] == "eager"
    outcomes = result["implementations"]["eager"]["outcomes"].values()
    assert {o["first_corrupted_text"] for o in outcomes if o["outcome"] == "wrong"} == {FIRST_WRONG}
    assert all(run["guard_ok"] for run in result["emulated"]["runs"].values())


def test_neighbouring_release_groups_with_the_same_outcomes_share_a_column():
    from mpsimpact.reports.matrix import merged_columns

    groups = ["2.4.1", "2.9.1", "2.10.0-2.12.1", "2.13.0", "unmeasured newer", "2.15.0 (file)"]
    outcomes = ["wrong", "abort", "abort", "clean", "clean", "clean"]
    columns = [{"profile": f"p{i}", "group": g} for i, g in enumerate(groups)]
    cells = {a: {f"p{i}": {"outcome": o} for i, o in enumerate(outcomes)} for a in ("eager", "sdpa")}
    report = {"columns": columns, "rows": [{"status": "probed", "cells": cells}, {"status": "missing"}]}
    # 2.9.1 and 2.10.0-2.12.1 agree everywhere: one column, as `plan --versions` merges them; 2.13.0 agrees
    # with the unmeasured newer releases and the file profile, which are never merged.
    assert [(c["group"], c["profile"]) for c in merged_columns(report)] == [
        ("2.4.1", "p0"), ("2.9.1-2.12.1", "p1"), ("2.13.0", "p3"), ("unmeasured newer", "p4"),
        ("2.15.0 (file)", "p5")]
    cells["sdpa"]["p2"] = {"outcome": "wrong_other"}
    assert [c["group"] for c in merged_columns(report)][1:3] == ["2.9.1", "2.10.0-2.12.1"]


def test_the_console_view_fits_80_columns_and_names_the_release_judged(tmp_path, probed, monkeypatch, capsys):
    from mpsimpact.reports.matrix import print_matrix

    monkeypatch.setattr(torch, "__version__", "2.13.0")
    config = MatrixConfig("sentiment", ("4.57.6",), batch_size=4096, max_length=512)
    report = build_matrix(config, cache=OverlayCache(tmp_path, FakeBuilder()), prober=fake_prober(probed))
    monkeypatch.setenv("COLUMNS", "80")
    print_matrix(report)
    out = capsys.readouterr().out
    assert not [line for line in out.splitlines() if len(line) > 80], out
    said = " ".join(out.split())
    if not torch.backends.mps.is_available():
        assert "Judged as torch 2.14.0, a release measured on Macs where the bug is silent" in said
        assert "On a Mac, the installed torch 2.13.0: its column (2.13.0) below says" in said
        assert "2.14.0 (judged)" in said and "2.13.0 (installed)" in said
    for word in ("not_emulated", "stopped_by_guard", "(1 calls)"):
        assert word not in out
