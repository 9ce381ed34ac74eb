"""Nothing lost, part four (issue #59), the state mpsimpact keeps and reads: the cache folder where the README
says or nowhere (a HOME that is empty, relative, missing or holds a control character is refused, naming
MPSIMPACT_CACHE); a sweep row whose write fails part-way leaves nothing half-written and a resume that drops a
damaged line says so; a config holds what JSON allows; a model without a pad token is planned as it is checked;
a claim of --out that ends unfilled removes the folders it made."""

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from interrupted import interrupted_sweep
from mpsimpact.cli import app
from mpsimpact.errors import DiskFullError
from said import messages, one_message

runner = CliRunner()
BERT = Path(__file__).parent / "data" / "bert-base"


def refused(args: list, env: dict | None = None) -> str:
    result = runner.invoke(app, [str(a) for a in args], env=env)
    assert result.exit_code == 2, (args, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return one_message(result.stderr)


# The cache folder: where the README says ($MPSIMPACT_CACHE, $XDG_CACHE_HOME/mpsimpact, ~/.cache/mpsimpact), and
# nothing made outside it.

NO_CACHE_VARIABLES = {"MPSIMPACT_CACHE": None, "XDG_CACHE_HOME": None}
HOMES = {"empty": ("", "is empty"), "relative": ("rel/home", "is a relative path"),
         "dot": (".", "is a relative path"),
         "tilde": ("~", "is a relative path"), "missing": ("{tmp}/nonexistent/x", "does not exist"),
         "a file": ("{tmp}/file", "is not a folder"), "a device": ("/dev/null", "is not a folder"),
         "newline": ("{tmp}/a\nb", "holds a control character (\\n)"),
         "tab": ("{tmp}/a\tb", "holds a control character (\\t)")}


@pytest.mark.parametrize("case", sorted(HOMES))
@pytest.mark.parametrize("words", [["plan", "sentiment"], ["check", str(BERT)], ["run", "sentiment", "--quick"],
                                   ["sweep"], ["doctor"], ["list"], ["matrix", "sentiment"]])
def test_a_home_that_cannot_hold_the_cache_is_one_line_naming_mpsimpact_cache(tmp_path, monkeypatch, case, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("a file, not a folder")
    home, problem = HOMES[case]
    home = home.format(tmp=tmp_path)
    before = sorted(os.listdir(tmp_path)), os.path.exists("/.cache/mpsimpact")
    said = refused(words, env=NO_CACHE_VARIABLES | {"HOME": home})
    shown = home if len(home) <= 80 else f"{home[:60]}… ({len(home):,} characters)"  # a long value, cut
    assert said.startswith(f"error: HOME={shown!r} {problem}") and "set MPSIMPACT_CACHE to the folder" in said, said
    assert (sorted(os.listdir(tmp_path)), os.path.exists("/.cache/mpsimpact")) == before  # nothing made anywhere
    assert not (tmp_path / "nonexistent").exists()


def test_an_xdg_cache_home_that_does_not_exist_is_refused_and_a_relative_one_ignored(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = refused(["plan", "sentiment"], env={"MPSIMPACT_CACHE": None, "XDG_CACHE_HOME": str(tmp_path / "no" / "x"),
                                               "HOME": str(tmp_path)})
    assert said.startswith(f"error: XDG_CACHE_HOME='{tmp_path}/no/x' does not exist") and "MPSIMPACT_CACHE" in said
    assert os.listdir(tmp_path) == []


def test_a_home_that_exists_holds_the_cache_where_the_readme_says(tmp_path, monkeypatch):
    from mpsimpact.engine.release import cache_root

    for name in ("MPSIMPACT_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "mpsimpact" and os.listdir(tmp_path) == []  # made when written
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # ignored, as the XDG specification says
    assert cache_root() == tmp_path / ".cache" / "mpsimpact"
    monkeypatch.setenv("MPSIMPACT_CACHE", "anywhere\nat all")
    with pytest.raises(Exception, match=r"MPSIMPACT_CACHE='anywhere\\nat all' holds a control character"):
        cache_root()


# A sweep row whose write fails part-way: cut back, nothing half-written; a resume that drops a line says so.

def half_then(error: BaseException):
    """An os.write that writes half of what it is given, then fails with `error` on the next call."""
    real, calls = os.write, []

    def write(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, bytes(data[: len(data) // 2]))
        raise error

    return write


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
                         ids=["full disk", "ctrl-c"])
def test_a_row_whose_write_fails_part_way_leaves_nothing_half_written(tmp_path, monkeypatch, error):
    import mpsimpact.output.resumable as resumable

    with pytest.raises(KeyboardInterrupt), resumable.resumable_folder(tmp_path / "out", {"w": 1}, "rows.jsonl") as f:
        f.append({"n": 1})
        raise KeyboardInterrupt
    log = tmp_path / ".out.partial" / "rows.jsonl"
    kept = log.read_bytes()
    folder = resumable.ResumableFolder(log.parent, "rows.jsonl")
    monkeypatch.setattr(resumable.os, "write", half_then(error))
    with pytest.raises(DiskFullError if isinstance(error, OSError) else KeyboardInterrupt) as raised:
        folder.append({"n": 2, "text": "x" * 500})
    monkeypatch.undo()
    assert log.read_bytes() == kept and folder.items == [{"n": 1}]  # the half line is gone
    if isinstance(error, OSError):
        assert "Nothing was left half-written" in raised.value.message
    again = resumable.ResumableFolder(log.parent, "rows.jsonl")
    assert (again.items, again.damaged) == ([{"n": 1}], [])


def test_a_resume_that_drops_a_cut_line_says_so_in_one_warning(tmp_path, monkeypatch):
    small = ["sweep", "--device", "cpu", "--emulate", "--torch-profile", "2.13.0", "--index-bits", "16",
             "--dtypes", "fp32", "--layouts", "contiguous"]
    partial = interrupted_sweep(small, tmp_path, monkeypatch, after=4)
    with open(partial / "sweep.jsonl", "a") as log:
        log.write('{"cell": {"m": 256, "k"')  # what a kill or a full disk in the middle of a row leaves
    result = runner.invoke(app, [*small, "--out", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    warnings = [m for m in messages(result.stderr) if m.startswith("warning:")]
    assert len(warnings) == 1 and "1 of sweep.jsonl (line 5: cut short" in warnings[0], result.stderr
    rows = [json.loads(line) for line in (tmp_path / "s" / "sweep.jsonl").read_text().splitlines()]
    assert len(rows) == json.loads((tmp_path / "s" / "summary.json").read_text())["cells"]


# A config holds what JSON allows (NaN, infinities and lone surrogates are refused, as a dataset's are).

def config_with(tmp_path: Path, text: str) -> Path:
    folder = tmp_path / "cfg"
    folder.mkdir()
    bert = (BERT / "config.json").read_text().rstrip().rstrip("}")
    (folder / "config.json").write_text(f"{bert}, {text}}}")
    return folder


@pytest.mark.parametrize(("field", "words"), [
    ('"notes": NaN', "notes is NaN, which JSON does not allow"),
    ('"notes": 1e400', "notes is Infinity (or a number past a float's range, as 1e400), which JSON does not allow"),
    ('"notes": -Infinity', "notes is -Infinity"),
    ('"notes": {"deep": [1, NaN]}', "notes.deep[1] is NaN"),
    ('"notes": "a\\udcffb"', "notes holds text that is not valid Unicode (a lone surrogate \\udcff at character 2)"),
    ('"a\\ud800b": 1', "a\\ud800b holds text that is not valid Unicode (a lone surrogate \\ud800"),
    ('"model_type": "bert", "hidden_act": "gelu\\udcff"', "hidden_act holds text that is not valid Unicode"),
    ('"layer_norm_eps": NaN', "layer_norm_eps is NaN")])
def test_a_config_value_json_does_not_allow_is_one_line_naming_the_field(tmp_path, monkeypatch, field, words):
    monkeypatch.chdir(tmp_path)
    folder = config_with(tmp_path, field)
    said = refused(["check", folder, "--out", "r"])
    assert said.startswith(f"error: '{folder / 'config.json'}': {words}"), said
    assert os.listdir(tmp_path) == ["cfg"]


def test_a_declared_field_may_hold_infinity_as_transformers_writes_it():
    from transformers import CONFIG_MAPPING

    from mpsimpact.prediction.meta_model import check_config_values

    check_config_values({"model_type": "mamba2", "time_step_limit": [0.0, float("inf")]}, CONFIG_MAPPING["mamba2"],
                        Path("c.json"))
    check_config_values({"model_type": "bert", "layer_norm_eps": float("inf")}, CONFIG_MAPPING["bert"], Path("c"))
    with pytest.raises(Exception, match="time_step_limit_typo"):
        check_config_values({"time_step_limit_typo": [0.0, float("inf")]}, CONFIG_MAPPING["mamba2"], Path("c.json"))
    # a sub-config is held to its own class's fields: declared there, or not
    llava = {"model_type": "llava", "text_config": {"model_type": "llama", "rms_norm_eps": float("inf")}}
    check_config_values(llava, CONFIG_MAPPING["llava"], Path("c.json"))
    llava["text_config"]["not_a_llama_field"] = float("-inf")
    with pytest.raises(Exception, match=r"'c.json': text_config.not_a_llama_field is -Infinity"):
        check_config_values(llava, CONFIG_MAPPING["llava"], Path("c.json"))
    with pytest.raises(Exception, match=r"vision_config.x\[0\] is NaN"):
        check_config_values({"vision_config": {"model_type": "clip_vision_model", "x": [float("nan")]}},
                            CONFIG_MAPPING["llava"], Path("c.json"))


# A model without a pad token: plan traces it as check does, and both say what the trace assumed.

def mistral_without_pad(tmp_path: Path) -> Path:
    """A Mistral-7B-shaped config.json, small, and like Mistral's without pad_token_id."""
    folder = tmp_path / "mistral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
        "max_position_embeddings": 512, "vocab_size": 1000, "bos_token_id": 1, "eos_token_id": 2,
        "rms_norm_eps": 1e-05, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return folder


PADDING = "pad_token_id unset in the config, traced as 999 (the head pools the last token)"


def test_plan_traces_a_model_without_a_pad_token_and_says_so(tmp_path):
    folder = mistral_without_pad(tmp_path)
    before = (folder / "config.json").read_bytes()
    result = runner.invoke(app, ["plan", "sentiment", "--model", str(folder), "--batch-size", "1", "--max-length",
                                 "128", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    assert report["padding"] == PADDING and report["largest_safe_batch"] > 1  # traced at 2 and 4 texts
    result = runner.invoke(app, ["plan", "sentiment", "--model", str(folder), "--batch-size", "8", "--max-length",
                                 "64"])
    assert result.exit_code == 0 and PADDING in " ".join(result.stdout.split())
    check = runner.invoke(app, ["check", str(folder), "--task", "sequence-classification", "--batch-size", "2",
                                "--seq-len", "64", "--json"])
    assert check.exit_code == 0 and json.loads(check.stdout)["model"]["padding"] == PADDING  # one path, one sentence
    assert (folder / "config.json").read_bytes() == before


def test_the_callers_config_is_left_as_it_was():
    from transformers import AutoModelForSequenceClassification, MistralConfig

    from mpsimpact.prediction.meta_model import pad_for_the_head

    config = MistralConfig(vocab_size=1000)
    config.pad_token_id = None
    padded, words = pad_for_the_head(config, AutoModelForSequenceClassification)
    assert (config.pad_token_id, padded.pad_token_id, words) == (None, 999, PADDING)
    assert pad_for_the_head(padded, AutoModelForSequenceClassification) == (padded, "")


# A claim of --out given back unfilled removes the folders it made above --out too.

def test_a_refused_run_leaves_no_folder_above_its_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def fails(*args, **kwargs):
        from mpsimpact.errors import UsageError

        raise UsageError("refused after the claim")

    monkeypatch.setattr("mpsimpact.runs.runner.run_scenario", fails)
    said = refused(["run", "sentiment", "--quick", "--out", "deep/er/k"])
    assert said == "error: refused after the claim" and os.listdir(tmp_path) == []
    (tmp_path / "kept").mkdir()
    refused(["run", "sentiment", "--quick", "--out", "kept/er/k"])
    assert os.listdir(tmp_path) == ["kept"] and os.listdir(tmp_path / "kept") == []
