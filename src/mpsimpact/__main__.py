"""`python -m mpsimpact ...`: the same command line as the `mpsimpact` script."""

from mpsimpact.cli import app

app(prog_name="mpsimpact")
