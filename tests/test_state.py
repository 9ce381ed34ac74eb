"""State we keep, checked when read and claimed before work: the reference cache (damaged entries are
rebuilt with one line; an unusable cache folder is no cache), --out folders (checked and claimed before
any work; a second writer refused at once; stale claims and partial folders of killed writers taken
over), a truncated logits.npz in compare, and train-head's --limit and --out."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.errors import UsageError
from mpsimpact.output import files
from mpsimpact.output.files import (
    CLAIM_MARKER, claim_out_dir, claimed_out_dir, folder_written_atomically, fresh_out_dir, unclaim_out_dir,
)
from mpsimpact.runs import reference
from said import flat, messages, one_message

runner = CliRunner()
IS_ROOT = os.geteuid() == 0  # root writes into read-only folders: those cases cannot be made here
# P (16*12, 256, 256) at 2**23 wraps from batch-head 2**23 / 65536 = 128: text 10 of 16, so 6 texts are wrong.
SMALL = ["run", "sentiment", "--batch-size", "16", "--max-length", "256", "--index-bits", "23", "--guard", "off",
         "--torch-profile", "2.14.0"]  # 2.14.0: the P V wrap alone (2.13.0 aborts at the scale first)
DEAD_PID = 999_999_999  # above any pid_max: never a running process


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))


def invoke(args):
    result = runner.invoke(app, [str(a) for a in args])
    return result, flat(result.output + (result.stderr if result.stderr_bytes else ""))


def stderr_lines(capsys):
    return messages(capsys.readouterr().err)


# The reference cache.

LOGITS = np.arange(12, dtype=np.float32).reshape(4, 3) / 7  # 4 texts x 3 classes


def stored(key="k" * 24):
    assert reference.store_reference(key, LOGITS)
    return key, reference.entry_path(key)


def test_an_entry_carries_its_key_shape_dtype_and_checksum_and_reads_back_exactly(capsys):
    key, path = stored()
    data = path.read_bytes()
    header = json.loads(data[len(reference.MAGIC):data.index(b"\n", len(reference.MAGIC))])
    payload = LOGITS.tobytes()
    assert header == {"key": key, "shape": [4, 3], "dtype": "<f4", "bytes": 48,  # 4 * 3 * 4 bytes
                      "sha256": hashlib.sha256(payload).hexdigest()}
    assert data.endswith(payload)
    np.testing.assert_array_equal(reference.cached_reference(key, rows=4), LOGITS)
    assert capsys.readouterr().err == ""


def damage_nan_rows(path):  # the rows' bytes become NaN, the header is left as it was
    data = bytearray(path.read_bytes())
    data[-24:] = np.full(6, np.nan, dtype=np.float32).tobytes()  # the last 2 rows
    path.write_bytes(bytes(data))


def damage_nan_with_a_matching_checksum(path):  # written by something that recomputed the checksum
    path.write_bytes(reference.encode_entry(path.stem, np.full((4, 3), np.nan, dtype=np.float32)))


def damage_garbled(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def damage_wrong_shape(path):  # an array of another shape under this key, checksum and all
    data = path.read_bytes().replace(b'"shape": [4, 3]', b'"shape": [3, 4]')
    path.write_bytes(data)


def damage_another_width(path):  # rows of 5 values where this key's model gives 3, checksum and all
    rows = json.loads(path.read_bytes().split(b"\n")[1])["shape"][0]
    path.write_bytes(reference.encode_entry(path.stem, np.ones((rows, 5), dtype=np.float32)))


DAMAGES = {
    "nan rows": (damage_nan_rows, "is damaged (its sha256 does not match its data)"),
    "nan, checksum recomputed": (damage_nan_with_a_matching_checksum, "holds NaN or infinite values"),
    "garbled bytes": (damage_garbled, "is damaged (its sha256 does not match its data)"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-7]), "is truncated or padded (41 bytes of data; its shape [4, 3] needs 48)"),
    "emptied": (lambda p: p.write_bytes(b""), "is empty"),
    "bad header": (lambda p: p.write_bytes(p.read_bytes().replace(b'"shape"', b'"shap"')), "has a damaged header"),
    "no header (an old .npy)": (lambda p: np.save(p.with_suffix(".npy"), LOGITS) or p.with_suffix(".npy").rename(p),
                                "has no mpsimpact reference header (damaged, or written by an older mpsimpact)"),
    "wrong shape": (damage_wrong_shape, "has 3 rows, this run has 4 texts"),
    "another key": (lambda p: p.write_bytes(reference.encode_entry("x" * 24, LOGITS)), "holds the entry of another key (xxxxxxxxxxxxxxxxxxxxxxxx)"),
    "another width": (damage_another_width, "has shape [4, 5], where this key's texts and model give [4, 3] (another width)"),
    "deep header": (lambda p: p.write_bytes(reference.MAGIC + b"[" * 3000 + b"\n" + LOGITS.tobytes()), "has a damaged header"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_entry_is_one_warning_line_removed_and_recomputed(damage, capsys):
    key, path = stored()
    make, problem = DAMAGES[damage]
    make(path)
    assert reference.cached_reference(key, shape=(4, 3)) is None  # the caller recomputes
    assert stderr_lines(capsys) == [f"warning: the cached reference '{path}' {problem}; recomputing it."]
    assert not path.exists()
    assert reference.store_reference(key, LOGITS)  # and the rebuilt entry is good again
    np.testing.assert_array_equal(reference.cached_reference(key, shape=(4, 3)), LOGITS)


def test_a_folder_in_the_entrys_place_means_no_cache_for_this_key(capsys):
    key = "f" * 24
    path = reference.entry_path(key)
    (path / "inside").mkdir(parents=True)
    assert reference.cached_reference(key) is None and not reference.store_reference(key, LOGITS)
    assert stderr_lines(capsys) == [f"warning: the cached reference '{path}' is a folder, not a file; computing the "
                                    "reference without the cache (remove the folder to cache it again)."]
    assert (path / "inside").is_dir()  # not ours to delete


def test_a_file_in_the_cache_folders_place_means_no_cache_never_a_failure(tmp_path, monkeypatch, capsys):
    (tmp_path / "blocked").write_text("not a folder")
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "blocked"))
    assert reference.cached_reference("k" * 24) is None  # absent: nothing to say yet
    assert reference.store_reference("k" * 24, LOGITS) is False
    (line,) = stderr_lines(capsys)
    assert line.startswith(f"warning: the reference cache '{tmp_path / 'blocked' / 'reference'}' cannot be written (")
    assert line.endswith("); continuing without it.")


@pytest.mark.skipif(IS_ROOT, reason="root writes into read-only folders")
def test_a_read_only_cache_is_read_but_not_written(tmp_path, capsys):
    key, path = stored()
    path.parent.chmod(0o555)
    try:
        np.testing.assert_array_equal(reference.cached_reference(key), LOGITS)
        assert reference.store_reference("n" * 24, LOGITS) is False
        assert "cannot be written (Permission denied); continuing without it." in " ".join(messages(capsys.readouterr().err))
    finally:
        path.parent.chmod(0o755)


def test_store_removes_temporary_files_of_dead_writers_only(capsys):
    key, path = stored()
    dead = path.parent / f".{path.name}.{DEAD_PID}.abc123.partial"
    live = path.parent / f".{path.name}.{os.getpid()}.def456.partial"  # a writer that still runs: us
    dead.write_bytes(b"half")
    live.write_bytes(b"half")
    stored()
    assert not dead.exists() and live.exists()


def test_a_non_finite_reference_is_not_cached(capsys):
    assert reference.store_reference("n" * 24, np.full((2, 3), np.inf, dtype=np.float32)) is False
    assert stderr_lines(capsys) == ["warning: the reference holds NaN or infinite values; it is not cached."]


def corrupted_off(folder):
    off = json.loads((folder / "report.json").read_text())["conditions"][0]
    return off["corrupted_count"], off["first_corrupted_index"]


@pytest.mark.ci  # whole commands end to end: CI runs it after the default selection (pytest -m ci)
def test_a_damaged_cache_changes_no_result(tmp_path):
    """A reference cached once, then damaged two ways (values that would change the result if used, and
    another model's width): every rerun reports the same 6 texts from text 10. Each damage's warning and
    refusal is tested at the reader (test_a_damaged_entry_is_one_warning_line_removed_and_recomputed); a
    run recomputes on any refusal the same way."""
    result, text = invoke([*SMALL, "--out", tmp_path / "first"])
    assert result.exit_code == 0, text
    assert corrupted_off(tmp_path / "first") == (6, 10)
    (entry,) = (tmp_path / "cache" / "reference").glob("*.ref")
    for name in ("nan rows", "another width"):
        DAMAGES[name][0](entry)
        out = tmp_path / name.replace(" ", "-")
        result, text = invoke([*SMALL, "--out", out])
        assert result.exit_code == 0, text
        problem = DAMAGES[name][1].split(" (")[0].replace("[4, ", "[16, ")  # the sizes are this run's (16 texts)
        assert f"warning: the cached reference '{entry}' {problem}" in text and "; recomputing it." in text, name
        assert corrupted_off(out) == (6, 10), name
        assert json.loads((out / "report.json").read_text())["reference"]["cached"] is False
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]  # rebuilt; nothing temporary


# --out: checked before any work, claimed at the start.

def test_out_checks_name_the_problem(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    cases = {
        tmp_path / "file" / "sub": f"--out '{tmp_path / 'file' / 'sub'}': '{tmp_path / 'file'}' is a file, not a folder",
        tmp_path / "file": f"--out '{tmp_path / 'file'}' is a file, not a folder; pass another --out.",
        tmp_path / "full": "already exists and is not empty; pass another --out.",
        "": "--out must name a folder, got ''.",
    }
    for out, message in cases.items():
        with pytest.raises(UsageError, match=None) as error:
            fresh_out_dir(str(out), "run")
        assert message in error.value.message, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]  # checking created nothing


@pytest.mark.skipif(IS_ROOT, reason="root writes into read-only folders")
def test_a_read_only_parent_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(UsageError, match="cannot write in .* \\(permission denied\\)"):
        fresh_out_dir(str(tmp_path / "ro" / "out"), "run")


def test_a_full_disk_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: type("U", (), {"free": 3 << 20})())
    with pytest.raises(UsageError, match="is on a disk with 3 MiB free, and this command writes up to 16 MiB there; "
                                         "free some space or pass another --out."):
        fresh_out_dir(str(tmp_path / "out"), "run")


def test_a_file_to_write_later_is_checked_without_creating_its_folder(tmp_path):
    from mpsimpact.output.files import check_out_file

    missing = tmp_path / "nonexistent" / "dir" / "x.png"  # plan --figure made these folders
    with pytest.raises(UsageError, match=None) as error:
        check_out_file(missing, "--figure")
    assert error.value.message == (f"--figure '{missing}': '{missing.parent}' does not exist; create the folder first "
                                   "or pass another path.")
    with pytest.raises(UsageError, match="is a folder; pass a file name."):
        check_out_file(tmp_path, "--figure")
    with pytest.raises(UsageError, match="--figure must name a file, got ''."):
        check_out_file("", "--figure")
    assert check_out_file(tmp_path / "x.png", "--figure") == tmp_path / "x.png"
    assert os.listdir(tmp_path) == []


HEAVY = {  # command -> (args, the work that must not start)
    "run": (["run", "sentiment"], "mpsimpact.runs.runner.run_scenario"),
    "plan": (["plan", "sentiment"], "mpsimpact.prediction.plan.build_plan_report"),
    "check": (["check", "bert-base-uncased"], "mpsimpact.prediction.check.build_check_report"),
    "sweep": (["sweep", "--device", "cpu"], "mpsimpact.runs.cell.run_cells"),
    "compare": (["compare", "a", "b"], "mpsimpact.upgrade.compare.compare_folders"),
    "matrix": (["matrix", "sentiment"], "mpsimpact.upgrade.matrix.build_matrix"),
}


@pytest.mark.parametrize("command", HEAVY)
def test_out_under_a_file_exits_2_before_any_work(command, tmp_path, monkeypatch):
    args, work = HEAVY[command]
    module, name = work.rsplit(".", 1)
    monkeypatch.setattr(__import__(module, fromlist=[name]), name, lambda *a, **k: pytest.fail(f"{work} started"))
    (tmp_path / "file").write_text("x")
    result, text = invoke([*args, "--out", tmp_path / "file" / "out"])
    assert result.exit_code == 2, text
    assert one_message(result.stderr) == (f"error: --out '{tmp_path / 'file' / 'out'}': '{tmp_path / 'file'}' is a file, "
                                     "not a folder; pass another --out.")


CLAIMANT = """
import sys, time
from mpsimpact.output.files import claim_out_dir
claim_out_dir(sys.argv[1], "run")
print("claimed", flush=True)
time.sleep(60)
"""


def test_a_second_writer_is_refused_at_once_while_the_first_holds_the_claim(tmp_path):
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-c", CLAIMANT, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "claimed"
        assert sorted(os.listdir(out)) == [CLAIM_MARKER]  # the claim: the folder, empty but for the marker
        with pytest.raises(UsageError, match=f"is being written by another mpsimpact process \\(pid {first.pid}\\)"):
            claim_out_dir(str(out), "run")
        result, text = invoke(["plan", "sentiment", "--out", out])  # today's commands only check: refused too
        assert result.exit_code == 2 and f"(pid {first.pid}); wait for it to finish" in text
    finally:
        first.kill()
        first.wait()
    # SIGKILL leaves the marker, but its lock died with the process: the next writer takes the claim over.
    assert claim_out_dir(str(out), "run") == out
    unclaim_out_dir(out)
    assert not out.exists()  # the claim made (took over) the folder, and removed it unfilled


def test_a_claim_is_filled_by_the_atomic_rename_or_released(tmp_path):
    out = tmp_path / "out"
    with claimed_out_dir(str(out), "run") as folder:
        with pytest.raises(UsageError, match="being written by another command of this process"):
            claim_out_dir(str(out), "run")
        with folder_written_atomically(folder) as partial:
            (partial / "report.json").write_text("{}")
    assert sorted(os.listdir(out)) == ["report.json"]  # marker gone, files in
    failed = tmp_path / "failed"
    with pytest.raises(KeyboardInterrupt), claimed_out_dir(str(failed), "run") as folder:
        with folder_written_atomically(folder) as partial:
            (partial / "half").write_text("x")
            raise KeyboardInterrupt
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no folder, no partial, no claim left
    kept = tmp_path / "kept"
    kept.mkdir()  # an empty folder the user made is adopted, and left in place when released
    with claimed_out_dir(str(kept), "run"):
        pass
    assert kept.is_dir() and os.listdir(kept) == []


def test_stale_partial_folders_of_killed_writers_are_cleaned_by_the_next_writer(tmp_path):
    out = tmp_path / "out"
    dead = tmp_path / f".out.partial-{DEAD_PID}"  # left by a writer killed with SIGKILL
    (dead / "report.json").parent.mkdir()
    (dead / "report.json").write_text("{}")
    other = tmp_path / f".other.partial-{DEAD_PID}"  # another folder's: not this writer's business
    other.mkdir()
    with folder_written_atomically(out) as partial:
        (partial / "report.json").write_text("{}")
    assert sorted(os.listdir(tmp_path)) == [".other.partial-999999999", "out"]


def test_default_folders_of_one_second_do_not_collide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(files.time, "strftime", lambda fmt: "20250101-120000")
    first = claim_out_dir(None, "run")
    second = claim_out_dir(None, "run")
    assert (str(first), str(second)) == ("outputs/run-20250101-120000", "outputs/run-20250101-120000-2")
    unclaim_out_dir(first)
    unclaim_out_dir(second)


def test_two_commands_on_one_out_give_one_report_and_one_exit_2(tmp_path, monkeypatch):
    import mpsimpact.prediction.plan as plan

    out, inner = tmp_path / "out", {}
    real = plan.build_plan_report

    def with_a_second_writer(*args, **kwargs):  # while the first computes, a second run on the same --out
        if not inner:
            inner["result"] = None
            inner["result"] = invoke(["plan", "sentiment", "--out", out])
        return real(*args, **kwargs)

    monkeypatch.setattr(plan, "build_plan_report", with_a_second_writer)
    result, text = invoke(["plan", "sentiment", "--out", out])
    second, second_text = inner["result"]
    assert second.exit_code == 2 and "is being written by another" in second_text
    assert result.exit_code == 0, text
    assert (out / "plan.json").is_file()


# compare: a damaged logits.npz is one line, exit 2.

def test_a_truncated_or_misshapen_logits_npz_is_one_line(tmp_path):
    from mpsimpact.runs.classify_kind import ClassifyKind
    from mpsimpact.upgrade.folders import FolderFiles

    def _corrupted_from_logits(path, report):
        return ClassifyKind().read_positions(path.name, report, FolderFiles(path.parent))

    report = {"conditions": [{"guard": "off"}], "config": {"threshold": 1e-3}}
    path = tmp_path / "logits.npz"
    np.savez(path, reference=np.ones((8, 3)), guard_off=np.ones((8, 3)))
    whole = path.read_bytes()
    for damaged in (whole[: len(whole) // 2], whole[:-30], b"PK\x03\x04garbage"):
        path.write_bytes(damaged)
        with pytest.raises(UsageError, match="it is damaged or truncated: rerun `mpsimpact run` for this folder"):
            _corrupted_from_logits(path, report)
    np.savez(path, reference=np.ones((8, 3)), guard_off=np.ones((7, 3)))
    with pytest.raises(UsageError, match=r"'guard_off' has shape \[7, 3\], the reference \[8, 3\]"):
        _corrupted_from_logits(path, report)


# train-head

def test_the_first_training_texts_share_one_label_and_the_limit_keeps_every_label():
    from mpsimpact.models.dataset import load_embedded
    from mpsimpact.runs.head import first_texts_with_every_label

    train = load_embedded("train")
    assert set(train.labels[:5]) == {0}  # the first 5 in sha256 order are all negative: what crashed
    small = first_texts_with_every_label(train, 5)
    first_neutral, first_positive = train.labels.index(1), train.labels.index(2)
    # 5 first texts, the last two negatives replaced by the first neutral and the first positive text
    picked = sorted([0, 1, 2, first_neutral, first_positive])
    assert small.texts == tuple(train.texts[i] for i in picked)
    assert sorted(small.labels) == [0, 0, 0, 1, 2]
    assert first_texts_with_every_label(train, 200).texts == train.texts[:200]  # all three among the first 200


def test_train_head_with_a_limit_of_5_trains_a_three_class_head(tmp_path):
    out = tmp_path / "head"
    result, text = invoke(["train-head", "--limit", "5", "--out", out])
    assert result.exit_code == 0, text
    with np.load(out / "sentiment_head.npz") as arrays:
        assert arrays["weight"].shape == (3, 384)  # a row per label, as the classifier loads it
    assert json.loads((out / "sentiment_head.json").read_text())["train_texts"] == 5


def test_train_head_refuses_too_small_a_limit_and_an_unwritable_out_before_any_work(tmp_path, monkeypatch):
    import mpsimpact.runs.head as head

    monkeypatch.setattr(head, "load_embedded_classifier", lambda **k: pytest.fail("the model was loaded"))
    result, text = invoke(["train-head", "--limit", "2", "--out", tmp_path / "head"])
    assert result.exit_code == 2
    assert one_message(result.stderr) == "error: --limit must be >= 3 (one training text per label: negative, neutral, positive), got 2."
    (tmp_path / "file").write_text("x")
    result, text = invoke(["train-head", "--limit", "5", "--out", tmp_path / "file" / "head"])
    assert result.exit_code == 2 and "'" + str(tmp_path / "file") + "' is a file, not a folder" in flat(result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]



def test_an_embedders_reference_is_read_back_from_the_cache_without_a_warning(monkeypatch, capsys):
    # An embedder has no labels: its entry's width is the embedding's, which the labels cannot tell.
    import torch

    from mpsimpact.models.classifier import LoadedModel

    vectors = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
    computed = []
    monkeypatch.setattr(reference, "run_chunked", lambda *args, **kwargs: computed.append(1) or vectors)
    model = LoadedModel(torch.nn.Linear(6, 6), None, None, (), "tiny", 64)
    texts = ["a", "b", "c", "d"]
    assert reference.reference_logits(model, texts, 16)[1] is False
    logits, cached = reference.reference_logits(model, texts, 16)
    assert cached and computed == [1] and "warning" not in capsys.readouterr().err
    np.testing.assert_array_equal(logits, vectors)
