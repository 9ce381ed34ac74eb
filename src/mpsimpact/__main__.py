"""`python -m mpsimpact ...`: the same command line as the `mpsimpact` script."""

from mpsimpact.cli import app

if __name__ == "__main__":  # importing the module (a walk over the package's submodules) runs nothing
    app(prog_name="mpsimpact")
