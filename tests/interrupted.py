"""A sweep interrupted part-way, as a killed terminal leaves it: the resume tests' starting point."""

from pathlib import Path

from typer.testing import CliRunner

import mpsimpact.runs.cell as cell_module
from mpsimpact.cli import app


def interrupted_sweep(args: list[str], tmp_path: Path, monkeypatch, after: int) -> Path:
    """Runs `mpsimpact <args> --out tmp_path/s` and interrupts it (Ctrl-C) after `after` cells are observed
    (bmm cells first, then the families): returns the partial folder it leaves."""
    real, calls = cell_module.observe, []

    def stop(cell, *rest, **kwargs):
        calls.append(cell)
        if len(calls) > after:
            raise KeyboardInterrupt
        return real(cell, *rest, **kwargs)

    monkeypatch.setattr(cell_module, "observe", stop)
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "s")])
    assert result.exit_code == 130, result.output
    monkeypatch.setattr(cell_module, "observe", real)
    return tmp_path / ".s.partial"
